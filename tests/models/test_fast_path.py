"""The fast path (fused projections, RoPE tables, per-step threads) against the eager path and
transformers, and the opt-in weight-only int8 (quality bound, refusal of unsupported families)."""

from __future__ import annotations

import pytest
import torch
from reference import max_err, random_ids
from support import fast_and_eager, prefill_then_decode

import cothink
from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.execution.threads import SPIN_COUNT, ThreadChooser
from cothink.models.quantize import Int8Linear
from cothink.ops.rope import Rotary

EXACT = 1e-4  # fp32 logits: fast path vs eager path vs transformers
FAMILIES = ["llama", "llama3", "qwen3", "qwen35"]


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("name", FAMILIES)
def test_fast_path_fp32_logits_match_eager_and_transformers(tiny_model, record_error, name, kernels,
                                                            monkeypatch):
    """With cothink's fused C kernels (norms, SiLU x up, key stores, decode attention) and with
    them switched off (COTHINK_NATIVE=0: the torch fast path). The eager path is plain torch."""
    tm, fast, eager = fast_and_eager(tiny_model, name, kernels, monkeypatch)
    ids = random_ids(40, seed=5)
    assert fast.backend.name == kernels
    assert fast.model.model.layers[0].mlp.gate_up_proj is not None
    assert eager.model.model.layers[0].mlp.gate_up_proj is None
    want = tm.logits(ids)
    logits = {"fast": prefill_then_decode(fast, ids, 32), "eager": prefill_then_decode(eager, ids, 32)}
    assert record_error(f"fast ({kernels}) vs eager", name, max_err(logits["fast"], logits["eager"])) < EXACT
    assert record_error(f"fast ({kernels}) vs transformers", name, max_err(logits["fast"], want)) < EXACT


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("name", ["qwen35_moe", "qwen3_next", "kimi"])
def test_moe_family_fast_path_matches_eager_and_transformers(tiny_model, record_error, name, kernels,
                                                             monkeypatch):
    """The MoE and Kimi Linear families' fast path: fused mixer projections (Kimi's KDA q/k/v too),
    the CPU linears; their sparse layers keep the model on the torch modules (no native modules)."""
    tm, fast, eager = fast_and_eager(tiny_model, name, kernels, monkeypatch)
    ids = random_ids(40, seed=5)
    assert fast.backend.name == kernels and not fast.model.fused and fast.fused_decode is None
    def fused(layer) -> bool:  # attention and KDA: qkv_proj; Gated DeltaNet: in_proj; MLA: none
        return any(getattr(layer.mixer, n, None) is not None for n in ("qkv_proj", "in_proj"))

    assert [fused(layer) for layer in fast.model.model.layers] == [
        not hasattr(layer.mixer, "kv_b_proj") for layer in fast.model.model.layers]
    assert not any(fused(layer) for layer in eager.model.model.layers)
    want = tm.logits(ids)
    logits = {"fast": prefill_then_decode(fast, ids, 32), "eager": prefill_then_decode(eager, ids, 32)}
    assert record_error(f"fast ({kernels}) vs eager", name, max_err(logits["fast"], logits["eager"])) < EXACT
    assert record_error(f"fast ({kernels}) vs transformers", name, max_err(logits["fast"], want)) < EXACT


def test_fused_parts_view_the_fused_weight(tiny_model):
    """The HF-named projections keep working after fusion and cost no memory of their own."""
    attn = tiny_model("llama").runner().model.model.layers[0].self_attn
    fused = attn.qkv_proj.weight
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), fused)


def test_rope_table_equals_the_formula():
    from transformers import LlamaConfig

    rotary = Rotary(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 16)
    pos = torch.tensor([0, 5, 1023, 3000, 7])  # 3000 grows the table
    cos, sin = rotary.cos_sin(pos)
    cos_ref, sin_ref = rotary._compute(pos)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    neg = torch.tensor([-3, 2])  # negative positions take the formula
    assert torch.equal(rotary.cos_sin(neg)[0], rotary._compute(neg)[0])


def _run_chooser(chooser: ThreadChooser, rows: int, per_row: dict[int, float], steps: int) -> list[int]:
    picked = []
    for _ in range(steps):
        n = chooser.choose(rows)
        chooser.observe(rows, n, per_row[n] * rows)
        picked.append(n)
    return picked


def test_thread_chooser_follows_measured_speed_and_notices_contention():
    chooser = ThreadChooser(2)
    quiet = {2: 1.0, 1: 1.6}  # two threads faster
    # a quiet machine pays one trial per width, after the warm-up steps
    assert _run_chooser(chooser, 32, quiet, 100) == [2, 2, 2, 1] + [2] * 96
    busy = {2: 8.0, 1: 1.6}  # another process takes a core: 2-thread regions wait on it
    picked = _run_chooser(chooser, 32, busy, 300)
    assert picked[:2] == [2, 2] and picked[2:5] == [1, 1, 1]  # two slow steps in a row switch
    retries = picked[5:].count(2)
    assert 1 <= retries <= 8  # re-tries back off while they confirm the choice
    picked = _run_chooser(chooser, 32, quiet, 300)  # contention gone: found again by a re-try
    assert picked[-50:] == [2] * 50
    assert _run_chooser(chooser, 1, quiet, 6) == [2, 2, 2, 1, 2, 2]  # other widths measure their own
    slower_with_context = {2: 1.0, 1: 1.6}
    for k in range(50):  # per-row time creeping up (a growing context) is not contention
        slower_with_context[2] = 1.0 + 0.02 * k
        assert _run_chooser(chooser, 1, slower_with_context, 1) == [2]
    assert ThreadChooser(1).choose(64) == 1


def test_thread_chooser_finds_contention_present_from_the_start():
    """Started beside a busy core there is no quiet figure to be slower than: the width's warm-up
    trial finds one thread faster, and re-tries of all threads keep confirming it."""
    chooser = ThreadChooser(2)
    busy = {2: 8.0, 1: 1.6}
    picked = _run_chooser(chooser, 128, busy, 200)
    assert picked[:4] == [2, 2, 2, 1]
    assert 1 <= picked[4:].count(2) <= 4  # backed-off re-tries only


def test_thread_chooser_trial_compares_with_warm_steps():
    """A width's first step carries one-off costs (allocations, kernel setup): the trial compares
    one thread with the last warm-up step, so a slow first step does not make one thread look
    faster on a quiet machine."""
    chooser = ThreadChooser(2)
    first = {2: 10.0, 1: 1.6}
    quiet = {2: 1.0, 1: 1.6}
    picked = _run_chooser(chooser, 16, first, 1) + _run_chooser(chooser, 16, quiet, 60)
    assert picked.count(1) == 1


def test_thread_chooser_ignores_lone_slow_steps():
    """A single slow step (a collector pause) is noise: no step pays for a one-thread trial beyond
    the width's first."""
    chooser = ThreadChooser(2)
    quiet, spike = {2: 1.0, 1: 1.6}, {2: 3.0, 1: 1.6}
    picked = []
    for _ in range(20):
        picked += _run_chooser(chooser, 4, quiet, 9) + _run_chooser(chooser, 4, spike, 1)
    assert picked == [2, 2, 2, 1] + [2] * 196


def test_thread_chooser_expects_a_width_s_time_on_the_count_it_chooses():
    """`expected_seconds` (what the scheduler's inline rule reads): None before a width was measured,
    then its figure on the count `choose` gives, also where there is nothing to choose."""
    chooser = ThreadChooser(2)
    assert chooser.expected_seconds(4) is None
    _run_chooser(chooser, 4, {2: 1.0, 1: 1.6}, 10)
    assert chooser.expected_seconds(4) == pytest.approx(4.0)
    assert chooser.expected_seconds(5) == pytest.approx(5.0)  # the same width bucket
    assert chooser.expected_seconds(8) is None  # another width
    _run_chooser(chooser, 4, {2: 8.0, 1: 1.6}, 3)  # contention: one thread chosen, its figure expected
    assert chooser.choose(4) == 1 and chooser.expected_seconds(4) == pytest.approx(6.4)
    single = ThreadChooser(1)
    _run_chooser(single, 1, {1: 0.5}, 2)
    assert single.expected_seconds(1) == pytest.approx(0.5)


def test_openmp_wait_policy_is_set_unless_the_user_did():
    import os

    # import cothink sets a short spin (then sleep) when the user set no policy
    assert os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT") == SPIN_COUNT


# ---- weight-only int8 ------------------------------------------------------------------------------


def test_int8_logits_close_and_greedy_mostly_agrees(tiny_model, record_error):
    tm = tiny_model("llama")
    q = tm.runner(quantize="int8")
    layers = q.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Int8Linear) and isinstance(q.model.lm_head, Int8Linear)
    assert layers[0].self_attn.q_proj is None  # no dense copy of a quantized weight stays alive
    ids = random_ids(24, seed=7)
    want = tm.logits(ids)
    block = q.new_block()
    got = torch.cat([q.extend(block, ids[:20]), *(q.extend(block, [t]) for t in ids[20:])])  # both kernels
    rel = max_err(got, want) / want.abs().max().item()
    record_error("int8 vs fp32 (relative)", "llama", rel)
    assert rel < 0.05  # per-row int8 weights with bf16 activations: a few percent, never garbage
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.75


def test_int8_kernel_and_dequantized_paths_agree():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48, bias=True)
    layer = Int8Linear(dense.weight, dense.bias)
    x = torch.randn(40, 64)
    wide, narrow = layer(x), torch.cat([layer(x[i : i + 1]) for i in range(40)])
    assert max_err(wide, narrow) < 0.05
    assert max_err(wide, dense(x)) < 0.05 * dense(x).abs().max().item()


def test_int8_refuses_unsupported_families_and_modes(tiny_model):
    with pytest.raises(UnsupportedModelError, match="quantize"):
        tiny_model("qwen35").runner(quantize="int8")
    with pytest.raises(InvalidParameterError, match="quantize"):
        tiny_model("llama").runner(quantize="int3")


async def test_engine_from_pretrained_int8(tiny_model):
    engine = cothink.Engine.from_pretrained(tiny_model("qwen3").folder, quantize="int8")
    async with engine:
        block = engine.block("q")
        await engine.extend(block, token_ids=random_ids(6, seed=9))
        result = await engine.generate(block, max_tokens=4, stop_at_eos=False).collect()
    assert len(result.token_ids) == 4


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_bf16_fast_linears_match_the_eager_bf16_path(tiny_model, record_error, name):
    """bfloat16 linears: oneDNN-prepacked where the CPU has bfloat16 kernels (bit-identical, batch
    invariant to the bit), else CpuLinear (steps of >= 8 rows in float32 arithmetic: batch invariant
    up to bfloat16 rounding)."""
    from cothink.models.packing import CpuLinear, PackedLinear, can_pack

    tm = tiny_model(name)
    fast, eager = tm.runner(dtype=torch.bfloat16), tm.runner(dtype=torch.bfloat16, fast=False)
    packed = can_pack(torch.bfloat16, "cpu")
    assert isinstance(fast.model.lm_head, PackedLinear if packed else CpuLinear)
    ids = random_ids(48, seed=11)
    # a 40-row prefill: CpuLinear widens
    got = {"fast": prefill_then_decode(fast, ids, 40), "eager": prefill_then_decode(eager, ids, 40)}
    err = max_err(got["fast"], got["eager"])
    record_error("bf16 packed vs eager" if packed else "bf16 CpuLinear vs eager", name, err)
    bound = 0.02 * got["eager"].abs().max().item()
    assert err < bound
    # batch invariance: the same decode step alone (one row) and next to a prefill chunk (13 rows)
    block_a, block_b = fast.new_block(), fast.new_block()
    fast.extend(block_a, ids[:8])
    alone = fast.extend(fast.fork(block_a), [ids[8]])
    from cothink.execution.step import StepItem

    together = fast.step([StepItem(block_a, [ids[8]]), StepItem(block_b, ids[:12])])[0]
    if packed:
        assert torch.equal(alone, together)
    else:
        assert max_err(alone, together) < bound
