"""codegen: turn a Plan and its Schedule into an executable pipeline program and a Pipe."""

from typing import Any

__all__ = [
    "Pipe",
    "StageError",
    "auto_pipe",
    "check_streams",
    "compile_pipe",
    "emit_program",
    "issue_order",
    "torch_pipelining",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `import codegen` stays cheap and torch loads only when a pipe is built.
    if name in (
        "Pipe",
        "StageError",
        "compile_pipe",
        "auto_pipe",
        "check_streams",
        "torch_pipelining",
    ):
        from . import pipe

        return getattr(pipe, name)
    if name in ("emit_program", "issue_order"):
        from . import emit

        return getattr(emit, name)
    raise AttributeError(f"module 'codegen' has no attribute {name!r}")
