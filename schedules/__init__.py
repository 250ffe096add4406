"""schedules: pipeline schedules as data — generate, validate, simulate, draw.

Works on abstract stage costs and imports nothing of ours and no torch: small and exactly testable.
"""

from .comm import insert_comms
from .csvio import from_csv, to_csv
from .draw import ascii_timeline, chrome_trace, gantt_png, write_chrome_trace
from .generators import SCHEDULE_NAMES, build_schedule
from .ir import Action, Kind, Schedule, parse_schedule
from .memory import STATES, StageBytes, occupancy, recomputes, replay
from .order import canonical_order, issue_order
from .simulate import Costs, Span, Timeline, Transfer, simulate
from .validate import ScheduleError, grid, validate

__all__ = [
    "SCHEDULE_NAMES",
    "STATES",
    "Action",
    "Costs",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Span",
    "StageBytes",
    "Timeline",
    "Transfer",
    "ascii_timeline",
    "build_schedule",
    "canonical_order",
    "chrome_trace",
    "from_csv",
    "gantt_png",
    "grid",
    "insert_comms",
    "issue_order",
    "occupancy",
    "parse_schedule",
    "recomputes",
    "replay",
    "simulate",
    "to_csv",
    "validate",
    "write_chrome_trace",
]
