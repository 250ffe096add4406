"""Sizes and bandwidths as people write them: 16GiB, 16GB, 16e9, 17179869184, 25GB/s."""

from __future__ import annotations

import re

from profiler.artifact import InputError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from `16GiB` (binary), `16GB` (decimal), `16e9` or a plain integer. Must be > 0."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise InputError(
                f"{what} {text!r}: not a size; write e.g. 16GiB, 16GB, 512MiB, 16e9 or 17179869184"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InputError(f"{what} {text!r}: must be positive")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes per second from `25GB/s` (the `/s` is optional)."""
    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2]
    return float(parse_size(body, what="bandwidth"))


def format_size(n: float) -> str:
    """Binary units, three significant digits: 1.50 GiB, 512 MiB, 12.0 KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.3g} {unit}"
    return f"{sign}{int(n)} B"
