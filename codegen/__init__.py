"""codegen: turn a Plan and its Schedule into an executable pipeline program and a Pipe.

(The emitter and the Pipe arrive with issue #4.)
"""

__all__: list[str] = []
