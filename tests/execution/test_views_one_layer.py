"""One-layer models make every view exact.

With one layer, what a block stores (rotated keys and values, or GDN pre-conv rows, g and beta) depends
only on its own tokens, never on the view it was written with. So blocks written separately, each with a
view of itself only, and read in any order by a new block D must give D exactly the logits that
transformers gives on the tokens concatenated in view order.
"""

from __future__ import annotations

import random

import pytest
import torch
from reference import ATOL, max_err, random_ids, reference_logits

ONE_LAYER = ["llama_1l", "qwen3_1l", "qwen35_1l_linear", "qwen35_1l_full",
             # KDA, MLA, a sparse MoE block after Gated DeltaNet and after attention
             "kimi_1l_kda", "kimi_1l_mla", "qwen35_moe_1l_linear", "qwen35_moe_1l_full"]
LENGTHS = [1, 2, 3, 17, 70, 5, 2, 40, 1, 9]


def _write_blocks(runner, seed: int):
    """Blocks of LENGTHS, each written separately with the view [itself]; long ones in two steps."""
    rng = random.Random(seed)
    blocks, tokens = [], {}
    for i, n in enumerate(LENGTHS):
        block = runner.new_block(f"blk{i}")
        ids = random_ids(n, rng)
        if n > 20:
            runner.extend(block, ids[:25])
            runner.extend(block, ids[25:])
        else:
            runner.extend(block, ids)
        blocks.append(block)
        tokens[block.id] = ids
    return blocks, tokens


# dense summaries: linear-attention layers only (Gated DeltaNet, KDA)
CASES = [(name, None) for name in ONE_LAYER] + [(n, 8) for n in ("qwen35_1l_linear", "kimi_1l_kda",
                                                                 "qwen35_moe_1l_linear")]


@pytest.mark.parametrize(("name", "dense"), CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_any_view_is_exact(tiny_model, record_error, name, dense):
    tm = tiny_model(name)
    runner = tm.runner(dense_summary_min_tokens=dense)
    blocks, tokens = _write_blocks(runner, seed=10)
    rng = random.Random(11)
    views = [[1, 0, 2], [0, 2]]  # views [B, A, C, D] and [A, C, D]
    views += [rng.sample(range(len(blocks)), rng.randint(1, 8)) for _ in range(10)]
    views.append(list(range(len(blocks)))[::-1][:8])
    worst = 0.0
    for trial, order in enumerate(views):
        view = [blocks[j] for j in order]
        context = [t for b in view for t in tokens[b.id]]
        d = runner.new_block(f"D{trial}")
        first, second = random_ids(rng.choice([1, 3, 8]), rng), random_ids(rng.choice([1, 4]), rng)
        got1 = runner.extend(d, first, view=view + [d])
        got2 = runner.extend(d, second, view=view + [d])  # D grows under the same view (cached GDN state)
        want = tm.logits(context + first + second)
        worst = max(worst, max_err(got1, want[len(context) : len(context) + len(first)]),
                    max_err(got2, want[-len(second):]))
        assert worst < ATOL, (order, worst)
        # D re-read under another view (D's own memory is view-independent here too)
        other = [blocks[j] for j in rng.sample(range(len(blocks)), rng.randint(0, 3))]
        third = random_ids(2, rng)
        got3 = runner.extend(d, third, view=other + [d])
        want3 = tm.logits([t for b in other for t in tokens[b.id]] + first + second + third)[-2:]
        worst = max(worst, max_err(got3, want3))
        assert worst < ATOL, (order, worst)
        runner.free(d)
    record_error(f"one layer, any view ({'dense-8' if dense else 'default'})", name, worst)


@pytest.mark.parametrize("name", ONE_LAYER)
def test_reference_on_one_layer(tiny_model, record_error, name):
    """On one-layer models the stored-memory reference and transformers agree on any view as well."""
    tm = tiny_model(name)
    runner = tm.runner()
    blocks, tokens = _write_blocks(runner, seed=12)
    rng = random.Random(13)
    for _ in range(3):
        view = [blocks[j] for j in rng.sample(range(len(blocks)), 5)]
        ids = random_ids(4, rng)
        want = tm.logits([t for b in view for t in tokens[b.id]] + ids)[-4:]
        err = max_err(reference_logits(runner, view, ids), want)
        assert record_error("one layer, reference", name, err) < ATOL


def test_same_block_at_many_offsets(tiny_model):
    """One block read at different offsets in different views: no copy, logits follow the view."""
    tm = tiny_model("qwen35_1l_full")
    runner = tm.runner()
    blocks, tokens = _write_blocks(runner, seed=14)
    shared = blocks[3]  # 17 tokens
    used = runner.store.pool.used_pages
    for prefix in ([], [blocks[0]], [blocks[4], blocks[1]], [blocks[7], blocks[2], blocks[5]]):
        d = runner.new_block()
        ids = random_ids(3, seed=len(prefix))
        got = runner.extend(d, ids, view=prefix + [shared, d])
        want = tm.logits([t for b in prefix + [shared] for t in tokens[b.id]] + ids)[-3:]
        assert max_err(got, want) < ATOL
        runner.free(d)
    assert runner.store.pool.used_pages == used
    assert shared.length == 17
    assert torch.is_tensor(got)
