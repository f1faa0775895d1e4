"""Bytes as people read them."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': binary units, as allocators report."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
