#!/bin/bash
# Oracle: write a stdlib HTTP server and start it detached, so it outlives this script.
set -euo pipefail
cat > /app/inventory_server.py <<'PY'
import csv
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

with open("/app/inventory.csv", newline="") as handle:
    ITEMS = {row["sku"]: {"sku": row["sku"], "name": row["name"], "qty": int(row["qty"])}
             for row in csv.DictReader(handle)}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status, body, kind="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/health":
            return self._send(200, b"ok", "text/plain")
        if url.path.startswith("/items/"):
            item = ITEMS.get(url.path[len("/items/"):])
            return self._send(200, item) if item else self._send(404, {"error": "not found"})
        if url.path == "/low-stock":
            try:
                below = int(parse_qs(url.query)["below"][0])
            except (KeyError, ValueError):
                return self._send(400, {"error": "below must be an integer"})
            return self._send(200, sorted(s for s, item in ITEMS.items() if item["qty"] < below))
        return self._send(404, {"error": "not found"})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", 8731), Handler).serve_forever()
PY
setsid nohup python3 /app/inventory_server.py >/dev/null 2>&1 < /dev/null &
# Wait until it answers, so the server is up before this action ends.
for _ in $(seq 50); do
    python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8731/health", timeout=1)' 2>/dev/null && exit 0
    sleep 0.2
done
echo "server did not start" >&2
exit 1
