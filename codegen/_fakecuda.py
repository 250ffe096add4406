# ---------------------------------------------------------------------------------------------
# gpipe-plan stand-in for torch.cuda's streams and events, for the stream checker
# (_streamcheck.py): a stream is a queue of work with a clock per stream it has heard of, an
# event a copy of those clocks. Nothing runs on them; they only say what is ordered before what:
#
#     an op on S             S[S] += 1; what it reads and writes is stamped (S, S[S])
#     event.record(S)        the event keeps a copy of S's clocks
#     S.wait_event(e)        S := max(S, e)          S.wait_stream(T):  S := max(S, T)
#     the host waits         (synchronize, a blocking copy, query() saying done): every stream,
#                            and each stream made later, := max(S, what the host waited for)
#
# Work stamped (U, c) is ordered before S's next op when S[U] >= c.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import time  # emit: drop
from typing import Any  # emit: drop

import torch  # emit: drop

_CHECKS: list[Any] = []  # the StreamCheck running now (innermost last)


def _running() -> Any:
    if not _CHECKS:
        raise RuntimeError("the CUDA stand-in was used outside a StreamCheck")
    return _CHECKS[-1]


def _index(device: Any) -> int:
    """The cuda device index a torch.cuda call means (None: the current device)."""
    if device is None:
        return _running().device
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"expected a cuda device, got {d}")
    return d.index if d.index is not None else _running().device


class FakeStream:
    """torch.cuda.Stream's stand-in: a queue of work with a clock per stream it has seen."""

    def __init__(self, device: Any = None, priority: int = 0, name: str = "") -> None:
        check = _running()
        self.index = _index(device)
        self.device = torch.device("cuda", self.index)
        self.id = len(check.streams)
        self.name = name or f"stream {self.id} of cuda:{self.index}"
        self.clock: dict[int, int] = {**check.host, self.id: 0}  # after all the host waited for
        check.streams.append(self)

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def join(self, clock: dict[int, int]) -> None:
        for k, v in clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v

    def orders(self, other: FakeStream, stamp: int) -> bool:
        """Is work stamped `stamp` on `other` finished before this stream's next op?"""
        return self.clock.get(other.id, 0) >= stamp

    def wait_event(self, event: FakeEvent) -> None:
        if event.clock is not None:  # waiting on an event never recorded: no-op, as on CUDA
            self.join(event.clock)

    def wait_stream(self, stream: FakeStream) -> None:
        self.join(stream.clock)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _running().host_waits(self.clock)

    def query(self) -> bool:
        """True (all done, on the CPU): so the host saw everything issued to it finish."""
        self.synchronize()
        return True

    def __enter__(self) -> FakeStream:  # `with stream:` as torch.cuda.stream(stream)
        self._context = _running().stream(self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<{self.name}>"


class FakeEvent:
    """torch.cuda.Event's stand-in: a copy of a stream's clocks when recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self.clock: dict[int, int] | None = None
        self.at = 0.0
        self.index = -1  # the device it was recorded on

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or _running().current_stream()
        self.clock = dict(stream.clock)
        self.at = time.perf_counter()
        self.index = stream.index

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or _running().current_stream()).wait_event(self)

    def query(self) -> bool:
        """True (done, on the CPU): so the host saw the recorded work finish."""
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            _running().host_waits(self.clock)

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.clock is None or end.clock is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self.index != end.index:  # as CUDA: cudaEventElapsedTime fails across devices
            raise RuntimeError(
                f"CUDA cannot time events of two devices (cuda:{self.index}, cuda:{end.index})"
            )
        return (end.at - self.at) * 1e3


def _latest(clocks: Any) -> dict[int, int]:
    """The elementwise maximum of some clocks."""
    out: dict[int, int] = {}
    for clock in clocks:
        for k, v in clock.items():
            if out.get(k, 0) < v:
                out[k] = v
    return out
