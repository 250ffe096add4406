"""gpipe-plan's version: the one place it is written (pyproject.toml reads it from here), so
that a plan names the tool that made it without asking the installed metadata (tens of ms of
imports on every run)."""

VERSION = "0.3.0"  # 0.3: a plan carries the digest of its content, checked when read
