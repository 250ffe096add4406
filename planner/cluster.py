"""Cluster: the devices a pipeline runs on, in pipeline order, and the links between them."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from profiler.artifact import Artifact, LaterFields
from profiler.limits import (
    MAX_BANDWIDTH,
    MAX_BYTES,
    MAX_DEVICES,
    MAX_MS,
    MAX_SPEED,
    MIN_BANDWIDTH,
    MIN_SPEED,
    ArgumentError,
    Text,
    real,
    whole,
)

from .units import parse_size


def _either(field: dict[str, Any], other: dict[str, Any]) -> None:
    """A property's JSON schema widened to `other` too (its title, description kept)."""
    own = {k: field.pop(k) for k in list(field) if k not in ("title", "description", "default")}
    field["anyOf"] = [own, other]


def _sizes_as_written(schema: dict[str, Any]) -> None:
    """The JSON schema of what a cluster file may say: sizes as text ("80GiB") too."""
    text = {"type": "string", "description": 'as people write it: "80GiB", "16GB", "16e9"'}
    for name in ("memory_bytes", "reserved_bytes"):
        _either(schema["properties"][name], text)


def _links_as_written(schema: dict[str, Any]) -> None:
    """... and `links` given by host as an object beside the list."""
    by_host = schema["properties"]["host_links"]
    ref = next(x for x in by_host.get("anyOf", [by_host]) if "$ref" in x)  # pydantic's own
    _either(schema["properties"]["links"], dict(ref))


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_sizes_as_written)
    name: Text = Field(min_length=1)
    memory_bytes: int = Field(gt=0, le=MAX_BYTES, description="what a stage on this device may use")
    speed: float = Field(
        default=1.0,
        ge=MIN_SPEED,
        le=MAX_SPEED,
        allow_inf_nan=False,
        strict=True,  # (true or "1.0" is no speed: found by a red team)
        description="relative to the profiled device",
    )
    reserved_bytes: int = Field(
        default=0,
        ge=0,
        le=MAX_BYTES,
        description="memory the runtime takes before any stage (CUDA context...)",
    )
    torch_device: Text | None = Field(
        default=None, description="where a compiled pipe puts this stage, e.g. cuda:3"
    )
    host: Text | None = Field(
        default=None, min_length=1, description="the machine it is in, for links given by host"
    )

    @field_validator("torch_device")
    @classmethod
    def _device_kind(cls, v: str | None) -> str | None:
        """A device a pipeline can train on (found by a red team: "meta" and "nonsense" passed,
        and the program failed when it ran)."""
        # (cpu:N stays: torch runs it as the one CPU, and plans made with it must still load)
        if v is not None and not re.fullmatch(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?", v):
            raise ValueError(
                f"torch_device {v!r} is not a device to train on: cpu, cuda, cuda:N (or mps, xpu)"
            )
        return v

    @field_validator("memory_bytes", "reserved_bytes", mode="before")
    @classmethod
    def _size_text(cls, v: object) -> object:
        """Cluster files may write sizes as people do: "80GiB"; true is no size (pydantic
        would read it as 1 byte)."""
        if isinstance(v, bool):
            raise ValueError("a size is a number of bytes or text such as 80GiB, not true/false")
        if isinstance(v, float) and v.is_integer():
            return int(v)  # (80e9 in a file: files are read strictly, where 80e9 is no int)
        if isinstance(v, str):
            if v.strip() in ("0", "0B"):
                return 0
            try:
                return parse_size(v)
            except ArgumentError as e:
                raise ValueError(e.problem) from None
        return v

    @model_validator(mode="after")
    def _room_left(self) -> Device:
        """What the runtime takes first must leave room for a stage (found by the red team:
        more than the device read as "no split fits", as if the model were too large)."""
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(
                f"device {self.name}: reserved_bytes ({self.reserved_bytes}) leaves nothing of "
                f"memory_bytes ({self.memory_bytes}) for a stage"
            )
        return self


class Link(LaterFields):
    """The link from device k to device k+1 (pipeline neighbours)."""

    model_config = ConfigDict(extra="forbid")
    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("late_latency_ms", "late_bandwidth_bytes_per_s")
    bandwidth_bytes_per_s: float | None = Field(
        default=None,
        ge=MIN_BANDWIDTH,
        le=MAX_BANDWIDTH,
        allow_inf_nan=False,
        description="None: transfers are free (not modelled)",
        strict=True,  # (true or "1e9" is no bandwidth: found by the red team)
    )
    latency_ms: float = Field(default=0.0, ge=0, le=MAX_MS, allow_inf_nan=False, strict=True)
    # A message whose receive is posted after its send (the torchrun program's exchanges: a
    # rank posts its send and its receive and waits for both; its peer's receive comes later,
    # after some compute). gloo moves the bytes only once told the receive is posted, and
    # that notice must wake the sender's side: `links` measures such messages apart. None: as
    # above.
    late_latency_ms: float | None = Field(
        default=None,
        ge=0,
        le=MAX_MS,
        allow_inf_nan=False,
        strict=True,
        description="latency of a message received late (None: latency_ms)",
    )
    late_bandwidth_bytes_per_s: float | None = Field(
        default=None,
        ge=MIN_BANDWIDTH,
        le=MAX_BANDWIDTH,
        allow_inf_nan=False,
        strict=True,
        description="bandwidth of a message received late (None: bandwidth_bytes_per_s)",
    )

    @model_validator(mode="after")
    def _late_no_faster(self) -> Link:
        """A late receive costs at least the hand-off (the planner's bounds price every message
        at the hand-off's figures)."""
        if self.late_latency_ms is not None and self.late_latency_ms < self.latency_ms:
            raise ValueError(
                f"late_latency_ms {self.late_latency_ms} is below latency_ms {self.latency_ms}"
            )
        late_bw, bw = self.late_bandwidth_bytes_per_s, self.bandwidth_bytes_per_s
        if late_bw is not None and (bw is None or late_bw > bw):
            raise ValueError(
                f"late_bandwidth_bytes_per_s {late_bw} needs a bandwidth_bytes_per_s of at "
                f"least as much (got {bw})"
            )
        return self

    def transfer_ms(self, nbytes: Any, *, late: bool = False) -> Any:
        """ms to send `nbytes` (a number, or an array of them: then an array); `late`: a
        message whose receive is posted after its send (late_latency_ms ...)."""
        latency, bandwidth = self.latency_ms, self.bandwidth_bytes_per_s
        if late:
            if self.late_latency_ms is not None:
                latency = self.late_latency_ms
            if self.late_bandwidth_bytes_per_s is not None:
                bandwidth = self.late_bandwidth_bytes_per_s
        if bandwidth is None:
            if isinstance(nbytes, np.ndarray):
                return np.where(nbytes != 0, latency, 0.0)
            return latency if nbytes else 0.0
        return nbytes / bandwidth * 1e3 + latency

    @property
    def has_late(self) -> bool:
        return self.late_latency_ms is not None or self.late_bandwidth_bytes_per_s is not None


class HostLinks(BaseModel):
    """Links described by host: one between devices of the same host, one across hosts."""

    model_config = ConfigDict(extra="forbid")
    intra_host: Link
    inter_host: Link


class Cluster(LaterFields, Artifact):
    """Devices in pipeline order: stage k runs on devices[k]. Links are given between
    neighbours in that order, or by host (`links: {"intra_host": ..., "inter_host": ...}`,
    each device naming its `host`), which lets the planner reorder the devices."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_links_as_written)

    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("step_sync_ms",)
    HAND_WRITTEN: ClassVar[bool] = True
    kind: Literal["cluster"] = "cluster"
    devices: list[Device] = Field(min_length=1, max_length=MAX_DEVICES)
    links: list[Link] = Field(
        default_factory=list, description="len(devices) - 1 (derived when given by host), or empty"
    )
    host_links: HostLinks | None = Field(default=None, description="links given by host")
    step_sync_ms: float | None = Field(
        default=None,
        ge=0,
        le=MAX_MS,
        allow_inf_nan=False,
        strict=True,
        description="what a step of the torchrun program spends in its two small all-reduces "
        "among all ranks (its start and end); None: not modelled",
    )

    @model_validator(mode="before")
    @classmethod
    def _by_host(cls, data: object) -> object:
        """`links` written as {"intra_host": ..., "inter_host": ...} means links by host."""
        if isinstance(data, dict) and isinstance(data.get("links"), dict):
            if data.get("host_links") not in (None, data["links"]):
                # (found by a red team: the host_links given beside were dropped unread)
                raise ValueError(
                    "links are given by host twice, as `links` and as `host_links`, and they "
                    "differ: give them once"
                )
            data = {**data, "host_links": data["links"], "links": []}
        return data

    @model_validator(mode="after")
    def _links_fit(self) -> Cluster:
        if self.host_links is not None:
            if any(d.host is None for d in self.devices):
                raise ValueError("links are given by host: every device needs its `host`")
            derived = [
                self.host_links.intra_host if a.host == b.host else self.host_links.inter_host
                for a, b in zip(self.devices[:-1], self.devices[1:])
            ]
            # (a saved cluster holds both: the links it derived, which must still be those)
            if self.links and self.links != derived:
                raise ValueError(
                    "both `links` (a list) and `host_links` are given, and they differ: give "
                    "the links one way (a saved cluster's list is derived from its host_links: "
                    "remove the list after editing them)"
                )
            self.links = derived
        if not self.links:
            self.links = [Link() for _ in range(len(self.devices) - 1)]
        if len(self.links) != len(self.devices) - 1:
            raise ValueError(
                f"{len(self.devices)} devices need {len(self.devices) - 1} links, got {len(self.links)}"
            )
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must differ: {names}")
        return self

    @classmethod
    def uniform(
        cls,
        num_devices: int,
        memory: str | int,
        *,
        speed: float = 1.0,
        bandwidth: float | None = None,
        latency_ms: float = 0.0,
        name: str = "dev",
    ) -> Cluster:
        """`num_devices` identical devices of `memory` each (`"16GiB"` or bytes), `bandwidth`
        bytes per second and `latency_ms` between neighbours (None: transfers are free)."""
        whole(num_devices, "num_devices", 1, MAX_DEVICES)
        real(speed, "speed", MIN_SPEED, MAX_SPEED)
        if bandwidth is not None:
            real(bandwidth, "bandwidth", MIN_BANDWIDTH, MAX_BANDWIDTH)
        real(latency_ms, "latency_ms", 0, MAX_MS)
        if not isinstance(name, str) or not name:
            raise ArgumentError("name", name, "expected a non-empty string")
        mem = parse_size(memory, what="memory")
        return cls(
            devices=[
                Device(name=f"{name}{k}", memory_bytes=mem, speed=speed) for k in range(num_devices)
            ],
            links=[
                Link(bandwidth_bytes_per_s=bandwidth, latency_ms=latency_ms)
                for _ in range(num_devices - 1)
            ],
        )

    @property
    def size(self) -> int:
        return len(self.devices)

    def reordered(self, order: list[int]) -> Cluster:
        """The same devices in pipeline order `order` (indices into devices). Links follow the
        hosts when given by host; links between listed neighbours must all be alike."""
        if sorted(order) != list(range(self.size)):
            raise ValueError(f"{order} is not an order of {self.size} devices")
        devices = [self.devices[k] for k in order]
        if self.host_links is not None:
            return Cluster(
                devices=devices,
                links=[],
                host_links=self.host_links,
                step_sync_ms=self.step_sync_ms,
            )
        if any(link != self.links[0] for link in self.links):
            raise ArgumentError(
                "cluster",
                "links between neighbours",
                "its links are given between the listed devices, so another order has no "
                'known links; describe them by host ({"intra_host": ..., "inter_host": ...}) '
                "to let the planner reorder devices",
            )
        return Cluster(devices=devices, links=list(self.links), step_sync_ms=self.step_sync_ms)

    def placements(self, limit: int = 120) -> tuple[list[list[int]], bool]:
        """The device orders worth planning for: every distinct order (devices alike in memory,
        speed, reserve and host are interchangeable; with links by host, orders alike but for
        the hosts' names are one). Where there are more than `limit` and
        links are given by host, those that keep each host's devices together (the pipeline
        crosses hosts no more than it must), which need not hold the fastest: the flag says
        whether the orders returned are all of them. At most `limit`, the given order first."""
        sig = [(d.memory_bytes, d.speed, d.reserved_bytes) for d in self.devices]
        if self.host_links is not None:
            hosted = [(*k, d.host) for k, d in zip(sig, self.devices)]
            # Two orders with the same devices position by position and a host change at the
            # same neighbours are one problem (the hosts' names aside: a, a, b, b and b, b, a, a
            # on alike devices), planned once, the first listed; so up to `limit` problems
            # from as many as SAME_PROBLEM times that many orders
            every = _distinct_orders(hosted, SAME_PROBLEM * limit)
            problems: dict[tuple, tuple] = {}
            for q in every:
                key = (tuple(x[:3] for x in q), tuple(a[3] == b[3] for a, b in zip(q, q[1:])))
                problems.setdefault(key, q)
            if len(every) <= SAME_PROBLEM * limit and len(problems) <= limit:
                # (found by the red team: an intra-host link slower than the inter-host one,
                # or a host's small device better placed elsewhere, makes an order that
                # splits a host the fastest)
                given = list(range(self.size))
                return [_assign(given, q, hosted) for q in problems.values()], True
            hosts: dict[str, list[int]] = {}
            for k, d in enumerate(self.devices):
                hosts.setdefault(str(d.host), []).append(k)
            groups = list(hosts.values())
            # hosts alike (the same device kinds) are interchangeable as whole groups
            kind = [tuple(sorted(sig[k] for k in g)) for g in groups]
            outer = _distinct_orders(kind, limit)
            orders: list[list[int]] = []
            for seq in outer[:limit]:
                pools = {
                    i: [g for g, kd in zip(groups, kind) if kd == kind[i]]
                    for i in range(len(groups))
                }
                picked: list[list[int]] = []
                used: dict[tuple, int] = {}
                for kd in seq:
                    i = kind.index(kd)
                    picked.append(pools[i][used.get(kd, 0)])
                    used[kd] = used.get(kd, 0) + 1
                inner = [_distinct_orders([sig[k] for k in g], limit) for g in picked]
                combos = [[]]
                for g, seqs in zip(picked, inner):
                    combos = [c + _assign(g, q, sig) for c in combos for q in seqs][: limit + 1]
                orders += combos
                if len(orders) > limit:
                    break
            # (more orders than `limit`: those splitting a host left out, but the given one,
            # which comes first, so that reordering never plans worse than the order given)
            given = list(range(self.size))
            return [given, *[o for o in orders if o != given]][:limit], False
        seqs = _distinct_orders(sig, limit)
        return [_assign(list(range(self.size)), q, sig) for q in seqs[:limit]], len(seqs) <= limit


# how many orders placements() enumerates per problem it may list, to find those that are one
# problem (2 hosts of alike devices: 2 orders each; 3 hosts: up to 6)
SAME_PROBLEM = 8


def _distinct_orders(items: list, limit: int) -> list[tuple]:
    """Distinct orderings of a multiset, the given order first; at most limit + 1. Iterative
    (next permutation in the order of first appearance), so any number of devices is fine."""
    rank = {x: i for i, x in enumerate(dict.fromkeys(items))}
    keys = list(rank)
    first = tuple(items)
    out = [first]
    seq = sorted(rank[x] for x in items)
    while len(out) <= limit:
        word = tuple(keys[i] for i in seq)
        if word != first:
            out.append(word)
        # the next permutation of seq, or stop after the last
        i = len(seq) - 2
        while i >= 0 and seq[i] >= seq[i + 1]:
            i -= 1
        if i < 0:
            break
        j = len(seq) - 1
        while seq[j] <= seq[i]:
            j -= 1
        seq[i], seq[j] = seq[j], seq[i]
        seq[i + 1 :] = reversed(seq[i + 1 :])
    return out


def _assign(devices: list[int], seq: tuple, sig: list) -> list[int]:
    """The devices of `devices` in the order of signatures `seq` (alike ones as listed)."""
    pool: dict = {}
    for k in devices:
        pool.setdefault(sig[k], []).append(k)
    taken: dict = {}
    out = []
    for x in seq:
        i = taken.get(x, 0)
        out.append(pool[x][i])
        taken[x] = i + 1
    return out
