"""schedules: pipeline schedules as data — generate, validate, simulate, draw.

Imports nothing of ours. (The generators, validator and simulator arrive with issue #3; until then
the planner scores candidates with the closed forms in planner/pipeline.py.)
"""

__all__: list[str] = []
