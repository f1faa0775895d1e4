"""Writing a benchmark script's rows (a list of flat dicts) as JSON and CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def write_rows(rows: list[dict], json_path: Path | None, csv_path: Path | None) -> None:
    """Write ``rows`` to whichever of the two paths is given (creating folders)."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=2))
    if csv_path and rows:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            fields = list(dict.fromkeys(k for row in rows for k in row))  # a refusal's too
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
