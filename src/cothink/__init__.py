"""cothink: one language model thinking, listening and acting at the same time.

Names are imported lazily so that `cothink --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Idle OpenMP threads sleep instead of spinning on cores other processes need (set before torch
# loads libgomp, which reads it once; see cothink.execution.threads). A user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
    "StepRecord",
    "SyncEngine",
    "load_model",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from cothink.execution.runner import ModelRunner, load_model
    from cothink.memory.block import Block
    from cothink.runtime.engine import Engine, Generation, StepRecord
    from cothink.runtime.sync import SyncEngine
    from cothink.runtime.engine import GenerationResult, Piece
    from cothink.scheduler.policy import Priority, PriorityClass


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cothink' has no attribute {name!r}")
