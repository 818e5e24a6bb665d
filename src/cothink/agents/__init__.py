"""Agent patterns on the public Engine API (see docs/agents.md).

- :class:`ThinkNarrate`: a background thinker and a probe-gated narrator; user input goes into the context
  the thinker reads (``cothink demo`` is a thin use of it);
- :class:`StreamAgent`: event probe, background thinker, output probe, describer and a model-free
  coordinator over an async stream of events;
- :class:`StrategistActor`: a slow strategist writing plans, a fast actor with early exit;
- :class:`Monitor`: a bounded-memory watcher that raises findings.

Every pattern emits typed :class:`AgentEvent` records (kind, coroutine, time, text, value, forward passes).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AgentEvent": "cothink.agents.base",
    "ObservationWindow": "cothink.agents.base",
    "BackgroundThinker": "cothink.agents.base",
    "ChatFormat": "cothink.agents.chat",
    "ThinkNarrate": "cothink.agents.think_narrate",
    "Reaction": "cothink.agents.think_narrate",
    "NarratorSync": "cothink.agents.think_narrate",
    "ThinkNarrateResult": "cothink.agents.think_narrate",
    "StreamAgent": "cothink.agents.stream",
    "Frames": "cothink.agents.stream",
    "StreamResult": "cothink.agents.stream",
    "Utterance": "cothink.agents.stream",
    "StrategistActor": "cothink.agents.strategist",
    "StrategistActorResult": "cothink.agents.strategist",
    "ActionRecord": "cothink.agents.strategist",
    "Environment": "cothink.agents.strategist",
    "Monitor": "cothink.agents.monitor",
    "MonitorResult": "cothink.agents.monitor",
    "Finding": "cothink.agents.monitor",
    "RollingContext": "cothink.agents.rolling",
    "RollingStats": "cothink.agents.rolling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cothink.agents' has no attribute {name!r}")
