#!/bin/bash
# Oracle: svc-report with two jq programs, then run it on the catalogue.
set -euo pipefail
mkdir -p /app/bin
cat > /app/bin/svc-report <<'SH'
#!/bin/bash
set -euo pipefail
input="$1"
outdir="$2"
mkdir -p "$outdir"
jq -s '[ .[] | select(.enabled == true)
         | {name, port, team: (.owner.team? // "unowned")} ]
       | sort_by(.port)' "$input" > "$outdir/enabled.json"
jq 'reduce .[] as $s ({}; .[$s.team] += 1)' "$outdir/enabled.json" > "$outdir/teams.json"
SH
chmod +x /app/bin/svc-report
/app/bin/svc-report /app/data/services.ndjson /app/out
cat /app/out/enabled.json /app/out/teams.json
