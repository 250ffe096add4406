"""Exact allocation accounting, per owner: every byte the allocator hands out while tracing, and
who it belongs to.

torch.profiler with `profile_memory=True` receives a report from the allocator itself for every
allocation and every free: its address, its size (on CUDA the caching allocator's rounded block,
so rounding is included) and its device. Code marks whom its allocations belong to with
`owned_by("stage2")`; an allocation belongs to the innermost such range open when it is made
(by time, so work the autograd engine runs on another thread is attributed too), and its free is
charged to the same owner whenever and wherever it happens.

    with trace_allocations() as trace:
        with owned_by("stage0"):
            a = torch.empty(1000)          # +4000 bytes for stage0
        with owned_by("stage1"):
            del a                          # -4000 bytes for stage0 (its owner), not stage1
    trace.peaks()  -> {"stage0": 4000}

A free of memory allocated before the trace began makes the CPU allocator warn once, on stderr;
the trace holds that line back (and only that line).

What was allocated before tracing began is not seen: a trace measures what a piece of work adds
on top of what already exists (the caller counts the latter, e.g. parameters, itself).
"""

from __future__ import annotations

import bisect
import os
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

PREFIX = "gpipe.mem:"
UNOWNED = "-"  # the default group of allocations made outside every owned_by range


def _by_owner(owner: str | None, device: str) -> Hashable:
    return UNOWNED if owner is None else owner


def owned_by(owner: str) -> AbstractContextManager[object]:
    """Allocations made inside belong to `owner` (the innermost range wins)."""
    return torch.profiler.record_function(PREFIX + owner)


@dataclass(frozen=True, slots=True)
class Allocation:
    time_ns: int
    size: int  # > 0 allocated, < 0 freed
    owner: str | None  # None: made outside every owned_by range
    device: str


@dataclass
class AllocationTrace:
    """Allocation and free events in time order, each charged to the owner of the allocation."""

    events: list[Allocation] = field(default_factory=list)
    ranges: list[tuple[int, int, str]] = field(default_factory=list)  # owned_by (start, end, owner)

    def levels(
        self, group: Callable[[str | None, str], Hashable | None] = _by_owner
    ) -> dict[Hashable, list[tuple[int, int]]]:
        """Bytes alive per group after every event that changes it: {group: [(time_ns, bytes)]}.
        `group(owner, device)` names the group an event counts for (None: ignore the event)."""
        level: dict[Hashable, int] = {}
        out: dict[Hashable, list[tuple[int, int]]] = {}
        for e in self.events:
            g = group(e.owner, e.device)
            if g is None:
                continue
            level[g] = level.get(g, 0) + e.size
            out.setdefault(g, []).append((e.time_ns, level[g]))
        return out

    def peaks(
        self, group: Callable[[str | None, str], Hashable | None] = _by_owner
    ) -> dict[Hashable, int]:
        """The most bytes alive at once, per group (never below 0)."""
        return {g: max(0, *(b for _, b in steps)) for g, steps in self.levels(group).items()}

    def live(
        self, group: Callable[[str | None, str], Hashable | None] = _by_owner
    ) -> dict[Hashable, int]:
        """Bytes still alive at the end of the trace, per group."""
        return {g: steps[-1][1] for g, steps in self.levels(group).items()}


@contextmanager
def trace_allocations() -> Iterator[AllocationTrace]:
    """Trace every allocation and free made inside the block (the trace is filled on exit)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    trace = AllocationTrace()
    prof = profile(activities=activities, profile_memory=True, record_shapes=False)
    with _stderr_without(NOISE):
        prof.__enter__()
        try:
            yield trace
        finally:
            prof.__exit__(None, None, None)
    trace.events, trace.ranges = _events(prof)


# What the profiler and allocator say on stderr that is not news: kineto logs every start and
# stop; the CPU allocator warns when a block older than the trace is freed.
NOISE = ("profiler_start", "profiler_stop", "allocated before the profiling started")


@contextmanager
def _stderr_without(noise: tuple[str, ...]) -> Iterator[None]:
    """Hold back stderr (file descriptor 2, where C++ writes) and pass on every line but noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in line for n in noise):
                    sys.stderr.write(line)
            sys.stderr.flush()


def _events(prof: torch.profiler.profile) -> tuple[list[Allocation], list[tuple[int, int, str]]]:
    # NOTE: the event tree is what torch's own memory profiler reads (torch/profiler/
    # _memory_profiler.py); it is the one place the allocator's per-address reports surface.
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    ranges: list[tuple[int, int, str]] = []
    raw: list[tuple[int, int, int, int, str]] = []  # (time, order, ptr, size, device)
    stack = list(tree)
    while stack:
        node = stack.pop()
        if node.name.startswith(PREFIX):
            ranges.append((node.start_time_ns, node.end_time_ns, node.name[len(PREFIX) :]))
        if node.typed[0] == _EventType.Allocation:
            f = node.typed[1]
            raw.append((node.start_time_ns, len(raw), f.ptr, f.alloc_size, str(f.device)))
        stack.extend(node.children)
    raw.sort()
    owner_at = _owner_lookup(ranges)
    owners: dict[tuple[str, int], str | None] = {}  # (device, address) -> owner of the live block
    out = []
    for t, _, ptr, size, device in raw:
        if size > 0:
            owner = owner_at(t)
            owners[(device, ptr)] = owner
        elif (device, ptr) in owners:
            owner = owners.pop((device, ptr))
        else:
            continue  # allocated before the trace began
        out.append(Allocation(t, size, owner, device))
    return out, sorted(ranges)


def _owner_lookup(ranges: list[tuple[int, int, str]]) -> Callable[[int], str | None]:
    """time -> the innermost owned_by range open then. Ranges nest (one thread opens them), so a
    sweep over their boundaries with a stack gives the innermost one between any two boundaries."""
    bounds: list[tuple[int, int, int, int]] = []  # (time, 0 end / 1 start, tie-break, range index)
    for k, (start, end, _) in enumerate(ranges):
        bounds.append((start, 1, -end, k))
        bounds.append((end, 0, -start, k))
    bounds.sort()
    marks: list[int] = []
    inner: list[str | None] = []
    stack: list[int] = []
    for t, is_start, _, k in bounds:
        if is_start:
            stack.append(k)
        elif stack and stack[-1] == k:
            stack.pop()
        elif k in stack:
            stack.remove(k)
        top = ranges[stack[-1]][2] if stack else None
        if marks and marks[-1] == t:
            inner[-1] = top
        else:
            marks.append(t)
            inner.append(top)

    def at(t: int) -> str | None:
        k = bisect.bisect_right(marks, t) - 1
        return inner[k] if k >= 0 else None

    return at
