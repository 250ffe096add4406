"""How large an input may be, and the argument checks every public function shares.

The bounds are far past any real job and keep every loop and every integer the planner computes
finite (its byte counts are int64): an input beyond them is refused at once, never searched.
Torch-free.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field

from .artifact import InputError

MAX_BYTES = 2**50  # 1 PiB: per device, per layer, per tensor
MAX_MS = 1e9  # about 11.6 days: any one time a profile or cluster states
MIN_MS = 1e-6  # a nanosecond: a profile's time below it, which no timer measures, is planned as 0
MAX_LAYERS = 2**17
MAX_DEVICES = 1024
MAX_MICROBATCHES = 1024
MAX_BATCH = 2**24  # samples in one mini-batch
MAX_SPEED = 1e6  # a device's speed relative to the profiled one
MIN_SPEED = 1e-3
MAX_BANDWIDTH = 1e18  # bytes per second
MIN_BANDWIDTH = 1e3
INT64_SAFE = 2**62  # the planner's byte arithmetic stays below this


# Text a file may hold where a program or a table prints it: one line, no control characters
# (a newline in a device name would end a comment in the emitted program and start code; C1
# controls, bidirectional overrides and marks, line separators and invisible characters would
# reach the terminal as they are: red teams'; the joiners Persian and emoji use pass)
Text = Annotated[
    str,
    Field(
        pattern=(
            r"^[^\x00-\x1f\x7f-\x9f\xad\u061c\u180e\u200b\u200e\u200f\u2028-\u202e"
            r"\u2060-\u2069\u3164\ufeff\U000e0000-\U000e007f]*$"
        ),
        max_length=1024,
    ),
]
# A torch dtype by its name in torch (torch.float32 -> "float32").
DType = Annotated[
    str, Field(pattern=r"^(float(16|32|64)|bfloat16|u?int(8|16|32|64)|bool|complex(64|128))$")
]


class ArgumentError(InputError):
    """A bad argument to a public function, named as the function names it. The CLI reports it
    under its own flag name (`--batch-size` for `batch_size`)."""

    def __init__(self, arg: str, value: Any, problem: str, *, missing: bool = False) -> None:
        self.arg, self.value, self.problem, self.missing = arg, value, problem, missing
        if missing:  # not wrong but absent: "input_shape is required: ..."
            super().__init__(f"{arg} {problem}")
        else:
            shown = f"{arg} {_shown(value)}" if arg.startswith("-") else f"{arg}={value!r}"
            super().__init__(f"{shown}: {problem}")

    def named(self, flag: str, given: str | None = None) -> str:
        """The message with `flag` for the argument, and what was typed after it when that is
        not the value itself (how the CLI words it)."""
        if self.missing:
            return f"{flag} {self.problem}"
        return f"{flag} {_shown(self.value if given is None else given)}: {self.problem}"


def _shown(value: Any) -> Any:
    """What was typed, as typed; quoted where it holds a control character (a line break, a
    record separator), so that the message stays one line."""
    return repr(value) if isinstance(value, str) and not value.isprintable() else value


def whole(value: Any, arg: str, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi]; a float, bool or string is refused, not rounded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(arg, value, f"expected a whole number from {lo} to {hi}")
    if not lo <= value <= hi:
        raise ArgumentError(arg, value, f"must be from {lo} to {hi}")
    return value


def real(value: Any, arg: str, lo: float, hi: float, *, above: bool = False) -> float:
    """`value` as a finite float in [lo, hi] (or (lo, hi] when `above`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentError(arg, value, "expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(arg, value, "must be a finite number")
    if value < lo or (above and value == lo) or value > hi:
        low = f"more than {lo:g}" if above else f"at least {lo:g}"
        raise ArgumentError(arg, value, f"must be {low} and at most {hi:g}")
    return value


def choice(value: Any, arg: str, allowed: tuple[str, ...] | list[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ArgumentError(arg, value, f"choose one of {', '.join(allowed)}")
    return value
