"""cothink's models against transformers on tiny random-weight configs (fp32).

Families: Llama, Qwen2, Qwen3, Qwen3.5 (text and multimodal layouts), and the MoE / Kimi Linear families:
Qwen3.5-MoE (text; multimodal with fused experts on disk), Qwen3-Next (with and without renormalised
top-k), Kimi Linear (KDA + MLA, dense first layer; group-limited routing).

Each family: the logits of a prompt prefilled whole, in chunks and token by token match the reference;
greedy generation matches `generate(do_sample=False)`; blocks written one after another (each reading all
previous blocks) match the reference run on the concatenated tokens.
"""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, max_err, random_ids, reference_logits

MOE_FAMILIES = ["qwen35_moe", "qwen35_moe_mm", "qwen3_next", "qwen3_next_nonorm", "kimi", "kimi_grouped"]
FAMILIES = ["llama", "llama3", "llama_yarn", "qwen2", "qwen2_tied", "qwen3", "qwen35", "qwen35_linear",
            "qwen35_mm", *MOE_FAMILIES]
PROMPT = 70  # > 64: the GDN chunked form crosses a chunk boundary


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_whole_chunked_and_token_by_token(tiny_model, record_error, name):
    tm = tiny_model(name)
    ids = random_ids(PROMPT, seed=1)
    want = tm.logits(ids)
    runner = tm.runner()

    whole = runner.extend(runner.new_block(), ids)
    assert whole.dtype == torch.float32 and whole.shape == (PROMPT, runner.config.vocab_size)
    assert record_error("whole prefill", name, max_err(whole, want)) < ATOL

    block = runner.new_block()
    sizes, parts, i = [7, 1, 13, 2, 30], [], 0
    while i < PROMPT:
        n = sizes[len(parts) % len(sizes)]
        parts.append(runner.extend(block, ids[i : i + n]))
        i += n
    assert record_error("chunked prefill", name, max_err(torch.cat(parts), want)) < ATOL

    block = runner.new_block()
    steps = torch.cat([runner.extend(block, [t]) for t in ids])
    assert record_error("token by token", name, max_err(steps, want)) < ATOL
    assert block.length == PROMPT


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_generate(tiny_model, name):
    tm = tiny_model(name)
    prompt, steps = random_ids(8, seed=2), 64
    want = tm.greedy(prompt, steps)
    runner = tm.runner()
    block = runner.new_block()
    logits = runner.extend(block, prompt, logits="last")
    assert logits.shape == (1, runner.config.vocab_size)
    got = []
    for _ in range(steps):
        got.append(int(logits[-1].argmax()))
        logits = runner.extend(block, got[-1:], logits="last")
    assert got == want
    assert len(set(got)) > 1  # not a degenerate constant continuation


def test_logits_modes(tiny_model):
    runner = tiny_model("qwen35").runner()
    ids = random_ids(9, seed=3)
    full = runner.extend(runner.new_block(), ids)
    last = runner.extend(runner.new_block(), ids, logits="last")
    none = runner.extend(runner.new_block(), ids, logits="none")
    assert last.shape == (1, full.shape[1]) and none.shape == (0, full.shape[1])
    assert max_err(last[0], full[-1]) < 1e-5


# Blocks one after another: lengths exercise GDN heads shorter than the conv window (1, 2, 3), the body
# replay, dense summaries (forced from 8 body tokens, or the default 4 * k_dim = 64) and chunk boundaries.
BLOCK_LENGTHS = [1, 2, 3, 5, 70, 4, 12]


# dense summaries exist only for linear-attention layers: the threshold is varied on Qwen3.5 only
BLOCK_CASES = [("llama", None), ("qwen2", None), ("qwen2_tied", None), ("qwen3", None)] + [
    (name, dense) for name in ("qwen35", "qwen35_linear", "qwen35_mm") for dense in (None, 8, 10**9)
] + [(name, dense) for name in ("qwen35_moe", "qwen3_next", "kimi") for dense in (None, 8, 10**9)] + [
    (name, None) for name in ("qwen35_moe_mm", "qwen3_next_nonorm", "kimi_grouped")
]


@pytest.mark.parametrize(("name", "dense"), BLOCK_CASES, ids=[f"{n}-{d}" for n, d in BLOCK_CASES])
def test_blocks_one_after_another(tiny_model, record_error, name, dense):
    tm = tiny_model(name)
    ids = random_ids(sum(BLOCK_LENGTHS), seed=4)
    want = tm.logits(ids)
    runner = tm.runner(dense_summary_min_tokens=dense)
    blocks, outs, start = [], [], 0
    for i, n in enumerate(BLOCK_LENGTHS):
        if i == 2:  # an empty block inside the view changes nothing
            blocks.append(runner.new_block("empty"))
        block = runner.new_block(f"b{i}")
        blocks.append(block)
        chunk = ids[start : start + n]
        if n > 20:  # long blocks in two steps, both reading the whole view; 67 tokens cross a GDN chunk
            outs.append(runner.extend(block, chunk[:3], view=list(blocks)))
            outs.append(runner.extend(block, chunk[3:], view=list(blocks)))
        else:
            outs.append(runner.extend(block, chunk, view=list(blocks)))
        start += n
    err = max_err(torch.cat(outs), want)
    assert record_error(f"blocks in order ({_mode(dense)})", name, err) < ATOL

    # Read everything again from a fresh block: the view's summaries and cached states are reused.
    probe_ids = random_ids(3, seed=5)
    ref = reference_logits(runner, blocks, probe_ids)
    reader = runner.new_block("reader")
    got = runner.extend(reader, probe_ids, view=blocks + [reader])
    full = tm.logits(ids + probe_ids)[-3:]
    assert max_err(got, full) < ATOL
    assert max_err(got, ref) < ATOL
    if runner.config.linear_config is not None:  # summaries exist exactly where the threshold asks for them
        threshold = runner.dense_summary_min_tokens
        for block in blocks:
            has = [rec.summary is not None for rec in block.linear]
            assert has == [block.length - 3 >= threshold] * len(has), (block.name, block.length, threshold)


def _mode(dense: int | None) -> str:
    return {None: "dense default", 8: "dense-8"}.get(dense, "replay only")


def test_reference_matches_transformers(tiny_model, record_error):
    """The reference itself (empty view, all tokens new) agrees with transformers."""
    for name in ["llama_yarn", "qwen2", "qwen3", "qwen35", "qwen35_mm", *MOE_FAMILIES]:
        tm = tiny_model(name)
        ids = random_ids(40, seed=6)
        ref = reference_logits(tm.runner(), [], ids)
        assert record_error("reference vs transformers", name, max_err(ref, tm.logits(ids))) < ATOL


def test_multimodal_layout_ignores_visual_and_mtp(tiny_model):
    from safetensors import safe_open

    tm = tiny_model("qwen35_mm")
    with safe_open(str(tm.folder / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("mtp.") for k in keys) and any(k.startswith("model.visual.") for k in keys)
    runner = tm.runner()
    assert runner.config.family == "qwen3_5"
    assert runner.config.layer_types == ("full_attention", "linear_attention", "linear_attention")
    names = set(runner.model.state_dict())
    assert not any("visual" in n or "mtp" in n for n in names)
    # tied embeddings declared at the top level of the multimodal config
    assert torch.equal(runner.model.lm_head.weight, runner.model.model.embed_tokens.weight)
