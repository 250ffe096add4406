"""Cluster: the devices a pipeline runs on, in pipeline order, and the links between them."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from profiler.artifact import Artifact
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


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field(min_length=1)
    memory_bytes: int = Field(gt=0, le=MAX_BYTES, description="what a stage on this device may use")
    speed: float = Field(
        default=1.0,
        ge=MIN_SPEED,
        le=MAX_SPEED,
        allow_inf_nan=False,
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

    @field_validator("memory_bytes", "reserved_bytes", mode="before")
    @classmethod
    def _size_text(cls, v: object) -> object:
        """Cluster files may write sizes as people do: "80GiB"."""
        if isinstance(v, str):
            if v.strip() in ("0", "0B"):
                return 0
            try:
                return parse_size(v)
            except ArgumentError as e:
                raise ValueError(e.problem) from None
        return v


class Link(BaseModel):
    """The link from device k to device k+1 (pipeline neighbours)."""

    model_config = ConfigDict(extra="forbid")
    bandwidth_bytes_per_s: float | None = Field(
        default=None,
        ge=MIN_BANDWIDTH,
        le=MAX_BANDWIDTH,
        allow_inf_nan=False,
        description="None: transfers are free (not modelled)",
    )
    latency_ms: float = Field(default=0.0, ge=0, le=MAX_MS, allow_inf_nan=False)

    def transfer_ms(self, nbytes: Any) -> Any:
        """ms to send `nbytes` (a number, or an array of them: then an array)."""
        if self.bandwidth_bytes_per_s is None:
            if isinstance(nbytes, np.ndarray):
                return np.where(nbytes != 0, self.latency_ms, 0.0)
            return self.latency_ms if nbytes else 0.0
        return nbytes / self.bandwidth_bytes_per_s * 1e3 + self.latency_ms


class Cluster(Artifact):
    """Devices in pipeline order: stage k runs on devices[k]."""

    kind: Literal["cluster"] = "cluster"
    devices: list[Device] = Field(min_length=1, max_length=MAX_DEVICES)
    links: list[Link] = Field(default_factory=list, description="len(devices) - 1, or empty")

    @model_validator(mode="after")
    def _links_fit(self) -> Cluster:
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
