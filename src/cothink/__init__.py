"""cothink: one language model thinking, listening and acting at the same time.

Names are imported lazily so that `cothink --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Idle OpenMP threads spin only through the short gaps inside a step, then sleep instead of
# burning cores other processes need (set before torch loads libgomp, which reads it once; the
# value is cothink.execution.threads.SPIN_COUNT). A user's policy wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "30000"

_EXPORTS = {
    "Block": "cothink.memory.block",
    "Engine": "cothink.runtime.engine",
    "Generation": "cothink.runtime.engine",
    "StepRecord": "cothink.runtime.engine",
    "GenerationResult": "cothink.runtime.engine",
    "Piece": "cothink.runtime.engine",
    "ModelRunner": "cothink.execution.runner",
    "load_model": "cothink.execution.runner",
    "Priority": "cothink.scheduler.policy",
    "Recorder": "cothink.runtime.recorder",
    "PriorityClass": "cothink.scheduler.policy",
    "SyncEngine": "cothink.runtime.sync",
}

__all__ = [
    "Block",
    "Engine",
    "Generation",
    "GenerationResult",
    "ModelRunner",
    "Piece",
    "Priority",
    "PriorityClass",
    "Recorder",
    "StepRecord",
    "SyncEngine",
    "load_model",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from cothink.execution.runner import ModelRunner, load_model
    from cothink.memory.block import Block
    from cothink.runtime.engine import Engine, Generation, StepRecord
    from cothink.runtime.recorder import Recorder
    from cothink.runtime.sync import SyncEngine
    from cothink.runtime.engine import GenerationResult, Piece
    from cothink.scheduler.policy import Priority, PriorityClass


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cothink' has no attribute {name!r}")
