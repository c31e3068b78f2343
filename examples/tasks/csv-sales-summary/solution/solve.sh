#!/bin/bash
# Oracle: parse the export by the stated rules and write both outputs.
set -euo pipefail
mkdir -p /app/out
python3 - <<'PY'
import datetime
import json
import re
from decimal import Decimal, InvalidOperation, ROUND_HALF_UP

valid = skipped = 0
regions, products = {}, {}
with open("/app/data/sales.csv") as handle:
    lines = handle.read().splitlines()[1:]
for line in lines:
    if not line.strip() or line.lstrip().startswith("#"):
        continue
    fields = [field.strip() for field in line.split(",")]
    try:
        date, region, product, units, price = fields
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            raise ValueError(date)
        datetime.date.fromisoformat(date)
        if not re.fullmatch(r"\d+", units) or int(units) <= 0:
            raise ValueError(units)
        price = Decimal(price)
        if not price.is_finite() or price < 0:
            raise ValueError(price)
    except (ValueError, InvalidOperation):
        skipped += 1
        continue
    valid += 1
    revenue = int(units) * price
    total = regions.setdefault(region.lower(), {"units": 0, "revenue": Decimal(0)})
    total["units"] += int(units)
    total["revenue"] += revenue
    products[product] = products.get(product, Decimal(0)) + revenue

cent = Decimal("0.01")
summary = {
    "valid_rows": valid,
    "skipped_rows": skipped,
    "regions": {
        name: {"units": t["units"], "revenue": float(t["revenue"].quantize(cent, ROUND_HALF_UP))}
        for name, t in sorted(regions.items())
    },
}
with open("/app/out/summary.json", "w") as handle:
    json.dump(summary, handle, indent=2)
    handle.write("\n")
top = sorted(products.items(), key=lambda item: (-item[1], item[0]))[:3]
with open("/app/out/top_products.csv", "w") as handle:
    handle.write("product,revenue\n")
    for product, revenue in top:
        handle.write(f"{product},{revenue.quantize(cent, ROUND_HALF_UP)}\n")
PY
cat /app/out/summary.json /app/out/top_products.csv
