"""Keep the cyclic garbage collector's full collections off the step loop.

A process that imported torch and transformers holds about 400 000 collector-tracked objects
(functions, modules, type annotations), almost all alive until it exits. CPython's full
(generation-2) collection walks every one of them: measured 180-210 ms on a 2-core AMD EPYC VM,
and it runs in whichever thread allocates at that moment, so it lands inside a step or between two
tokens (an interactive stream's slowest gap was 232 ms against a 16 ms median, all of it one full
collection; bench/interactive_steps.py counts such pauses). `gc.freeze()` moves every object alive
at that moment into a permanent generation that collections skip; it is O(1) and changes no object.

Frozen objects are never collected, so anything frozen that becomes cyclic garbage stays until
`gc.unfreeze()`. The heap is therefore frozen once, when the first engine starts, and unfrozen when
the last running one stops, at which point the next full collection reclaims whatever became garbage
meanwhile. Engines started while another runs freeze nothing more: a process that keeps one engine
running and starts short-lived ones beside it would otherwise freeze each one's garbage in turn and
grow without bound. No collection is forced (a forced one at every engine start would cost ~0.2 s
each). A host process that froze its own heap should know that the last engine's stop unfreezes it.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_running = 0  # engines started and not yet stopped, in this process


def engine_started() -> None:
    """Freeze the heap as it is now, if no other engine runs."""
    global _running
    with _lock:
        _running += 1
        if _running == 1:
            gc.freeze()


def engine_stopped() -> None:
    """Give the heap back to the collector when the last running engine stops."""
    global _running
    with _lock:
        _running = max(0, _running - 1)
        if _running == 0:
            gc.unfreeze()
