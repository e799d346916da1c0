"""Message sizes as benchmarks take and print them: ``4K``, ``64M`` in, ``4 KiB``, ``64 MiB`` out."""

from __future__ import annotations

__all__ = ["label", "parse", "powers"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse(text: str) -> int:
    """Bytes of ``"4096"``, ``"4K"``, ``"64M"``, ``"1 GiB"`` (binary units)."""
    s = text.strip().upper().replace(" ", "")
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    if not digits or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (give bytes, or a number with K, M or G)")
    return int(float(digits) * _UNITS[unit])


def label(nbytes: int) -> str:
    """``8 B``, ``4 KiB``, ``64 MiB`` (whole units; sizes here are powers of two)."""
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B"


def powers(low: int, high: int, factor: int = 4) -> tuple[int, ...]:
    """``low``, ``low * factor``, ... up to ``high`` inclusive."""
    out = []
    n = low
    while n <= high:
        out.append(n)
        n *= factor
    return tuple(out)
