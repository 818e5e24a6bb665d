"""SyncEngine: the blocking facade works from plain synchronous code and close() never hangs."""

from __future__ import annotations

import threading
import time

import pytest

from cothink import GenerationResult, Piece, SyncEngine
from cothink.errors import EngineClosedError
from support import make_engine, tiny_folder


def _in_thread(fn, timeout: float) -> tuple[bool, object]:
    """Run fn in a daemon thread; (finished in time, result or exception)."""
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), (box[0] if box else None)


def test_sync_engine_generate_stream_probe_close():
    engine = SyncEngine.from_pretrained(tiny_folder("llama"), kv_tokens=4096)
    with engine:
        ctx = engine.block("ctx")
        engine.extend(ctx, text="The cat sat on the mat. Answer:")
        out = engine.block("out")
        result = engine.generate([ctx, out], max_tokens=8)
        assert isinstance(result, GenerationResult) and result.finish_reason == "length"
        assert out.tokens == result.token_ids and len(result.token_ids) == 8

        pieces = list(engine.stream([ctx, engine.block("streamed")], max_tokens=8))
        assert all(isinstance(p, Piece) for p in pieces)
        streamed = [t for p in pieces for t in p.token_ids]
        assert streamed == result.token_ids[: len(streamed)]  # greedy, same view shape
        assert "".join(p.text for p in pieces) == result.text

        probs = engine.probe([ctx, out], " Answer:", (" yes", " no"))
        assert set(probs) == {" yes", " no"} and abs(sum(probs.values()) - 1) < 1e-6

        child = engine.fork(out)
        engine.truncate(child, 3)
        assert child.tokens == out.tokens[:3]
        engine.release(child)

        # an abandoned stream stops its generation
        abandoned = engine.block("abandoned")
        stream = engine.stream([ctx, abandoned], max_tokens=500)
        next(stream)
        next(stream)
        stream.close()
        deadline = time.perf_counter() + 10
        while time.perf_counter() < deadline:  # the cancel crosses threads: wait until the block stops
            n = len(abandoned)
            time.sleep(0.3)
            if len(abandoned) == n:
                break
        assert len(abandoned) == n < 500
        # errors cross the thread boundary with their type
        with pytest.raises(ValueError):
            engine.generate([ctx, out], max_tokens=0)
    done, _ = _in_thread(engine.close, 10)  # closing twice is harmless
    assert done


def test_close_does_not_hang_with_running_generations():
    engine = SyncEngine(make_engine("llama"))
    ctx = engine.block("ctx")
    engine.extend(ctx, token_ids=[1, 2, 3])
    started = threading.Event()
    outcome: list = []

    def consume():
        try:
            for _ in engine.stream([ctx, engine.block("long")], max_tokens=100_000):
                started.set()
                time.sleep(0.3)  # a slow reader: pieces pile up, so close() lands while it is still reading
            outcome.append("ended")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert started.wait(30)
    done, err = _in_thread(engine.close, 60)
    assert done, "close() hung"
    assert err is None, err
    consumer.join(5)
    assert not consumer.is_alive(), "the streaming thread stayed blocked after close()"


def test_calls_after_close_raise_instead_of_hanging():
    engine = SyncEngine(make_engine("llama"))
    ctx = engine.block("ctx")
    engine.extend(ctx, token_ids=[1, 2, 3])
    engine.close()
    done, result = _in_thread(lambda: engine.generate([ctx], max_tokens=2), 5)
    assert done, "a call after close() blocked forever"
    assert isinstance(result, (EngineClosedError, RuntimeError)), result
