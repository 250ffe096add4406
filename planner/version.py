"""gpipe-plan's version: the one place it is written (pyproject.toml reads it from here), so
that a plan names the tool that made it without asking the installed metadata (tens of ms of
imports on every run)."""

VERSION = "0.4.0"  # 0.4: a recomputed stage re-runs whole, by hand, at its backward's start
# 0.3: a plan carries the digest of its content, checked when read
# (the first that re-runs a recomputed stage by hand: a plan from before counts torch's
# checkpoint's re-run, and is refused where a stage recomputes: Plan.from_json_text)
REMAT_BY_HAND = (0, 4)
