"""Qwen2 / Qwen2.5 checkpoints in every path: the layout (biases on q/k/v, none on o_proj), views against
the stored-memory reference, the fast path (fp32, bf16, int8, the fused decode step) against the eager
path and transformers. Prefill, greedy generation and blocks in order are in test_models_hf.py."""

from __future__ import annotations

import random

import pytest
import torch
from reference import ATOL, max_err, random_ids, reference_logits
from support import (
    count_fused_decode_rows,
    fast_and_eager,
    prefill_then_decode,
    write_blocks_with_random_views,
)

import cothink
from cothink.execution.step import StepItem
from cothink.models.quantize import Int8Linear
from cothink.ops import native

NAMES = ["qwen2", "qwen2_tied"]
EXACT = 1e-4  # fp32 logits: fast path vs eager path vs transformers


def test_layout_has_qkv_biases_and_no_output_bias(tiny_model):
    from safetensors import safe_open

    tm = tiny_model("qwen2")
    with safe_open(str(tm.folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    runner = tm.runner(fast=False)
    cfg = runner.config
    assert cfg.family == "qwen2" and cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm
    assert cfg.hf_text_config.rope_parameters["rope_theta"] == 1e6
    attn = runner.model.model.layers[0].self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None and attn.q_norm is None
    ref_attn = tm.ref.model.layers[0].self_attn
    assert torch.equal(attn.k_proj.bias, ref_attn.k_proj.bias)


def test_the_biases_change_the_logits(tiny_model):
    """The exactness tests can fail: without its q/k/v biases the model is a different function."""
    tm = tiny_model("qwen2")
    ids = random_ids(20, seed=3)
    runner = tm.runner(fast=False)
    with torch.no_grad():
        for layer in runner.model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    err = max_err(runner.extend(runner.new_block(), ids), tm.logits(ids))
    assert err > 100 * ATOL


# lengths of the blocks written with random views: partial pages, multi-page blocks, two-step blocks
LENGTHS = [1, 2, 3, 5, 17, 40, 4]


@pytest.mark.parametrize("name", NAMES)
def test_random_views_match_reference(tiny_model, record_error, name):
    runner = tiny_model(name).runner(page_size=5)  # odd page boundaries
    rng = random.Random(30)
    blocks = write_blocks_with_random_views(runner, rng, LENGTHS)
    worst = 0.0
    for trial in range(6):
        reader = runner.new_block(f"D{trial}")
        view = rng.sample(blocks, rng.randint(1, 6)) + [reader]
        ids = random_ids(rng.choice([1, 2, 5, 9]), rng)
        want = reference_logits(runner, view, ids)  # before extending: the memory the runner reads
        worst = max(worst, max_err(runner.extend(reader, ids, view=view), want))
        again = rng.sample(blocks, rng.randint(0, 4)) + [reader]  # the reader grows under another view
        ids = random_ids(3, rng)
        want = reference_logits(runner, again, ids)
        worst = max(worst, max_err(runner.extend(reader, ids, view=again), want))
        assert worst < ATOL, (trial, worst)
    record_error("random views vs reference", name, worst)


def test_one_step_many_items_reads_the_view_at_step_start(tiny_model, record_error):
    runner = tiny_model("qwen2").runner()
    rng = random.Random(31)
    blocks = write_blocks_with_random_views(runner, rng, LENGTHS)
    a, b = runner.new_block("A"), runner.new_block("B")
    runner.extend(a, random_ids(6, rng), view=blocks[:2] + [a])
    items = [
        StepItem(a, random_ids(3, rng), blocks[5:7] + [b, a]),  # reads B while B is written in this step
        StepItem(b, random_ids(7, rng), [a, blocks[0], b]),  # reads A while A is written in this step
        StepItem(blocks[4], random_ids(1, rng), [a, b, blocks[2], blocks[4]]),
    ]
    want = [reference_logits(runner, it.view, it.token_ids) for it in items]
    got = runner.step(items)
    worst = max(max_err(g, w) for g, w in zip(got, want))
    assert record_error("one step, many items", "qwen2", worst) < ATOL


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_fast_path_fp32_matches_eager_and_transformers(tiny_model, record_error, name, kernels, monkeypatch):
    tm, fast, eager = fast_and_eager(tiny_model, name, kernels, monkeypatch)
    ids = random_ids(40, seed=5)
    qkv = fast.model.model.layers[0].self_attn.qkv_proj
    assert qkv is not None and qkv.bias is not None  # the fused projection carries the q/k/v biases
    logits = {"fast": prefill_then_decode(fast, ids, 32), "eager": prefill_then_decode(eager, ids, 32)}
    assert record_error(f"fast ({kernels}) vs eager", name, max_err(logits["fast"], logits["eager"])) < EXACT
    err = max_err(logits["fast"], tm.logits(ids))
    assert record_error(f"fast ({kernels}) vs transformers", name, err) < EXACT


@pytest.mark.parametrize("name", NAMES)
def test_bf16_fast_linears_match_the_eager_bf16_path(tiny_model, record_error, name):
    tm = tiny_model(name)
    fast, eager = tm.runner(dtype=torch.bfloat16), tm.runner(dtype=torch.bfloat16, fast=False)
    ids = random_ids(48, seed=11)
    got = {"fast": prefill_then_decode(fast, ids, 40), "eager": prefill_then_decode(eager, ids, 40)}
    err = max_err(got["fast"], got["eager"])
    record_error("bf16 fast vs eager", name, err)
    assert err < 0.02 * got["eager"].abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_int8_with_biases_close_to_fp32(tiny_model, record_error, name):
    tm = tiny_model(name)
    q = tm.runner(quantize="int8")
    attn = q.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int8Linear) and attn.qkv_proj.bias is not None
    assert isinstance(attn.o_proj, Int8Linear) and attn.o_proj.bias is None
    # the int8 layer keeps the biases exactly
    ref_attn = tm.ref.model.layers[0].self_attn
    want_bias = torch.cat([ref_attn.q_proj.bias, ref_attn.k_proj.bias, ref_attn.v_proj.bias])
    assert torch.equal(attn.qkv_proj.bias, want_bias)
    ids = random_ids(24, seed=7)
    want = tm.logits(ids)
    block = q.new_block()
    got = torch.cat([q.extend(block, ids[:20]), *(q.extend(block, [t]) for t in ids[20:])])  # both kernels
    rel = max_err(got, want) / want.abs().max().item()
    record_error("int8 vs fp32 (relative)", name, rel)
    assert rel < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


@pytest.mark.parametrize("in_features", [56, 40, 64])
def test_int8_decode_rows_of_any_width_match_the_dequantized_product(in_features):
    """The small Qwen2.5 width 896 = 56 x 16 is fine, but a row whose width is no multiple of 16
    must not reach torch's int8 kernel (it reads past the row there)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(in_features, 24, bias=True)
    layer = Int8Linear(dense.weight, dense.bias)
    x = torch.randn(3, in_features)
    want = torch.nn.functional.linear(x.to(torch.bfloat16), layer.dequantized(torch.bfloat16)).float()
    want = want + layer.bias
    for rows in (x[:1], x):
        got = layer(rows)
        assert max_err(got, want[: rows.shape[0]]) < 0.02 * want.abs().max().item()


def _decode_conversation(runner) -> list[torch.Tensor]:
    """A shared context, three coroutines prefilling and then decoding over it, one coroutine alone."""
    ctx = runner.new_block("ctx")
    out = [runner.extend(ctx, random_ids(20, seed=1))]
    writers = [runner.new_block(f"w{i}") for i in range(3)]
    pairs = [(w, [ctx, w]) for w in writers]
    out += runner.step([StepItem(w, random_ids(2, seed=3 + i), v) for i, (w, v) in enumerate(pairs)])
    for s in range(5):
        out += runner.step([StepItem(w, [7 * s + i], v, "last") for i, (w, v) in enumerate(pairs)])
    out.append(runner.extend(writers[0], [9], [ctx, writers[0]]))
    return out


@pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")
@pytest.mark.parametrize(
    ("name", "dtype", "quantize"),
    # (bfloat16 weights take the fused step only where oneDNN does not pack them; int8 ones always)
    [("qwen2", torch.float32, None), ("qwen2", torch.bfloat16, "int8"), ("qwen2", torch.float32, "int8")],
)
def test_fused_decode_step_is_the_module_path_to_the_bit(tiny_model, monkeypatch, name, dtype, quantize):
    calls = count_fused_decode_rows(monkeypatch)
    fused = tiny_model(name).runner(dtype=dtype, quantize=quantize)
    modules = tiny_model(name).runner(dtype=dtype, quantize=quantize)
    assert fused.fused_decode is not None
    modules.fused_decode = None
    got = _decode_conversation(fused)
    assert calls == [3] * 5 + [1]  # the decode steps ran in the fused step
    want = _decode_conversation(modules)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


async def test_engine_generates_greedily_as_transformers(tiny_model):
    tm = tiny_model("qwen2_tied")
    prompt = random_ids(8, seed=2)
    async with cothink.Engine.from_pretrained(tm.folder) as engine:
        block = engine.block("q")
        await engine.extend(block, token_ids=prompt)
        result = await engine.generate(block, max_tokens=16, stop_at_eos=False).collect()
    assert list(result.token_ids) == tm.greedy(prompt, 16)
