"""Cluster: the devices a pipeline runs on, in pipeline order, and the links between them."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from profiler.artifact import Artifact, InputError

from .units import parse_size


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    memory_bytes: int = Field(gt=0, description="what a stage on this device may use")
    speed: float = Field(default=1.0, gt=0, description="relative to the profiled device")
    reserved_bytes: int = Field(
        default=0, ge=0, description="memory the runtime takes before any stage (CUDA context...)"
    )
    torch_device: str | None = Field(
        default=None, description="where a compiled pipe puts this stage, e.g. cuda:3"
    )

    @field_validator("memory_bytes", "reserved_bytes", mode="before")
    @classmethod
    def _size_text(cls, v: object) -> object:
        """Cluster files may write sizes as people do: "80GiB"."""
        if isinstance(v, str):
            try:
                return parse_size(v)
            except InputError as e:
                raise ValueError(str(e)) from None
        return v


class Link(BaseModel):
    """The link from device k to device k+1 (pipeline neighbours)."""

    model_config = ConfigDict(extra="forbid")
    bandwidth_bytes_per_s: float | None = Field(
        default=None, gt=0, description="None: transfers are free (not modelled)"
    )
    latency_ms: float = Field(default=0.0, ge=0)

    def transfer_ms(self, nbytes: float) -> float:
        if self.bandwidth_bytes_per_s is None:
            return self.latency_ms if nbytes else 0.0
        return nbytes / self.bandwidth_bytes_per_s * 1e3 + self.latency_ms


class Cluster(Artifact):
    """Devices in pipeline order: stage k runs on devices[k]."""

    kind: Literal["cluster"] = "cluster"
    devices: list[Device] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list, description="len(devices) - 1, or empty")

    @model_validator(mode="after")
    def _links_fit(self) -> Cluster:
        if not self.links:
            self.links = [Link() for _ in range(len(self.devices) - 1)]
        if len(self.links) != len(self.devices) - 1:
            raise ValueError(
                f"{len(self.devices)} devices need {len(self.devices) - 1} links, got {len(self.links)}"
            )
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
        """`num_devices` identical devices of `memory` each (`"16GiB"` or bytes)."""
        if num_devices < 1:
            raise InputError(f"--devices {num_devices}: need at least one device")
        if not math.isfinite(speed) or speed <= 0:
            raise InputError(f"speed {speed}: must be positive")
        mem = parse_size(memory, what="--memory")
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
