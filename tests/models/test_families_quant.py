"""The MoE and Kimi Linear families on the CPU fast path: bfloat16 experts as oneDNN-prepacked linears
(bit-identical to the stacked experts), and weight-only int8 (experts, attention and MLP linears int8;
routers and the gate inputs that drive decays in the model dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import max_err, random_ids

import cothink
from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.models.kda import KimiDeltaAttention
from cothink.models.moe import ExpertLinears, Experts, SparseMoeBlock
from cothink.models.packing import CpuLinear, FastLinear, PackedLinear, can_pack
from cothink.models.quantize import INT8_KERNEL_MAX_ROWS, Int8Linear, RowSplitLinear
from cothink.models.transformer import GatedDeltaNet

FAMILIES = ["qwen35_moe", "qwen3_next", "kimi"]


def _logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits of a 20-token prefill, then of four decode steps (wide and narrow products)."""
    block = runner.new_block()
    return torch.cat([runner.extend(block, ids[:20]), *(runner.extend(block, [t]) for t in ids[20:])])


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _blocks(runner) -> list[SparseMoeBlock]:
    return [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]


# ---- bfloat16 experts ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_fast_experts_are_the_stacked_experts(tiny_model, name):
    """The fast path's experts (one linear pair per expert, the CPU kernel for bfloat16) give the
    stacked experts' result for the same rows and routing: to the bit where oneDNN prepacks
    (PackedLinear is `F.linear`'s result), else within bfloat16 rounding (CpuLinear widens >= 8 rows)."""
    tm = tiny_model(name)
    fast, eager = tm.runner(dtype=torch.bfloat16), tm.runner(dtype=torch.bfloat16, fast=False)
    packed = can_pack(torch.bfloat16, "cpu")
    torch.manual_seed(0)
    for fast_block, eager_block in zip(_blocks(fast), _blocks(eager), strict=True):
        assert isinstance(fast_block.experts, ExpertLinears) and type(eager_block.experts) is Experts
        linears = [*fast_block.experts.gate_up, *fast_block.experts.down]
        assert all(isinstance(lin, PackedLinear if packed else CpuLinear) for lin in linears)
        for rows in (1, 3, 40):  # decode, a few coroutines, a prefill chunk
            x = torch.randn(rows, fast_block.cfg.hidden_size).to(torch.bfloat16)
            with torch.inference_mode():
                routing = eager_block.gate(x)
                got, want = fast_block.experts(x, routing), eager_block.experts(x, routing)
                whole_got, whole_want = fast_block(x), eager_block(x)  # router and shared expert too
            if packed:
                assert torch.equal(got, want) and torch.equal(whole_got, whole_want)
            else:
                assert max_err(got, want) < 0.02 * want.abs().max().item()


# ---- weight-only int8 ------------------------------------------------------------------------------


class Dequantized(torch.nn.Module):
    """An int8 layer's defined product (models/quantize.py `Int8Linear`) computed in plain torch from
    its dequantized weight: activations rounded to bfloat16; where torch's int8 kernel takes the
    product (up to INT8_KERNEL_MAX_ROWS rows, input width a multiple of 16) the float32 product with
    q * scale, rounded to bfloat16 once; otherwise the bfloat16 GEMM with q * scale in bfloat16."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.q, self.scale = layer.weight_int8, layer.scale
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if rows.shape[0] <= INT8_KERNEL_MAX_ROWS and self.q.shape[1] % 16 == 0:
            y = F.linear(rows.float(), self.q.float() * self.scale.float()[:, None]).to(torch.bfloat16)
        else:
            y = F.linear(rows, self.q.to(torch.bfloat16) * self.scale[:, None])
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], -1)


def _dequantize_in_place(model: torch.nn.Module) -> int:
    """Replace every Int8Linear of `model` by its Dequantized counterpart; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, Dequantized(child))
                count += 1
    return count


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_moe_model_is_its_dequantized_model(tiny_model, record_error, name):
    """The whole int8 model (prefill and decode; experts, shared experts, attention, the lm_head)
    against the same model whose int8 layers are plain torch products with their dequantized weights:
    the same routing, float32 summation order apart: at most a one-ulp bfloat16 step somewhere, under
    one step of the largest logit (2^-8 of it). The ids are ones without a near-tie: a one-ulp
    difference can flip a router's near-tie or a rounding of P in the attention and move every later
    logit (seeds 7-14 measured 0 to 3e-4 on most, up to 2.6e-2 on two, with torch's flash kernel and
    the C one alike). With these, the three families measure 0, 0 and 2.9e-4, and one layer's scales
    off by 1% measure 1.0e-2 to 0.32, two layers' weights exchanged 0.9-1.6."""
    tm = tiny_model(name)
    q = tm.runner(dtype=torch.bfloat16, quantize="int8")
    ids = random_ids(24, seed=8)
    got = _logits(q, ids)
    assert _dequantize_in_place(q.model) > 0
    want = _logits(q, ids)
    assert record_error("int8 vs its dequantized model (relative)", name, _rel(got, want)) < 2**-8


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_experts_hold_their_own_weights(tiny_model, name):
    """Expert e's int8 linears dequantize to expert e's checkpoint weights within one step of its row
    (absmax / 127): half a step of rounding, plus up to 127 x the bfloat16 scale's rounding (2^-8)."""
    tm = tiny_model(name)
    q, plain = tm.runner(quantize="int8"), tm.runner(fast=False)
    for block, stacked in zip(_blocks(q), _blocks(plain), strict=True):
        for e in range(stacked.experts.num_experts):
            for layer, weight in ((block.experts.gate_up[e], stacked.experts.gate_up_proj[e]),
                                  (block.experts.down[e], stacked.experts.down_proj[e])):
                deq = layer.weight_int8.float() * layer.scale.float()[:, None]
                step = weight.detach().abs().amax(dim=1, keepdim=True) / 127
                assert ((deq - weight.detach()).abs() <= step).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_moe_stays_close_to_bfloat16(tiny_model, record_error, name):
    """int8 against bfloat16, both against float32 transformers. Tolerance: these tiny random models
    amplify any rounding (bfloat16 alone moves Kimi's logits by ~40% of their range), so int8 may move
    them from bfloat16 by at most 1.5x bfloat16's own distance from float32, or 20%, whichever is larger;
    the greedy choice mostly agrees."""
    tm = tiny_model(name)
    ids = random_ids(24, seed=7)
    bf16 = _logits(tm.runner(dtype=torch.bfloat16), ids)
    int8 = _logits(tm.runner(dtype=torch.bfloat16, quantize="int8"), ids)
    bf16_drift = _rel(bf16, tm.logits(ids))
    rel = record_error("int8 vs bf16 (relative)", name, _rel(int8, bf16))
    assert rel < max(0.2, 1.5 * bf16_drift)
    assert (int8.argmax(-1) == bf16.argmax(-1)).float().mean().item() >= 0.75


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_keeps_routers_and_decay_gates_in_the_model_dtype(tiny_model, name):
    """Experts, attention, MLA, KDA q/k/v/output and MLP linears are int8, with no dense copy left;
    routers, the shared-expert gate, Gated DeltaNet's b/a rows and KDA's decay and beta inputs keep
    the model dtype."""
    q = tiny_model(name).runner(dtype=torch.bfloat16, quantize="int8")
    assert isinstance(q.model.lm_head, Int8Linear)
    for block in _blocks(q):
        assert block.gate.weight.dtype == torch.bfloat16
        assert all(isinstance(lin, Int8Linear) for lin in (*block.experts.gate_up, *block.experts.down))
        shared = block.shared
        assert shared is not None and isinstance(shared.down_proj, Int8Linear)
        if block.shared_expert_gate is not None:
            assert isinstance(block.shared_expert_gate, FastLinear)
            assert not isinstance(block.shared_expert_gate, Int8Linear)
    mixers = [layer.mixer for layer in q.model.model.layers]
    for mixer in mixers:
        if isinstance(mixer, GatedDeltaNet):
            assert isinstance(mixer.in_proj, RowSplitLinear) and isinstance(mixer.in_proj.head, Int8Linear)
            assert not isinstance(mixer.in_proj.tail, Int8Linear)
            assert mixer.in_proj.tail.out_features == 2 * mixer.cfg.num_v_heads
            assert mixer.in_proj_qkv is None and mixer.in_proj_b is None  # fused parts dropped
            assert isinstance(mixer.out_proj, Int8Linear)
        elif isinstance(mixer, KimiDeltaAttention):
            assert isinstance(mixer.qkv_proj, Int8Linear) and mixer.q_proj is None
            assert all(isinstance(lin, Int8Linear) for lin in (mixer.g_a_proj, mixer.g_b_proj, mixer.o_proj))
            for lin in (mixer.f_a_proj, mixer.f_b_proj, mixer.b_proj):
                assert isinstance(lin, FastLinear) and not isinstance(lin, Int8Linear)
        else:
            assert isinstance(mixer.o_proj, Int8Linear)


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_unfused_model_quantizes_the_same_linears(tiny_model, name):
    """`fast=False` with int8: the per-projection modules, experts split per expert, the same gates kept."""
    q = tiny_model(name).runner(dtype=torch.bfloat16, quantize="int8", fast=False)
    for block in _blocks(q):
        assert all(isinstance(lin, Int8Linear) for lin in (*block.experts.gate_up, *block.experts.down))
    for layer in q.model.model.layers:
        mixer = layer.mixer
        if isinstance(mixer, GatedDeltaNet):
            assert isinstance(mixer.in_proj_qkv, Int8Linear) and not isinstance(mixer.in_proj_a, Int8Linear)
        if isinstance(mixer, KimiDeltaAttention):
            assert isinstance(mixer.q_proj, Int8Linear) and not isinstance(mixer.f_a_proj, Int8Linear)
    assert _logits(q, random_ids(24, seed=7)).isfinite().all()


async def test_int8_moe_generates_through_the_engine(tiny_model):
    """Steps of several coroutines (the experts route every item's rows together) on int8 weights."""
    engine = cothink.Engine.from_pretrained(tiny_model("kimi").folder, dtype=torch.bfloat16, quantize="int8")
    async with engine:
        prompt = engine.block("prompt")
        await engine.extend(prompt, token_ids=random_ids(12, seed=9))
        runs = [engine.generate([prompt, engine.block(f"c{i}")], max_tokens=4, stop_at_eos=False)
                for i in range(3)]
        results = [await run.collect() for run in runs]
    assert [len(r.token_ids) for r in results] == [4, 4, 4]


@pytest.mark.parametrize("name", FAMILIES)
def test_unsupported_quantization_is_refused(tiny_model, name):
    tm = tiny_model(name)
    with pytest.raises(UnsupportedModelError, match="quantize") as err:
        tm.runner(quantize="int4")
    assert err.value.param == "quantize"
    with pytest.raises(InvalidParameterError, match="quantize"):
        tm.runner(quantize="int3")


def test_int8_still_refuses_the_dense_qwen35_hybrid(tiny_model):
    with pytest.raises(UnsupportedModelError, match="quantize"):
        tiny_model("qwen35").runner(quantize="int8")
