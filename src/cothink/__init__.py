"""cothink: one language model thinking, listening and acting at the same time."""

from cothink.execution.runner import ModelRunner, load_model
from cothink.memory.block import Block
from cothink.runtime.engine import Engine, Generation, StepRecord
from cothink.runtime.sync import SyncEngine
from cothink.runtime.work import GenerationResult, Piece
from cothink.scheduler.policy import Priority, PriorityClass

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
