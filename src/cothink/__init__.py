"""cothink: one language model thinking, listening and acting at the same time."""

from cothink.execution.runner import ModelRunner, load_model
from cothink.memory.block import Block

__all__ = ["Block", "ModelRunner", "load_model"]
__version__ = "0.1.0"
