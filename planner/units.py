"""Sizes and bandwidths as people write them: 16GiB, 16GB, 16e9, 17179869184, 25GB/s."""

from __future__ import annotations

import decimal
import math
import re

from profiler.limits import MAX_BANDWIDTH, MAX_BYTES, MIN_BANDWIDTH, ArgumentError

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
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes from `16GiB` (binary), `16GB` (decimal), `16e9` or a plain integer: more than 0,
    at most 1 PiB (MAX_BYTES). Every size read is a capacity (a device's memory, a budget, a
    limit), so a part of a byte is not one: 1.64KiB is 1679.36 bytes, read as 1679, worked out
    in decimal (16.000000012GB is 16000000012 bytes, where a float says 16000000012.000002).
    A need the tool prints rounded up (format_size's `up`) and pasted back still reads as at
    least that need, a whole number of bytes."""
    number = _amount(text, what)
    if number > MAX_BYTES:
        raise ArgumentError(what, text, f"more than {format_size(MAX_BYTES)}; no device holds that")
    if number < 1:
        raise ArgumentError(what, text, "less than one byte")
    if isinstance(text, str):
        m = _SIZE.match(text)
        assert m is not None  # (_amount read it)
        with decimal.localcontext(prec=len(m.group(1)) + 40):  # (exact: no digit rounded)
            exact = decimal.Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        exact = decimal.Decimal(repr(float(text)) if isinstance(text, float) else text)
    if exact < 1:  # (a float may have read it as one)
        raise ArgumentError(what, text, "less than one byte")
    if isinstance(text, str) and exact != math.floor(exact) and _UNITS[m.group(2).lower()] == 1:
        # (found by a red team: a cluster's "1.5", meant with a unit, was read as 1 byte; a
        # number computed in Python, 0.9 * 16e9, is floored as it always was)
        raise ArgumentError(what, text, "a part of a byte; name a unit, as 1.5GiB")
    return math.floor(exact)


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """Bytes per second from `25GB/s` (the `/s` is optional; bits, `1Gb/s`, are refused)."""
    body = text.strip() if isinstance(text, str) else text
    if isinstance(body, str) and body.lower().endswith("/s"):
        body = body[:-2]
    if (
        isinstance(body, str)
        and (m := _SIZE.match(body))
        and re.fullmatch("[kKmMgGtTpP]?b", m.group(2))
    ):
        # (found by a red team: 1Gb/s, a link's gigabits, was read as 1 GB/s, 8x too fast)
        raise ArgumentError(
            what, text, "a lower-case b reads as bits; write bytes per second, as 125MB/s for "
            "1Gb/s"
        )  # fmt: skip
    try:
        value = _amount(body, what)
    except ArgumentError as e:
        raise ArgumentError(what, text, e.problem) from None
    if not MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:
        raise ArgumentError(
            what, text, f"must be from {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g} bytes per second"
        )
    return value


def _amount(text: str | int | float, what: str) -> float:
    """A positive, finite number of bytes as written: 16GiB, 16GB, 16e9, 17179869184."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ArgumentError(what, text, "expected a size such as 16GiB or a number of bytes")
    if isinstance(text, str):
        m = _SIZE.match(text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ArgumentError(
                what, text, "not a size; write e.g. 16GiB, 16GB, 512MiB, 16e9 or 17179869184"
            )
        number = float(m.group(1)) * _UNITS[unit]
    else:
        number = float(text)
    if not math.isfinite(number):
        raise ArgumentError(what, text, "must be a finite number")
    if number <= 0:
        raise ArgumentError(what, text, "must be positive")
    return number


def format_size(n: float, *, up: bool = False) -> str:
    """Binary units, three significant digits: 1.50 GiB, 512 MiB, 12.0 KiB. With `up`, rounded
    up, never down: for what something needs, so that the figure pasted back is enough."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (
        ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)
    ):  # fmt: skip
        if n >= scale:
            x = n / scale
            if up:
                step = 10.0 ** (math.floor(math.log10(x)) - 2)
                x = math.ceil(round(x / step, 6)) * step
            text = f"{x:.3g}"
            return f"{sign}{x:.0f} {unit}" if "e" in text else f"{sign}{text} {unit}"
    return f"{sign}{math.ceil(n) if up else int(n)} B"
