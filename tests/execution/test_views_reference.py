"""Multi-layer models under arbitrary views, against the slow stored-memory reference (tests/reference.py).

On a multi-layer model a block's stored memory depends on the view it was written with, so transformers
has no equivalent of an arbitrary view; the reference recomputes what a view must give from the blocks'
stored keys/values and GDN inputs, with plain attention and an explicit delta-rule loop.
"""

from __future__ import annotations

import random

import pytest
from reference import ATOL, max_err, random_ids, reference_logits
from support import write_blocks_with_random_views

from cothink.execution.step import StepItem

MODELS = ["llama", "qwen35", "qwen35_mm", "qwen35_moe", "qwen3_next", "kimi"]
LENGTHS = [1, 2, 3, 5, 17, 70, 4, 2]


VIEW_MODELS = ("qwen35", "qwen35_mm", "qwen35_moe", "qwen3_next", "kimi")
CASES = [("llama", None)] + [(name, dense) for name in VIEW_MODELS for dense in (None, 8)]


@pytest.mark.parametrize(("name", "dense"), CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_random_views_match_reference(tiny_model, record_error, name, dense):
    runner = tiny_model(name).runner(dense_summary_min_tokens=dense, page_size=5)  # odd page boundaries
    rng = random.Random(20)
    blocks = write_blocks_with_random_views(runner, rng, LENGTHS)
    worst = 0.0
    for trial in range(8):
        d = runner.new_block(f"D{trial}")
        view = rng.sample(blocks, rng.randint(1, 7)) + [d]
        ids = random_ids(rng.choice([1, 2, 5, 9]), rng)
        want = reference_logits(runner, view, ids)  # before extending: same memory as the runner reads
        worst = max(worst, max_err(runner.extend(d, ids, view=view), want))
        assert worst < ATOL, (trial, worst)
        # D grows again, first under the same view (cached state), then under a different one
        for again in (view, rng.sample(blocks, rng.randint(0, 4)) + [d]):
            ids = random_ids(rng.choice([1, 3]), rng)
            want = reference_logits(runner, again, ids)
            worst = max(worst, max_err(runner.extend(d, ids, view=again), want))
            assert worst < ATOL, (trial, worst)
        if trial % 2:
            blocks.append(d)  # later views read D as well
    record_error(f"random views vs reference ({'dense-8' if dense else 'default'})", name, worst)


@pytest.mark.parametrize("name", MODELS)
def test_one_step_many_items(tiny_model, record_error, name):
    """Step semantics: each item reads every view block as it was at the start of the step, plus its own
    new tokens, whoever shares the batch (docs/runtime.md, "Semantics")."""
    runner = tiny_model(name).runner()
    rng = random.Random(21)
    blocks = write_blocks_with_random_views(runner, rng, LENGTHS)
    a, b, c = runner.new_block("A"), runner.new_block("B"), blocks[4]
    runner.extend(a, random_ids(6, rng), view=blocks[:2] + [a])
    items = [
        StepItem(a, random_ids(3, rng), blocks[5:7] + [b, a]),  # reads B while B is written in this step
        StepItem(b, random_ids(7, rng), [a, blocks[0], b]),  # reads A while A is written in this step
        StepItem(c, random_ids(1, rng), [a, b, blocks[2], c]),  # appends to a block others read too
        StepItem(runner.new_block("E"), random_ids(4, rng), [c, blocks[1]], logits="last"),
    ]
    items[3].view.append(items[3].block)
    want = [reference_logits(runner, it.view, it.token_ids) for it in items]
    before = [it.block.length for it in items]
    got = runner.step(items)
    worst = 0.0
    for it, w, g in zip(items, want, got):
        w = w[-1:] if it.logits == "last" else w
        worst = max(worst, max_err(g, w))
    assert record_error("one step, many items", name, worst) < ATOL
    assert [it.block.length for it in items] == [n + len(it.token_ids) for n, it in zip(before, items)]

    # batch invariance: each item alone, on a fresh runner in the same state, gives the same logits
    for k in range(len(items)):
        solo = tiny_model(name).runner()
        rng2 = random.Random(21)
        blocks2 = write_blocks_with_random_views(solo, rng2, LENGTHS)
        a2, b2 = solo.new_block("A"), solo.new_block("B")
        solo.extend(a2, random_ids(6, rng2), view=blocks2[:2] + [a2])
        mapping = {id(x): y for x, y in zip(blocks + [a, b], blocks2 + [a2, b2])}
        it = items[k]
        block = mapping[id(it.block)] if id(it.block) in mapping else solo.new_block("E")
        view = [mapping.get(id(v), block) for v in it.view]
        alone = solo.extend(block, it.token_ids, view=view, logits=it.logits)
        assert max_err(alone, got[k]) < 1e-5
