"""The event loop stays free during long steps: forward passes run in the engine's worker thread, so
/health is answered while a step of SmolLM2's prefill is running (docs/runtime.md, "Threads").

The property is checked against the engine's step timeline, not against a latency: some /health call
is sent and answered inside one step's [start, end], which a loop blocked by the forward pass cannot
do, however loaded the machine is.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import cothink
from support import running_server


@pytest.mark.torch_threads(1)
def test_health_is_answered_while_a_prefill_step_runs():
    # lone prompts at max_prefill_chunk (128), not lone_prefill_chunk: ~400 tokens are several steps
    engine = cothink.Engine.from_pretrained("smollm2", kv_tokens=4096, lone_prefill_chunk=1)
    prompt = "The quick brown fox jumps over the lazy dog. " * 40  # about 400 tokens
    with running_server(engine) as server:
        done = threading.Event()
        outcome: dict = {}

        def complete() -> None:
            try:
                r = httpx.post(server.url + "/v1/completions", timeout=300,
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
                outcome["status"], outcome["usage"] = r.status_code, r.json().get("usage")
            finally:
                done.set()

        worker = threading.Thread(target=complete)
        worker.start()
        answers: list[tuple[float, float]] = []
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not done.is_set():
                sent = time.perf_counter()
                assert client.get("/health").status_code == 200
                answers.append((sent, time.perf_counter()))
                time.sleep(0.01)
        worker.join()
        steps = server.call(lambda: list(engine.timeline))
    assert outcome["status"] == 200 and outcome["usage"]["prompt_tokens"] >= 300, outcome
    prefill = [s for s in steps if s.tokens > 1]
    assert len(prefill) >= 2, "the prompt is prefilled in several steps"
    inside = [(sent, answered) for sent, answered in answers
              if any(s.start < sent and answered < s.end for s in prefill)]
    assert inside, ("no /health call was answered during a prefill step", answers, prefill)
