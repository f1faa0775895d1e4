"""A benchmark script's rows (a list of flat dicts): chosen by name, shown as they come,
written as JSON and CSV."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from tabulate import tabulate


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


def chosen(parser: argparse.ArgumentParser, text: str, known) -> list[str]:
    """The comma-separated names in ``text``; a usage error naming any not in ``known``."""
    names = text.split(",")
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(known)}")
    return names


def shown(rows: list[dict], row: dict) -> None:
    """Keep ``row`` and print it at once, so a long run shows its progress."""
    rows.append(row)
    print(tabulate([row], headers="keys", floatfmt=".3g"), flush=True)


def finished(rows: list[dict], json_path: Path | None, csv_path: Path | None) -> None:
    """Print every row as one table and write them."""
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    write_rows(rows, json_path, csv_path)
