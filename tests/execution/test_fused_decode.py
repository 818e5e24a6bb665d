"""The fused decode step (execution/fused_decode.py): all decoder layers of a small decode step in
one C call must give the per-module path's results to the bit, and run only where that path would
run wholly in the C kernels."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch
from support import count_fused_decode_rows, count_native_rows, ids

from cothink.execution.step import StepItem
from cothink.models import packing
from cothink.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Rows of every fused decode call (the real kernel runs)."""
    return count_fused_decode_rows(monkeypatch)


@pytest.fixture
def python_linears(monkeypatch) -> list[int]:
    """Rows of every C linear called from Python, outside a fused call (the real kernel runs)."""
    return count_native_rows(monkeypatch, "linear")


@pytest.fixture
def c_linears(monkeypatch) -> None:
    """bfloat16 linears in cothink's C kernel on every CPU: where oneDNN has bfloat16 kernels they are
    prepacked for it instead (models/packing.py `can_pack`), and the fused step, which chains the C
    kernels, is off; this test is about the fused step itself."""
    monkeypatch.setattr(packing, "can_pack", lambda dtype, device: False)


def _conversation(runner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a shared context, three coroutines prefilling and then decoding over it (one of
    them also over a second shared block), and one coroutine alone; and the keys written."""
    ctx, notes = runner.new_block("ctx"), runner.new_block("notes")
    out = [runner.extend(ctx, ids(20, seed=1)), runner.extend(notes, ids(5, seed=2))]
    writers = [runner.new_block(f"w{i}") for i in range(3)]
    views = [[ctx, writers[0]], [ctx, writers[1]], [ctx, notes, writers[2]]]
    pairs = list(enumerate(zip(writers, views)))
    out += runner.step([StepItem(w, ids(2, seed=3 + i), v) for i, (w, v) in pairs])
    for s in range(5):
        out += runner.step([StepItem(w, [7 * s + i], v, "last") for i, (w, v) in pairs])
    out.append(runner.extend(writers[0], [9], [ctx, writers[0]]))  # one coroutine alone
    # a new view over a decoded block: its Gated DeltaNet state is composed from the records
    out.append(runner.extend(notes, [4], [writers[1], notes]))
    blocks = (ctx, notes, *writers)
    # the written slots only (the rest of a page is uninitialised memory)
    slots = torch.cat([runner.store.slots_and_span(b, 0, b.length)[0] for b in blocks])
    records = [data[: b.length] for b in blocks for rec in b.linear for data in (rec.rows.data, rec.g.data,
                                                                                rec.beta.data)]
    return out, [runner.store.pool.k[:, slots], runner.store.pool.v[:, slots], *records]


def _same_conversation(fused, modules, fused_calls: list[int]) -> None:
    """`_conversation` on the fused runner, its decode steps fused, gives the per-module runner's bits."""
    modules.fused_decode = None
    got, got_kv = _conversation(fused)
    want, want_kv = _conversation(modules)
    assert fused_calls == [3] * 5 + [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


@pytest.mark.parametrize("fused", [True, False])
def test_steps_leave_no_reference_cycles(tiny_model, fused_calls, fused):
    """A step's plans (its ViewBatch, the backend's metadata, the fused step's closures) hold their
    batch weakly: refcounting frees them when the step ends, so steps leave Python's cycle collector
    nothing to find (its collections paused 32-coroutine steps ~2-3 ms each). Both paths: the fused
    decode step and the per-module one, over a Gated DeltaNet model (the fused step's linear_decode)."""
    runner = tiny_model("qwen35").runner()
    if not fused:
        runner.fused_decode = None
    gc.collect()
    gc.disable()
    try:
        _conversation(runner)
        found = gc.collect()
    finally:
        gc.enable()
    assert (len(fused_calls) == 7) == fused
    assert found == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("name", "dtype", "quantize"),
    [
        ("llama", torch.float32, None),
        ("llama", torch.bfloat16, None),
        ("llama3", torch.float32, None),
        ("llama3", torch.bfloat16, None),
        ("llama", torch.bfloat16, "int8"),
        ("llama3", torch.float32, "int8"),  # int8 weights under float32 activations, with biases
        ("qwen3", torch.float32, None),  # q/k norms
        ("qwen3", torch.bfloat16, None),
        ("qwen35", torch.float32, None),  # Gated DeltaNet layers, output gates, partial rotary
        ("qwen35", torch.bfloat16, None),
        ("qwen3", torch.bfloat16, "int8"),
        ("qwen35_mm", torch.float32, None),  # the multimodal checkpoint's text model
        ("llama", torch.float32, "int4"),  # 4-bit groups (scale and offset per 32 weights)
        ("llama3", torch.bfloat16, "int4"),
        ("qwen3", torch.float32, "int4"),
    ],
)
def test_fused_decode_is_the_per_module_path_to_the_bit(
    tiny_model, fused_calls, c_linears, name, dtype, quantize, threads
):
    """llama3 adds biases on every projection and tied embeddings; int8 weights (with row scales; in
    pairs where `native.bf16_pairs`) and 4-bit weights (group scales and offsets; in pairs for bfloat16
    activations there) take the same C kernel as in the module path. On 2
    threads the C kernels split their products and attention over them (and torch's prefill matmuls
    run on both)."""
    fused = tiny_model(name).runner(dtype=dtype, quantize=quantize)
    modules = tiny_model(name).runner(dtype=dtype, quantize=quantize)
    assert fused.fused_decode is not None
    kind = native.WEIGHT_TYPES
    int8 = kind[torch.int16 if native.bf16_pairs() else torch.int8]  # int8 in pairs where they run
    # 4-bit pairs (their scales halves: the quantizer's are) for bfloat16 activations where they run
    int4 = native.WT_Q4_HALF if native.bf16_pairs() and dtype == torch.bfloat16 else kind[torch.uint8]
    # float32 in tiles where they run (the last tile of each padded)
    tiles = dtype == torch.float32 and native.takes_f32_tiles(torch.empty(1, 16))
    dense = native.WT_F32_TILES if tiles else kind[dtype]
    storage = {None: dense, "int8": int8, "int4": int4}[quantize]
    assert fused.fused_decode.weights == storage
    modules.fused_decode = None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_kv = _conversation(fused)
        assert fused_calls == [3] * 5 + [1, 1]  # the decode steps; prefills take the module path
        want, want_kv = _conversation(modules)
    finally:
        torch.set_num_threads(before)
    assert len(fused_calls) == 7
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


@pytest.mark.skipif(not native.bf16_pairs(), reason="4-bit pairs: AVX-512 BF16, no AMX tiles")
def test_4bit_scales_that_are_not_halves_keep_float32_pairs(tiny_model, fused_calls, c_linears, monkeypatch):
    """One 4-bit layer whose scales are not halves (as Q4_K's are not) keeps every layer's pairs on
    float32 scales (one storage kind for the fused step), and the step is still the per-module path's
    to the bit."""
    from cothink.models.quant4 import Int4Weights

    quantize = Int4Weights.quantize.__func__
    calls = []

    def some_not_halves(cls, weight):
        w = quantize(cls, weight)
        calls.append(w)
        if len(calls) > 1:
            return w
        return Int4Weights(w.packed, w.scale * (1 + 2.0**-20))  # a scale between two halves

    monkeypatch.setattr(Int4Weights, "quantize", classmethod(some_not_halves))
    fused = tiny_model("llama3").runner(dtype=torch.bfloat16, quantize="int4")
    calls.clear()
    modules = tiny_model("llama3").runner(dtype=torch.bfloat16, quantize="int4")
    assert fused.fused_decode.weights == native.WEIGHT_TYPES[torch.uint16]  # float32 scales
    _same_conversation(fused, modules, fused_calls)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_grouped_shared_runs_keep_the_fused_step_the_per_module_path(tiny_model, fused_calls, monkeypatch,
                                                                    name):
    """With every shared run grouped (native.SHARED_MIN_KEYS 1: the conversation's 20-token context is
    attended once for its three readers in bfloat16), the fused step and the per-module path still give
    the same bits, and the grouping was used."""
    monkeypatch.setattr(native, "SHARED_MIN_KEYS", 1)
    groups: list[int] = []
    init = native.DecodePlan.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        groups.append(self.groups)

    monkeypatch.setattr(native.DecodePlan, "__init__", spy)
    fused = tiny_model(name).runner(dtype=torch.bfloat16)
    modules = tiny_model(name).runner(dtype=torch.bfloat16)
    modules.fused_decode = None
    got, got_kv = _conversation(fused)
    want, want_kv = _conversation(modules)
    assert fused_calls == [3] * 5 + [1, 1]
    assert max(groups) == 1  # ctx (three readers; the notes block has one)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


def test_fused_decode_runs_only_steps_the_c_kernels_would_run_whole(tiny_model, fused_calls):
    """More rows than the C linear takes, or a prefill item in the step: the module path."""
    from cothink.execution.native_modules import NATIVE_MAX_ROWS

    runner = tiny_model("llama").runner()
    blocks = [runner.new_block() for _ in range(NATIVE_MAX_ROWS + 1)]
    runner.step([StepItem(b, ids(3, seed=i)) for i, b in enumerate(blocks)])
    runner.step([StepItem(b, [5], logits="last") for b in blocks])  # one decode row too many
    runner.step([StepItem(blocks[0], [5]), StepItem(blocks[1], [6, 7])])  # decode + prefill
    assert fused_calls == []
    runner.step([StepItem(b, [5], logits="last") for b in blocks[:NATIVE_MAX_ROWS]])
    assert fused_calls == [NATIVE_MAX_ROWS]


@pytest.mark.parametrize(("name", "dtype"), [("llama3", torch.float32), ("qwen35", torch.bfloat16)])
def test_the_fused_call_makes_the_logits_where_every_row_wants_them(
    tiny_model, fused_calls, c_linears, python_linears, name, dtype
):
    """A decode step whose rows all want logits gets them from the fused call: the final norm and the
    lm_head run inside it (no C linear called from Python). A step with a row that wants none runs its
    layers in the call and the norm and lm_head as modules, on the rows that want them. Both give the
    per-module path's bits (llama3: tied embeddings; qwen35: zero-centred norms)."""
    fused, modules = (tiny_model(name).runner(dtype=dtype) for _ in range(2))
    modules.fused_decode = None
    assert fused.fused_decode.head is not None
    results = []
    for runner in (fused, modules):
        blocks = [runner.new_block() for _ in range(2)]
        runner.step([StepItem(b, ids(3, seed=i)) for i, b in enumerate(blocks)])
        python_linears.clear()
        every = runner.step([StepItem(b, [5 + i], logits="last") for i, b in enumerate(blocks)])
        assert (python_linears == []) == (runner is fused)
        python_linears.clear()
        some = runner.step([StepItem(blocks[0], [7], logits="last"), StepItem(blocks[1], [8], logits="none")])
        if runner is fused:
            assert python_linears == [1]  # the lm_head, from Python, on the one row that wants logits
        results.append([*every, *some])
    assert fused_calls == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_step_wider_than_the_lm_head_takes_in_c_runs_the_head_as_modules(
    tiny_model, fused_calls, python_linears
):
    """More rows than the lm_head takes in the C kernel (`Head.max_rows`): the layers still run in the
    fused call, the final norm and the lm_head as modules; the same logits either way."""
    runner = tiny_model("llama").runner()
    fused = runner.fused_decode
    blocks = [runner.new_block() for _ in range(2)]
    runner.step([StepItem(b, ids(3, seed=i)) for i, b in enumerate(blocks)])
    out = []
    for max_rows in (fused.head.max_rows, 1):
        fused.head = dataclasses.replace(fused.head, max_rows=max_rows)
        python_linears.clear()
        out.append(runner.step([StepItem(b, [5 + i], logits="last") for i, b in enumerate(blocks)]))
        for b in blocks:
            runner.truncate(b, 3)
        assert python_linears == ([] if max_rows > 1 else [2])
    assert fused_calls == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize(
    ("name", "limits"),
    [
        ("qwen35_linear", {}),  # Gated DeltaNet only: no attention layer, no native decode items
        ("llama", {"attention_backend": "torch"}),
        ("llama", {"fast": False}),  # the eager modules
    ],
)
def test_models_and_backends_outside_the_fused_step_keep_the_module_path(tiny_model, name, limits):
    assert tiny_model(name).runner(**limits).fused_decode is None


def test_switching_the_kernels_off_takes_the_module_path(tiny_model, fused_calls, monkeypatch):
    runner = tiny_model("llama").runner()
    block = runner.new_block()
    runner.extend(block, ids(4, seed=0))
    monkeypatch.setattr(native, "ENABLED", False)
    off = runner.extend(block, [3])
    assert fused_calls == []
    monkeypatch.setattr(native, "ENABLED", True)
    runner.truncate(block, 4)
    assert (runner.extend(block, [3]) - off).abs().max() < 1e-4  # fp32: torch's kernels, other sum order
    assert fused_calls == [1]


@pytest.mark.skipif(not native.bf16_dot(), reason="bfloat16 dot products in C: only on CPUs with them")
def test_packed_bfloat16_linears_take_the_c_kernel_where_it_has_bfloat16_dot_products(
        tiny_model, fused_calls, monkeypatch):
    """Where oneDNN has bfloat16 kernels the linears are prepacked for it; where the C kernel has the
    CPU's bfloat16 dot products as well (AVX-512 BF16, AMX), products run in C on the weight: where
    `bf16_pairs`, in pairs in place of oneDNN's packing (the same values), every product; else a copy of
    the plain weight beside the packed one, up to PACKED_NATIVE_MAX_ROWS rows, wider ones in oneDNN.
    A decode step of up to NATIVE_MAX_ROWS rows (pairs) or that limit takes the fused step, to the bit
    of the per-module path; a wider one does not. `use_torch_modules` puts oneDNN's packed linears
    back. With COTHINK_BF16_DECODE=0 the linears stay oneDNN's."""
    from cothink.execution.native_modules import (
        NATIVE_MAX_ROWS,
        PACKED_NATIVE_MAX_ROWS,
        NativePackedLinear,
        use_torch_modules,
    )

    monkeypatch.setattr(native, "BF16_DECODE", False)
    plain = tiny_model("llama3").runner(dtype=torch.bfloat16)
    assert plain.fused_decode is None
    linears = [m for m in plain.model.modules() if isinstance(m, packing.FastLinear)]
    assert linears and all(type(m) is packing.PackedLinear for m in linears)
    monkeypatch.setattr(native, "BF16_DECODE", True)
    fused = tiny_model("llama3").runner(dtype=torch.bfloat16)
    modules = tiny_model("llama3").runner(dtype=torch.bfloat16)
    linears = [m for m in fused.model.modules() if isinstance(m, packing.FastLinear)]
    assert linears and all(isinstance(m, NativePackedLinear) for m in linears)
    lin = linears[0]
    pairs = native.bf16_pairs()
    limit = NATIVE_MAX_ROWS if pairs else PACKED_NATIVE_MAX_ROWS
    dense = lin.dense_weight()
    assert torch.equal(lin.operands()[0], native.pack_pairs(dense) if pairs else dense)
    assert (lin.packed is None) == pairs  # in pairs: one copy of the weight
    x = torch.randn(NATIVE_MAX_ROWS + 1, lin.in_features).to(torch.bfloat16)
    small = x[:limit]
    assert torch.equal(lin(small), native.linear(small, *lin.operands()[::2]))
    wider = x[: limit + 1]
    if pairs:  # every product in C
        assert torch.equal(lin(wider), native.linear(wider, *lin.operands()[::2]))
    else:
        assert torch.equal(lin(wider), packing.PackedLinear.forward(lin, wider))  # oneDNN's product
    assert fused.fused_decode is not None
    assert fused.fused_decode.weights == native.WEIGHT_TYPES[torch.int32 if pairs else torch.bfloat16]
    assert fused.fused_decode.max_rows == limit
    _same_conversation(fused, modules, fused_calls)
    fused_calls.clear()  # a decode step wider than the fused step takes: the per-module path
    blocks = [fused.new_block() for _ in range(limit + 1)]
    fused.step([StepItem(b, ids(2, seed=i)) for i, b in enumerate(blocks)])
    fused.step([StepItem(b, [5], logits="last") for b in blocks])
    fused.step([StepItem(b, [6], logits="last") for b in blocks[:limit]])
    assert fused_calls == [limit]
    use_torch_modules(modules.model)
    restored = [m for m in modules.model.modules() if isinstance(m, packing.FastLinear)]
    assert all(type(m) is packing.PackedLinear for m in restored)
    assert torch.equal(restored[0].dense_weight(), dense)


async def test_background_prefill_beside_an_interactive_generation_keeps_the_fused_step():
    """While an interactive generation decodes, background prefill comes in single tokens
    (SchedulerConfig.interactive_background_chunk), so the steps that carry the interactive token and
    a background prefill are all single-token items: the fused step runs them."""
    from support import make_engine

    engine = make_engine("llama")
    async with engine:
        ctx, big = engine.block("ctx"), engine.block("big")
        await engine.extend(ctx, token_ids=ids(8, seed=1))
        out = engine.block("out")
        gen = engine.generate([ctx, out], max_tokens=24, priority="interactive", stop_at_eos=False, name="fg")
        background = asyncio.create_task(engine.extend(big, token_ids=ids(64, seed=2), name="bg"))
        await gen.collect()
        await background
    assert engine.runner.fused_decode is not None
    shared = [r for r in engine.timeline if {i.coroutine for i in r.items} == {"fg", "bg"}]
    assert shared, "the background prefill ran beside the interactive generation"
    assert all(i.tokens == 1 for r in shared for i in r.items)
    assert all(r.path == "fused" for r in shared)
