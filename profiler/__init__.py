"""profiler: measure each layer of a sequential model (time, memory, shapes) into a Profile.

The data types import no torch; `profile_model` and the model loaders do, and are loaded only
when asked for, so `from profiler import Profile` stays light (the CI memory gate relies on it).
"""

from typing import Any

from .artifact import Artifact, InputError
from .types import LayerProfile, Profile, Timing

__all__ = [
    "Artifact",
    "InputError",
    "LayerProfile",
    "Profile",
    "Timing",
    "load_model",
    "profile_model",
    "sample_input",
]


def __getattr__(name: str) -> Any:
    if name == "profile_model":
        from .measure import profile_model

        return profile_model
    if name in ("load_model", "sample_input", "model_digest"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
