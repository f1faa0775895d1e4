"""Bytes as people read them."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': binary units, as allocators report."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_apart(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` as ``format_bytes`` writes them, or in bytes where that rounds two
    different numbers to one text ('2.5 MiB is below 2.5 MiB' says nothing).

    Example:
        >>> format_apart(2_621_440, 2_621_500)
        ('2,621,440 B', '2,621,500 B')
        >>> format_apart(1024, 4096)
        ('1.0 KiB', '4.0 KiB')
    """
    short = format_bytes(a), format_bytes(b)
    if a != b and short[0] == short[1]:
        return f"{a:,} B", f"{b:,} B"
    return short
