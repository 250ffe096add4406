"""schedules: pipeline schedules as data — generate, validate, simulate, draw.

Works on abstract stage costs and imports nothing of ours and no torch: small and exactly testable.
"""

from .comm import insert_comms
from .csvio import from_csv, to_csv
from .draw import ascii_timeline, chrome_trace, gantt_png, write_chrome_trace
from .generators import SCHEDULE_NAMES, build_schedule
from .ir import Action, Kind, Schedule, parse_schedule
from .simulate import Costs, Span, Timeline, Transfer, simulate
from .validate import ScheduleError, grid, validate

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Costs",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Span",
    "Timeline",
    "Transfer",
    "ascii_timeline",
    "build_schedule",
    "chrome_trace",
    "from_csv",
    "gantt_png",
    "grid",
    "insert_comms",
    "parse_schedule",
    "simulate",
    "to_csv",
    "validate",
    "write_chrome_trace",
]
