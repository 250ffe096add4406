import pytest

from planner.units import format_size, parse_bandwidth, parse_size
from profiler.artifact import InputError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("16GB", 16 * 10**9),
        ("16e9", 16 * 10**9),
        ("17179869184", 17179869184),
        ("1.5 MiB", 3 * 2**19),
        ("512kib", 512 * 1024),
        ("2T", 2 * 10**12),
        (" 7 B ", 7),
        ("2.0", 2),
        ("1.64KiB", 1679),  # (a part of a byte of a larger unit: floored)
        (0.9 * 16e9, 14_400_000_000),  # (a number computed in Python: floored)
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "16 GiBs", "sixteen", "1..5GB", "0", "-4GiB", "0.1", "1.5", "7.5B"]
)  # (a part of a byte, no unit: red team)
def test_parse_size_refuses(text):
    with pytest.raises(InputError):
        parse_size(text)


def test_bandwidth_and_format():
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("100mib/s") == parse_bandwidth("100MiB/s") == 100 * 2**20
    assert format_size(3 * 2**29) == "1.5 GiB"
    assert format_size(512) == "512 B"


@pytest.mark.parametrize("text", ["1Gb/s", "100Mb", "10kb/s", "8000000b/s"])
def test_a_bandwidth_in_bits_is_refused(text):
    """Found by a red team: 1Gb/s, a link's gigabits, was read as 1 GB/s (8x too fast)."""
    with pytest.raises(InputError, match="lower-case b reads as bits"):
        parse_bandwidth(text)
    assert parse_bandwidth(text.replace("b", "B")) > 0  # (bytes: read)
