"""Which code runs a step is decided once per step, by the runner's backend (`prepare`), and recorded:
in the prepared step, the engine's step timeline and the Chrome trace /v1/timeline serves. A runner
built with the torch backend runs plain torch modules; the native backend swaps its modules in."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support import ids, load_runner, make_engine

from cothink.execution.attention_backends import NativeBackend, TorchBackend
from cothink.execution.fused_decode import FusedDecode, FusedStep
from cothink.execution.native_modules import (
    NativeCpuLinear,
    NativeRMSNorm,
    has_native_modules,
    use_native_modules,
    use_torch_modules,
)
from cothink.execution.step import StepItem, ViewBatch
from cothink.models.packing import CpuLinear, fused_parts
from cothink.models.transformer import RMSNorm
from cothink.observability import chrome_trace
from cothink.ops import native

NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")


def _paths(runner, monkeypatch) -> tuple[list[str], list[int]]:
    """Each step's path, and how many times the backend's prepare ran per step, over a prefill, two
    decode steps of two coroutines and a mixed step."""
    prepares: list[int] = []
    real = type(runner.backend).prepare

    def counting(backend, batch):
        prepares.append(1)
        return real(backend, batch)

    monkeypatch.setattr(type(runner.backend), "prepare", counting)
    a, b = runner.new_block("a"), runner.new_block("b")
    steps = [
        [StepItem(a, ids(6, seed=1)), StepItem(b, ids(4, seed=2))],
        [StepItem(a, [5], logits="last"), StepItem(b, [6], logits="last")],
        [StepItem(a, [7], logits="last"), StepItem(b, [8], logits="last")],
        [StepItem(a, [9]), StepItem(b, ids(3, seed=3))],
    ]
    paths, counts = [], []
    for items in steps:
        before = len(prepares)
        batch = runner.prepare(items)
        result = runner.forward(batch)
        runner.commit(result)
        paths.append(result.path)
        counts.append(len(prepares) - before)
    return paths, counts


@NEEDS_NATIVE
def test_the_native_backend_decides_each_steps_path_once(monkeypatch):
    runner = load_runner("llama", kv_tokens=512, page_size=4, attention_backend="native")
    assert runner.fused_decode is not None  # float32 linears: the fused step applies
    paths, prepares = _paths(runner, monkeypatch)
    assert paths == ["native", "fused", "fused", "native"]
    assert prepares == [1, 1, 1, 1]


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_other_backends_record_their_own_path(backend, monkeypatch):
    runner = load_runner("qwen35", kv_tokens=512, page_size=4, attention_backend=backend)
    paths, prepares = _paths(runner, monkeypatch)
    assert paths == [backend] * 4 and prepares == [1] * 4


@NEEDS_NATIVE
def test_switching_the_fused_step_off_gives_the_native_module_path(monkeypatch):
    runner = load_runner("llama", kv_tokens=512, page_size=4, attention_backend="native")
    runner.fused_decode = None
    assert runner.backend.fused is None
    paths, _ = _paths(runner, monkeypatch)
    assert paths == ["native"] * 4


def test_a_torch_runner_runs_plain_torch_modules():
    runner = load_runner("qwen35", attention_backend="torch")
    model = runner.model
    assert not has_native_modules(model)
    assert all(type(m).__module__.startswith(("cothink.models.", "torch.nn.")) for m in model.modules())
    assert runner.fused_decode is None


@NEEDS_NATIVE
@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_the_native_backend_swaps_its_modules_in_sharing_the_parameters(name):
    torch_runner = load_runner(name, attention_backend="torch")
    model = torch_runner.model
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    identity = torch_runner.identity()
    use_native_modules(model)
    assert has_native_modules(model)
    assert isinstance(model.model.norm, NativeRMSNorm) and isinstance(model.lm_head, NativeCpuLinear)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # the same tensors
    # the fused projections' parts (q_proj, gate_proj, ...: views, never called) stay plain, no copy
    parts = fused_parts(model)
    assert parts and all(type(part) is CpuLinear for part in parts)
    use_torch_modules(model)  # and back
    assert not has_native_modules(model)
    assert type(model.model.norm) is RMSNorm and type(model.lm_head) is CpuLinear
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    native_runner = load_runner(name, attention_backend="native")
    assert has_native_modules(native_runner.model)
    assert native_runner.identity() == identity  # snapshots move between backends


@NEEDS_NATIVE
def test_the_eager_modules_stay_plain_under_the_native_backend():
    runner = load_runner("llama", fast=False, attention_backend="native")
    assert not has_native_modules(runner.model) and runner.fused_decode is None


@NEEDS_NATIVE
def test_the_fused_step_gets_a_typed_input_built_by_prepare(monkeypatch):
    runner = load_runner("qwen35", kv_tokens=512, page_size=4)
    assert isinstance(runner.backend, NativeBackend) and runner.fused_decode is not None
    block = runner.new_block()
    runner.extend(block, ids(5, seed=4))
    seen: list[object] = []
    real = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__",
                        lambda self, x, step, *rest: seen.append(step) or real(self, x, step, *rest))
    batch = runner.prepare([StepItem(block, [3], logits="last")])
    assert batch.path == "fused" and batch.metadata.layers is not None
    runner.commit(runner.forward(batch))
    (step,) = seen
    assert isinstance(step, FusedStep) and not isinstance(step, ViewBatch)
    assert step.items == 1 and torch.equal(step.store_slots, batch.plans[0].new_slots)


def test_the_engine_timeline_records_each_steps_path():
    engine = make_engine("llama")
    expected = "fused" if isinstance(engine.runner.backend, NativeBackend) else "torch"

    async def main():
        async with engine:
            block = engine.block("b")
            await engine.extend(block, token_ids=ids(6, seed=5), name="reader")
            await engine.generate(block, max_tokens=3, stop_at_eos=False, name="writer").collect()

    asyncio.run(main())
    records = list(engine.timeline)
    paths = {r.path for r in records}
    assert expected in paths and "" not in paths
    events = [e for e in chrome_trace(records)["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["path"] for e in events} == paths


def test_a_torch_engine_records_the_torch_path():
    from cothink.runtime.engine import Engine

    runner = load_runner("llama", attention_backend="torch")
    assert isinstance(runner.backend, TorchBackend) and not isinstance(runner.backend, NativeBackend)
    engine = Engine(runner)

    async def main():
        async with engine:
            block = engine.block("b")
            await engine.extend(block, token_ids=ids(4, seed=6))
            await engine.generate(block, max_tokens=2, stop_at_eos=False).collect()

    asyncio.run(main())
    assert {r.path for r in engine.timeline} == {"torch"}
