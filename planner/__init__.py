"""planner: choose cut points, micro-batch count, recomputation and schedule under memory limits."""

from .cluster import Cluster, Device, Link
from .memory import MemoryModel, StageShape
from .partition import Partition, StageSpec, solve_partition
from .plan import MemoryBreakdown, Plan, StagePlan
from .search import InfeasibleError, plan_pipeline
from .units import format_size, parse_bandwidth, parse_size

__all__ = [
    "Cluster",
    "Device",
    "InfeasibleError",
    "Link",
    "MemoryBreakdown",
    "MemoryModel",
    "Partition",
    "Plan",
    "StagePlan",
    "StageShape",
    "StageSpec",
    "format_size",
    "parse_bandwidth",
    "parse_size",
    "plan_pipeline",
    "solve_partition",
]
