"""Batch invariance and step semantics of `ModelRunner.step` (docs/runtime.md, "Semantics").

One step carries many items, each writing its own block under its own view (different block orders and
offsets, decode tokens and prefill chunks mixed, partial views through `read_lengths`). Each item's
logits must equal (fp32, atol 1e-5) the logits of the same item run alone on a fresh runner over the same
memory. "The same memory" is built by replaying the history one item per forward pass: the build ops,
then every earlier step's items, each reading the other blocks as they were at the start of its step
(`read_lengths` pins them). Running an item of step s alone right after that replay gives exactly the
state at the start of step s, so the comparison also shows the step semantics: an item does not see what
other items write in its step (block P grows in step 1 while four items read it), and sees it from the
next step on (step 2 results equal alone runs over the replayed step 1; hiding step 1's writes again
changes them).
"""

from __future__ import annotations

import random

import pytest
import torch

from cothink.execution.step import StepItem
from support import ATOL, fresh_runner, ids, load_runner, max_err

# (block, tokens, view): how the memory is built before the tested steps, one item per forward pass
BUILD = [
    ("P", 11, "P"),
    ("A", 7, "PA"),
    ("B", 2, "APB"),  # two tokens: shorter than the GDN conv head (3 tokens)
    ("C", 9, "C"),
    ("A", 3, "PA"),
    ("E", 4, "BE"),
    ("G", 1, "G"),
    ("H", 20, "CH"),
]

# per step: (block, tokens, view, logits, read_lengths); views are strings of block names, writer last
STEPS = [
    [
        ("A", 1, "PA", "all", None),  # decode, reads P (P grows in this step)
        ("B", 6, "APB", "all", None),  # prefill chunk; reads A, which item 0 writes in this step
        ("C", 1, "BPC", "all", None),  # reads B and P, both written in this step
        ("D", 5, "CAD", "last", None),  # prefill into an empty block
        ("E", 1, "PBE", "all", [6, 1]),  # reads an earlier state of P and B
        ("F", 8, "EGF", "none", None),  # no logits: its memory is checked through the next steps
        ("P", 4, "P", "all", None),  # P grows while four items read it
        ("G", 2, "AG", "all", None),  # G's view changes from [G] to [A, G]
        ("H", 1, "PABH", "last", None),  # H was written under [C, H]; now read after three other blocks
    ],
    [  # every item again; each now sees what the others wrote in step 1
        ("A", 1, "PA", "all", None),
        ("B", 1, "APB", "all", None),
        ("C", 1, "BPC", "all", None),
        ("D", 1, "CAD", "all", None),
        ("E", 1, "PBE", "all", None),
        ("F", 2, "EGF", "all", None),
        ("P", 1, "P", "all", None),
        ("G", 1, "AG", "all", None),
        ("H", 3, "PABH", "all", None),
    ],
    [  # another batch composition: new view orders, a block read at three different offsets
        ("C", 3, "PBC", "all", None),
        ("D", 1, "CAD", "all", None),
        ("G", 1, "FAG", "all", [10, 12]),
        ("E", 2, "FPBE", "all", None),
        ("A", 1, "HPA", "last", None),
    ],
]
NAMES = sorted({op[0] for op in BUILD} | {it[0] for step in STEPS for it in step})


def _tokens(seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = random.Random(seed)
    build = [ids(n, rng) for _, n, _ in BUILD]
    steps = [[ids(it[1], rng) for it in step] for step in STEPS]
    return build, steps


def _item(blocks, name, toks, view, logits, read_lengths):
    return StepItem(blocks[name], list(toks), [blocks[c] for c in view], logits, read_lengths)


def _build(runner, build_tokens):
    blocks = {n: runner.new_block(n) for n in NAMES}
    for (name, _, view), toks in zip(BUILD, build_tokens):
        runner.step([_item(blocks, name, toks, view, "none", None)])
    return blocks


def _replay_step(runner, blocks, step, step_tokens):
    """Run a step's items one at a time, each reading the others' blocks as they were at step start."""
    start = {n: len(b) for n, b in blocks.items()}
    for (name, _, view, _, read), toks in zip(step, step_tokens):
        pinned = read if read is not None else [start[c] for c in view[:-1]]
        runner.step([_item(blocks, name, toks, view, "none", pinned)])


def _batched(runner, build_tokens, step_tokens, order):
    """Build, then run every step as ONE forward pass; returns logits[step][item] and start lengths."""
    blocks = _build(runner, build_tokens)
    out, starts = [], []
    for step, toks in zip(STEPS, step_tokens):
        starts.append({n: len(b) for n, b in blocks.items()})
        idx = list(range(len(step)))
        if order == "reversed":
            idx.reverse()
        elif order == "shuffled":
            random.Random(len(out)).shuffle(idx)
        results = runner.step([_item(blocks, *step[i][:1], toks[i], *step[i][2:]) for i in idx])
        logits = [None] * len(step)
        for i, res in zip(idx, results):
            logits[i] = res
        out.append(logits)
    return out, starts, blocks


def _alone(runner, build_tokens, step_tokens, s, i):
    """Item i of step s alone on a fresh runner over the same memory (history replayed one item at a time)."""
    fresh = fresh_runner(runner, page_size=runner.store.page_size)
    blocks = _build(fresh, build_tokens)
    for step, toks in zip(STEPS[:s], step_tokens[:s]):
        _replay_step(fresh, blocks, step, toks)
    name, _, view, logits, read = STEPS[s][i]
    return fresh.step([_item(blocks, name, step_tokens[s][i], view, logits, read)])[0], fresh, blocks


_ALONE: dict[tuple, list[list[torch.Tensor]]] = {}


def _alone_all(runner, kind, seed, build_tokens, step_tokens):
    """Alone results of every item of every step (cached: they do not depend on the batch order)."""
    key = (kind, seed, runner.dense_summary_min_tokens)
    if key not in _ALONE:
        _ALONE[key] = [[_alone(runner, build_tokens, step_tokens, s, i)[0] for i in range(len(step))]
                       for s, step in enumerate(STEPS)]
    return _ALONE[key]


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def model_kind(request):
    return request.param


@pytest.mark.parametrize("order", ["given", "reversed", "shuffled"])
def test_batched_items_equal_alone_runs(model_kind, order):
    runner = load_runner(model_kind, kv_tokens=2048, page_size=4)
    build_tokens, step_tokens = _tokens(seed=1)
    batched, _, _ = _batched(runner, build_tokens, step_tokens, order)
    alone_all = _alone_all(runner, model_kind, 1, build_tokens, step_tokens)
    worst = 0.0
    for s, step in enumerate(STEPS):
        for i, (name, n, _, mode, _) in enumerate(step):
            alone = alone_all[s][i]
            want_rows = {"all": n, "last": 1, "none": 0}[mode]
            assert batched[s][i].shape == (want_rows, runner.config.vocab_size)
            err = max_err(batched[s][i], alone)
            worst = max(worst, err)
            assert err <= ATOL, f"step {s} item {i} ({name}): batched vs alone differ by {err:.2e}"
    print(f"{model_kind} {order}: max |batched - alone| = {worst:.2e}")


def test_same_step_writes_are_invisible_until_next_step(model_kind):
    """Step 1: P grows by 4 tokens while items A, B, C read P; B grows by 6 while C reads it. Their step-1
    logits equal the pre-step state (alone runs before any step-1 write); step-2 logits see the writes."""
    runner = load_runner(model_kind, kv_tokens=2048, page_size=4)
    build_tokens, step_tokens = _tokens(seed=2)
    batched, starts, blocks = _batched(runner, build_tokens, step_tokens, "given")

    # Step 1, item C (view [B, P, C]): alone on the pre-step memory = batched, although B and P grew
    c1 = next(i for i, it in enumerate(STEPS[0]) if it[0] == "C")
    alone_pre, fresh, fblocks = _alone(runner, build_tokens, step_tokens, 0, c1)
    assert max_err(batched[0][c1], alone_pre) <= ATOL
    # ... and differs from what C would have computed had it seen B's and P's step-1 tokens
    _replay_step(fresh, fblocks, [it for it in STEPS[0] if it[0] in "BP"],
                 [t for it, t in zip(STEPS[0], step_tokens[0]) if it[0] in "BP"])
    fresh.truncate(fblocks["C"], len(fblocks["C"]) - 1)
    seen = fresh.step([_item(fblocks, "C", step_tokens[0][c1], "BPC", "all", None)])[0]
    assert max_err(batched[0][c1], seen) > 1e-3, "the counterfactual must differ, or the test means nothing"

    # Step 2, item C: equals the alone run after step 1 was fully applied ...
    c2 = next(i for i, it in enumerate(STEPS[1]) if it[0] == "C")
    alone_post, fresh2, fblocks2 = _alone(runner, build_tokens, step_tokens, 1, c2)
    assert max_err(batched[1][c2], alone_post) <= ATOL
    # ... and hiding step 1's writes to B and P again (read them at their step-1 start) changes the result
    fresh2.truncate(fblocks2["C"], len(fblocks2["C"]) - 1)
    hidden = fresh2.step([_item(fblocks2, "C", step_tokens[1][c2], "BPC", "all",
                                [starts[0]["B"], starts[0]["P"]])])[0]
    assert max_err(batched[1][c2], hidden) > 1e-3
    # the step's committed lengths: every writer grew by exactly its own tokens
    for name in NAMES:
        grown = sum(n for step in STEPS for (b, n, *_rest) in step if b == name)
        built = sum(n for b, n, _ in BUILD if b == name)
        assert len(blocks[name]) == built + grown == len(blocks[name].tokens)


def test_step_with_dense_linear_summaries():
    """The Qwen3.5 hybrid with dense [B|A] summaries for every block body (dense_summary_min_tokens=1):
    batched items still equal alone runs."""
    runner = load_runner("qwen35", kv_tokens=2048, page_size=4, dense_summary_min_tokens=1)
    build_tokens, step_tokens = _tokens(seed=3)
    batched, _, _ = _batched(runner, build_tokens, step_tokens, "reversed")
    for s, step in enumerate(STEPS):
        for i in range(len(step)):
            fresh_alone, _, _ = _alone(runner, build_tokens, step_tokens, s, i)
            err = max_err(batched[s][i], fresh_alone)
            assert err <= ATOL, f"step {s} item {i}: {err:.2e}"


def test_same_block_read_at_different_offsets_in_one_step(model_kind):
    """Many single-token readers of one shared block, each at a different view offset, in one step."""
    runner = load_runner(model_kind, kv_tokens=4096, page_size=8)
    rng = random.Random(5)
    shared = runner.new_block("shared")
    runner.extend(shared, ids(13, rng), logits="none")
    fillers, outs = [], []
    for j in range(6):
        f = runner.new_block(f"f{j}")
        runner.extend(f, ids(3 * j + 1, rng), logits="none")
        fillers.append(f)
    items, views = [], []
    for j in range(6):
        out = runner.new_block(f"o{j}")
        outs.append(out)
        view = [*fillers[:j], shared, out] if j % 2 else [shared, *fillers[:j], out]
        views.append(view)
        items.append(StepItem(out, ids(1 + (j % 3) * 4, rng), view, "all"))
    batched = runner.step(items)
    for j, item in enumerate(items):
        fresh = fresh_runner(runner, page_size=8)
        mapping = {}
        for b in [shared, *fillers]:
            mapping[b.id] = fresh.new_block(b.name)
            fresh.extend(mapping[b.id], b.tokens, logits="none")
        mapping[outs[j].id] = fresh.new_block(outs[j].name)
        alone = fresh.extend(mapping[outs[j].id], item.token_ids, [mapping[b.id] for b in views[j]])
        assert max_err(batched[j], alone) <= ATOL, f"reader {j}"
    # the readers really saw the shared block at different positions: their first-token logits differ
    assert max_err(batched[0][:1], batched[1][:1]) > 1e-4


def test_step_result_does_not_depend_on_batch_size(model_kind):
    """A decode item gives the same logits alone, with 1 neighbour and with 30 neighbours."""
    runner = load_runner(model_kind, kv_tokens=8192, page_size=16)
    rng = random.Random(9)
    ctx = runner.new_block("ctx")
    runner.extend(ctx, ids(40, rng), logits="none")
    blocks = [runner.new_block(f"b{j}") for j in range(31)]
    for b in blocks:
        runner.extend(b, ids(rng.randrange(1, 30), rng), [ctx, b], logits="none")
    token = ids(1, rng)
    neighbours = [StepItem(b, ids(rng.choice([1, 1, 7]), rng), [ctx, b], "last") for b in blocks[1:]]
    results = []
    for k in (0, 1, 30):
        fork = runner.fork(blocks[0])
        out = runner.step([*neighbours[:k], StepItem(fork, token, [ctx, fork], "all")])[-1]
        results.append(out)
        for b in blocks[1 : k + 1]:  # undo the neighbours' writes so every batch sees the same memory
            runner.truncate(b, len(b) - len(neighbours[blocks.index(b) - 1].token_ids))
        runner.free(fork)
    assert max_err(results[0], results[1]) <= ATOL
    assert max_err(results[0], results[2]) <= ATOL
    assert torch.isfinite(results[2]).all()
