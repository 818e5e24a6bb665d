"""Typed errors raised by cothink.

Every error derives from :class:`CothinkError` and also from the closest builtin exception, so callers
may catch either ``CothinkError`` subclasses or the usual builtins (``ValueError``, ``KeyError``, ...).
"""

from __future__ import annotations

__all__ = [
    "CothinkError",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "InvalidViewError",
    "BlockFreedError",
    "UnknownBlockError",
    "EmptyInputError",
    "InputTooLongError",
    "BlockBusyError",
    "PoolExhaustedError",
    "EngineClosedError",
    "InvalidParameterError",
    "InvalidTokenIdError",
    "BlockSealedError",
    "SnapshotError",
    "SnapshotMismatchError",
    "RecordingError",
    "RecordingMismatchError",
    "DeadlineExceededError",
    "NativeKernelError",
    "ModelIntegrityError",
]


class CothinkError(Exception):
    """Base class of every error raised by cothink.

    `param`, when set, names the caller's parameter that was wrong (for example "token_ids",
    "view", "max_tokens"); the server reports it as the error's `param` field.
    """

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        self.param = param


class ModelNotFoundError(CothinkError, FileNotFoundError):
    """Raised when a model name is unknown or a model folder is missing or lacks config.json."""


class UnsupportedModelError(CothinkError, ValueError):
    """Raised when a model's architecture or configuration is not supported by the runtime."""


class InvalidViewError(CothinkError, ValueError):
    """Raised when a view or fork of a block names positions outside the block or is malformed."""


class BlockFreedError(CothinkError, ValueError):
    """Raised when a block is used after it has been freed."""


class UnknownBlockError(CothinkError, KeyError):
    """Raised when a block id does not belong to this runner or pool."""


class InvalidParameterError(CothinkError, ValueError):
    """Raised when a call's parameter is out of range or of the wrong kind (`param` names it)."""


class InvalidTokenIdError(InvalidParameterError):
    """Raised when a token id is not an int in [0, vocab_size) (`param` names the parameter)."""


class EmptyInputError(CothinkError, ValueError):
    """Raised when an operation that needs tokens is given none."""


class InputTooLongError(CothinkError, ValueError):
    """Raised when the input would exceed the model's or the block's maximum length."""


class BlockBusyError(CothinkError, RuntimeError):
    """Raised when a block is written while another coroutine is writing the same block."""


class PoolExhaustedError(CothinkError, MemoryError):
    """Raised when the memory pool has no free pages left for a request."""


class EngineClosedError(CothinkError, RuntimeError):
    """Raised when work is submitted to an engine or runner that has been closed."""


class BlockSealedError(CothinkError, ValueError):
    """Raised when a sealed block is extended, generated into, truncated or forked."""


class SnapshotError(CothinkError, ValueError):
    """Raised when a snapshot file is missing, unreadable or not a cothink snapshot."""


class SnapshotMismatchError(SnapshotError):
    """Raised when a snapshot was saved from a different model or dtype than the engine's."""


class RecordingError(CothinkError, ValueError):
    """Raised when a recording (cothink.Recorder) cannot be written or read, is not a cothink recording,
    or holds a call a replay cannot repeat."""


class RecordingMismatchError(RecordingError):
    """Raised when a recording is replayed on an engine of a different model or dtype."""


class DeadlineExceededError(CothinkError, TimeoutError):
    """Raised when a work's deadline passed before it was served (it is dropped unrun)."""


class NativeKernelError(CothinkError, RuntimeError):
    """Raised when cothink's C kernels are required (COTHINK_REQUIRE_NATIVE=1) but cannot be built or
    loaded (no C compiler, a failed build, a library of another ABI)."""


class ModelIntegrityError(CothinkError, ValueError):
    """Raised when the GGUF joined from an embedded model's packages is not the published file (its size
    or SHA-256 differs); nothing is converted or loaded from it."""
