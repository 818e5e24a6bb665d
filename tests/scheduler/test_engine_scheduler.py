"""The scheduling policy (src/cothink/scheduler/policy.py): `plan_step` as a pure function, and the engine
keeping an interactive probe within the documented bound while a 4k-token background prefill runs.

Documented bound (policy module docstring): an interactive item of q tokens, behind d interactive
decoders and no other interactive prefill, is fully served within
ceil(q / min(max_prefill_chunk, max_batch_tokens - background_min_tokens - d)) steps, however much
background work is queued.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import pytest

from cothink.scheduler.policy import (
    Admission,
    FairShares,
    Priority,
    PriorityClass,
    SchedulerConfig,
    encode_step_patch_blocks,
    interactive_decoding,
    plan_step,
)
from cothink.errors import InvalidParameterError
from support import ids, make_engine, until

INTERACTIVE, BACKGROUND = PriorityClass.INTERACTIVE, PriorityClass.BACKGROUND


# ---- plan_step, pure -------------------------------------------------------------------------------------
@dataclass(eq=False)
class Fake:
    name: str
    klass: PriorityClass = BACKGROUND
    decode: bool = False
    wanted: int = 1
    weight: float = 1.0
    seq: int = 0
    served: int = 0

    @property
    def priority(self) -> Priority:
        return Priority(self.klass, self.weight)

    @property
    def coroutine(self) -> str:
        return self.name

    @property
    def is_decode(self) -> bool:
        return self.decode

    def wanted_tokens(self) -> int:
        return 1 if self.decode else self.wanted


def _always(work, n) -> Admission:
    return Admission.ADMIT


def _plan(works, **cfg):
    return [(w.name, n) for w, n in plan_step(works, SchedulerConfig(**cfg), FairShares(), _always).chosen]


def _numbered(*works: Fake) -> list[Fake]:
    for i, w in enumerate(works):
        w.seq = i + 1
    return list(works)


def test_interactive_class_before_background():
    works = _numbered(Fake("bg-decode", BACKGROUND, decode=True), Fake("bg-pre", BACKGROUND, wanted=50),
                      Fake("int-pre", INTERACTIVE, wanted=50), Fake("int-decode", INTERACTIVE, decode=True))
    plan = _plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16,
                 interactive_step_tokens=256, interactive_background_chunk=128)
    assert [name for name, _ in plan] == ["int-decode", "int-pre", "bg-decode", "bg-pre"]
    assert dict(plan) == {"int-decode": 1, "int-pre": 50, "bg-decode": 1, "bg-pre": 50}


def test_background_shrinks_while_an_interactive_generation_decodes():
    """The latency rule: with an interactive decoder in the step, background work fills it only up to
    interactive_step_tokens in all (the background reserve shrinks to fit, but to no less than one)."""
    works = _numbered(Fake("int-decode", INTERACTIVE, decode=True), Fake("bg-pre", BACKGROUND, wanted=500),
                      Fake("bg-pre2", BACKGROUND, wanted=500))
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16,
                      interactive_step_tokens=32, interactive_background_chunk=128))
    assert plan == {"int-decode": 1, "bg-pre": 31} and sum(plan.values()) == 32
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=24,
                      interactive_step_tokens=8, interactive_background_chunk=128))
    assert plan == {"int-decode": 1, "bg-pre": 7}, "the cap holds the background reserve too"
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16,
                      interactive_step_tokens=1))
    assert plan == {"int-decode": 1, "bg-pre": 1}, "background never starves: at least one token a step"
    # an interactive prefill (a probe) beside the decoder is not capped: only background work shrinks
    works.append(Fake("int-pre", INTERACTIVE, wanted=100, seq=9))
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16,
                      interactive_step_tokens=32, interactive_background_chunk=128))
    assert plan["int-pre"] == 100 and plan["bg-pre"] == 16
    # without an interactive decoder, background prefill uses the whole budget
    plan = dict(_plan(works[1:3], max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16))
    assert plan == {"bg-pre": 128, "bg-pre2": 128}


def test_background_prefill_comes_in_single_tokens_while_an_interactive_generation_decodes():
    """By default a background prefill chunk is one token while an interactive generation decodes, so
    every item of such a step is a single token (the fused decode path's shape); the cap on the step
    still holds, and without an interactive decoder chunks are whole again."""
    works = _numbered(Fake("int-decode", INTERACTIVE, decode=True), Fake("bg-pre", BACKGROUND, wanted=500),
                      Fake("bg-pre2", BACKGROUND, wanted=500), Fake("bg-pre3", BACKGROUND, wanted=500),
                      Fake("bg-pre4", BACKGROUND, wanted=500))
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16))
    assert set(plan.values()) == {1} and sum(plan.values()) == SchedulerConfig().interactive_step_tokens
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, interactive_background_chunk=2))
    assert plan == {"int-decode": 1, "bg-pre": 2, "bg-pre2": 1}
    plan = dict(_plan(works[1:], max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16))
    assert plan == {"bg-pre": 128, "bg-pre2": 128}
    with pytest.raises(ValueError, match="interactive_background_chunk"):
        SchedulerConfig(interactive_background_chunk=0)


def test_encode_budget_shrinks_like_background_prefill():
    """A step's vision tower work: vision_step_patch_blocks; a background encode while an interactive
    generation decodes gets what background prefill may add to that step (interactive_step_tokens - 1
    tokens) in the decoder's multiply-adds, never above vision_step_patch_blocks; an interactive
    encode keeps the whole budget."""
    cfg = SchedulerConfig(max_prefill_chunk=128, interactive_step_tokens=4, vision_step_patch_blocks=2048)
    assert encode_step_patch_blocks(cfg, BACKGROUND, False, 0.5) == 2048
    assert encode_step_patch_blocks(cfg, BACKGROUND, True, 0.5) == 6  # 3 tokens, a patch-block is half one
    assert encode_step_patch_blocks(cfg, BACKGROUND, True, 4.0) == 0.75  # the tower runs at least a row
    assert encode_step_patch_blocks(cfg, INTERACTIVE, True, 0.5) == 2048
    tiny = SchedulerConfig(interactive_step_tokens=4, vision_step_patch_blocks=2)
    assert encode_step_patch_blocks(tiny, BACKGROUND, True, 0.5) == 2  # never above it
    one = SchedulerConfig(interactive_step_tokens=1)
    assert encode_step_patch_blocks(one, BACKGROUND, True, 1.0) == 1  # background never starves
    works = [Fake("bg", BACKGROUND, decode=True), Fake("int-pre", INTERACTIVE, wanted=5)]
    assert not interactive_decoding(works)
    assert interactive_decoding([*works, Fake("int", INTERACTIVE, decode=True)])
    with pytest.raises(ValueError):
        SchedulerConfig(vision_step_patch_blocks=0)


def test_fairness_is_per_coroutine_not_per_work():
    """A coroutine that keeps submitting short works gets the same share as one with one long work
    (per-work fairness would let every fresh short work, never served, go first)."""
    shares = FairShares()
    cfg = SchedulerConfig(max_batch_tokens=32, max_prefill_chunk=32, background_min_tokens=0)
    seq = iter(range(1, 10**6))
    long = Fake("long", BACKGROUND, wanted=10**9, seq=next(seq))
    shorts = [Fake("short", BACKGROUND, wanted=8, seq=next(seq)) for _ in range(4)]
    served = {"long": 0, "short": 0}
    windows = []
    for step in range(400):
        for work, n in plan_step([long, *shorts], cfg, shares, _always).chosen:
            shares.charge(work, n)
            served[work.coroutine] += n
            if work is not long:  # done in one step: the coroutine submits the next one at once
                shorts[shorts.index(work)] = Fake("short", BACKGROUND, wanted=8, seq=next(seq))
        if step % 50 == 49:
            windows.append(dict(served))
    assert served["long"] / served["short"] == pytest.approx(1, rel=0.05), served
    for a, b in zip(windows, windows[1:]):  # and over every window of 50 steps
        assert (b["long"] - a["long"]) / (b["short"] - a["short"]) == pytest.approx(1, rel=0.1), (a, b)


def test_decode_before_prefill_within_a_class():
    works = _numbered(Fake("pre", BACKGROUND, wanted=300), Fake("dec1", BACKGROUND, decode=True, served=500),
                      Fake("dec2", BACKGROUND, decode=True, served=900))
    plan = _plan(works, max_batch_tokens=64, max_prefill_chunk=128, background_min_tokens=0)
    # the decoders come first although the prefill was submitted first and has been served least
    assert plan == [("dec1", 1), ("dec2", 1), ("pre", 62)]


def test_budget_and_chunk_caps():
    works = _numbered(*(Fake(f"p{i}", BACKGROUND, wanted=1000) for i in range(5)))
    plan = _plan(works, max_batch_tokens=100, max_prefill_chunk=40, background_min_tokens=0)
    assert plan == [("p0", 40), ("p1", 40), ("p2", 20)]
    assert sum(n for _, n in plan) <= 100
    # a decode never takes more than one token; the budget bounds the number of decoders too
    decoders = _numbered(*(Fake(f"d{i}", BACKGROUND, decode=True) for i in range(10)))
    assert len(_plan(decoders, max_batch_tokens=7, background_min_tokens=0)) == 7


def test_item_cap():
    works = _numbered(*(Fake(f"d{i}", INTERACTIVE, decode=True) for i in range(10)),
                      Fake("bg", BACKGROUND, wanted=30))
    plan = _plan(works, max_batch_tokens=256, max_batch_items=4, background_min_tokens=16)
    assert [n for n, _ in plan] == ["d0", "d1", "d2", "d3"]


def test_background_adds_only_its_reserve_beside_an_interactive_prefill():
    """A step with an interactive prompt chunk and no interactive decoder: background prefill and decode
    tokens fill it only up to background_min_tokens (time to first token), where without the prompt
    they fill the budget; an interactive work that memory keeps waiting does not hold background back."""
    bg = [Fake(f"bg{i}", BACKGROUND, wanted=500) for i in range(3)] + [Fake("bgd", BACKGROUND, decode=True)]
    works = _numbered(Fake("prompt", INTERACTIVE, wanted=30), *bg)
    plan = dict(_plan(works, max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16))
    assert plan["prompt"] == 30 and sum(plan.values()) - 30 == 16
    plan = dict(_plan(works[1:], max_batch_tokens=256, max_prefill_chunk=128, background_min_tokens=16))
    assert sum(plan.values()) == 256
    choice = plan_step(works, SchedulerConfig(max_batch_tokens=256, max_prefill_chunk=128), FairShares(),
                       lambda w, n: Admission.WAIT if w.name == "prompt" else Admission.ADMIT)
    assert sum(n for _, n in choice.chosen) == 256


def test_a_lone_prompt_takes_wider_chunks():
    """The only runnable work, a prompt of either class, takes chunks of up to lone_prefill_chunk (past
    max_prefill_chunk and max_batch_tokens); beside any other work, a decoder included, it does not."""
    for klass in (INTERACTIVE, BACKGROUND):
        lone = _numbered(Fake("p", klass, wanted=2000))
        limits = {"max_batch_tokens": 256, "max_prefill_chunk": 128}
        assert _plan(lone, **limits) == [("p", 512)]
        assert _plan(lone, **limits, lone_prefill_chunk=1000) == [("p", 1000)]
        assert _plan(lone, **limits, lone_prefill_chunk=1) == [("p", 128)]
        short = _numbered(Fake("p", klass, wanted=300))
        assert _plan(short, **limits) == [("p", 300)]
        pair = _numbered(Fake("p", klass, wanted=2000), Fake("d", BACKGROUND, decode=True))
        assert dict(_plan(pair, **limits))["p"] == 128
    with pytest.raises(InvalidParameterError):
        SchedulerConfig(lone_prefill_chunk=0)


def test_background_reserve_and_interactive_room():
    works = _numbered(Fake("int", INTERACTIVE, wanted=1000), Fake("bg", BACKGROUND, wanted=1000))
    plan = dict(_plan(works, max_batch_tokens=64, max_prefill_chunk=64, background_min_tokens=16))
    assert plan == {"int": 48, "bg": 16}  # the interactive prefill leaves background_min_tokens
    # no background waiting: the interactive work may take the whole budget
    plan = dict(_plan(works[:1], max_batch_tokens=64, max_prefill_chunk=64, background_min_tokens=16,
                      lone_prefill_chunk=1))
    assert plan == {"int": 64}
    # background decoders count against the reserve
    works = _numbered(Fake("int", INTERACTIVE, wanted=1000), *(Fake(f"bgd{i}", BACKGROUND, decode=True)
                                                               for i in range(3)))
    plan = dict(_plan(works, max_batch_tokens=64, max_prefill_chunk=64, background_min_tokens=16))
    assert plan["int"] == 48 and sum(plan.values()) == 51


def test_fits_refusal_skips_only_that_work():
    works = _numbered(Fake("a", BACKGROUND, wanted=10), Fake("big", BACKGROUND, wanted=500),
                      Fake("c", BACKGROUND, decode=True))
    choice = plan_step(works, SchedulerConfig(background_min_tokens=0), FairShares(),
                       lambda w, n: Admission.WAIT if w.name == "big" else Admission.ADMIT)
    assert [(w.name, n) for w, n in choice.chosen] == [("c", 1), ("a", 10)] and not choice.refused
    choice = plan_step(works, SchedulerConfig(background_min_tokens=0), FairShares(),
                       lambda w, n: Admission.FAIL if w.name == "big" else Admission.ADMIT)
    assert [w.name for w in choice.refused] == ["big"], "a refusal is reported, not acted on"


def _simulate(works, steps, **cfg):
    shares = FairShares()
    for _ in range(steps):
        for work, n in plan_step(works, SchedulerConfig(**cfg), shares, _always).chosen:
            shares.charge(work, n)
            work.served += n
    return {w.name: w.served for w in works}


def test_weighted_fairness_decoders():
    """Two background decoders with weights 1 and 3, one item per step: service 1:3."""
    works = _numbered(Fake("w1", BACKGROUND, decode=True, weight=1),
                      Fake("w3", BACKGROUND, decode=True, weight=3))
    served = _simulate(works, 400, max_batch_items=1, background_min_tokens=0)
    assert abs(served["w1"] - 100) <= 2 and abs(served["w3"] - 300) <= 2, served


def test_weighted_fairness_prefills():
    """Two background prefills (weights 1 and 3) competing for one chunk per step: tokens 1:3."""
    works = _numbered(Fake("w1", BACKGROUND, wanted=10**9, weight=1),
                      Fake("w3", BACKGROUND, wanted=10**9, weight=3))
    served = _simulate(works, 400, max_batch_tokens=32, max_prefill_chunk=32, background_min_tokens=0)
    assert sum(served.values()) == 400 * 32
    assert served["w3"] / served["w1"] == pytest.approx(3, rel=0.02), served


def test_weights_within_interactive_class_too():
    works = _numbered(Fake("i1", INTERACTIVE, decode=True, weight=1),
                      Fake("i2", INTERACTIVE, decode=True, weight=2), Fake("bg", BACKGROUND, decode=True))
    served = _simulate(works, 300, max_batch_items=1, background_min_tokens=0)
    assert served["bg"] == 0  # strict class order when items, not tokens, are the constraint
    assert served["i2"] / served["i1"] == pytest.approx(2, rel=0.03), served


def test_priority_parsing():
    assert Priority.parse(None, INTERACTIVE) == Priority(INTERACTIVE)
    assert Priority.parse("background", INTERACTIVE).klass == BACKGROUND
    assert Priority.parse("INTERACTIVE", BACKGROUND).klass == INTERACTIVE
    with pytest.raises(ValueError):
        Priority.parse("urgent", BACKGROUND)
    with pytest.raises(ValueError):
        Priority(BACKGROUND, 0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch_tokens=16, background_min_tokens=16)


# ---- the engine: an interactive probe behind a 4k-token background prefill -----------------------------
LIMITS = dict(max_batch_tokens=64, max_prefill_chunk=64, background_min_tokens=16, max_batch_items=64)


def _bound(q: int, d: int) -> int:
    """The policy docstring's bound for an interactive item of q tokens behind d interactive decoders."""
    room = LIMITS["max_batch_tokens"] - LIMITS["background_min_tokens"] - d
    return math.ceil(q / min(LIMITS["max_prefill_chunk"], room))


@pytest.mark.parametrize("decoders", [0, 3])
async def test_probe_within_bound_behind_4k_background_prefill(decoders):
    engine = make_engine("llama", kv_tokens=8192 + 1024, page_size=16, **LIMITS)
    assert engine.runner.max_context >= 8192
    q = 100
    at: dict[tuple[str, str], int] = {}  # (event, coroutine) -> engine.steps when it happened
    running: dict[str, bool] = {}  # coroutine -> a step was running when it was submitted

    def listen(ev) -> None:
        at.setdefault((ev.event, ev.coroutine), engine.steps)
        running.setdefault(ev.coroutine, engine.occupancy().in_flight > 0)

    engine.work_listeners.append(listen)
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(20, 1))
        big = engine.block("big")
        background = asyncio.create_task(engine.extend(big, token_ids=ids(4096, 2), name="bg"))
        gens = []
        for j in range(decoders):
            out = engine.block(f"i{j}")
            gens.append(engine.generate([ctx, out], max_tokens=10_000, priority="interactive", name=f"i{j}"))
        await until(lambda: engine.steps >= 4)
        probs = await asyncio.wait_for(engine.probe([ctx], ids(q, 3), (" yes", " no"), name="probe"), 60)
        for g in gens:
            g.cancel()
        await asyncio.wait_for(background, 120)
    assert set(probs) == {" yes", " no"} and sum(probs.values()) == pytest.approx(1.0)
    assert len(big) == 4096, "the background prefill completes"

    steps = {r.index: r for r in engine.timeline}
    probe_steps = [i for i, r in steps.items() if any(it.coroutine == "probe" for it in r.items)]
    bound = _bound(q, decoders)
    # The step running when the probe was submitted (in the worker thread) was planned without it:
    # "submitted" is the last step the probe could not be part of.
    submitted = at["submit", "probe"] + running["probe"]
    assert len(probe_steps) >= 2, "the bound should be exercised over several steps"
    assert any(it.coroutine == "bg" for i, r in steps.items() if i > probe_steps[-1] for it in r.items), \
        "the background prefill was still running when the probe finished"
    assert probe_steps[0] == submitted + 1, "the probe is served in the very next step"
    assert probe_steps == list(range(submitted + 1, probe_steps[-1] + 1)), "and in every step until done"
    assert at["finish", "probe"] - submitted <= bound, (at["finish", "probe"] - submitted, bound)
    assert at["finish", "probe"] == probe_steps[-1]
    # while the probe was served, the background prefill kept progressing by its reserve:
    # background_min_tokens, or while interactive generations decode, what the step cap leaves
    # (interactive_step_tokens - 1, default 3; at least one token) in chunks of at most
    # interactive_background_chunk tokens (default 1)
    default = SchedulerConfig()
    reserve = LIMITS["background_min_tokens"] if not decoders else min(
        LIMITS["background_min_tokens"], default.interactive_step_tokens - 1,
        default.interactive_background_chunk)
    for i in range(submitted + 1, probe_steps[-1] + 1):
        bg = [it.tokens for it in steps[i].items if it.coroutine == "bg"]
        assert bg and bg[0] >= reserve, (i, steps[i].items)
        assert steps[i].tokens <= LIMITS["max_batch_tokens"]
        assert sum(1 for it in steps[i].items if it.coroutine.startswith("i")) == decoders


async def test_weighted_background_generations_through_the_engine():
    """Two background generations with weights 1 and 3, one item per step: forward passes 1:3."""
    engine = make_engine("llama", max_batch_items=1)
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(10, 4))
        w1 = engine.generate([ctx, engine.block("o1")], max_tokens=1000, name="w1",
                             priority=Priority(BACKGROUND, 1))
        w3 = engine.generate([ctx, engine.block("o3")], max_tokens=1000, name="w3",
                             priority=Priority(BACKGROUND, 3))
        start = engine.steps
        await until(lambda: engine.steps >= start + 80)
        w1.cancel()
        w3.cancel()
    a, b = engine.stats["w1"].forward_passes, engine.stats["w3"].forward_passes
    assert abs(b - 3 * a) <= 4 and a + b >= 80, (a, b)


async def test_work_started_by_tasks_a_step_woke_joins_the_next_step():
    """A coroutine that reacts to a result by starting several requests in new tasks (asyncio.gather of
    probes) gets them into the very next step, even while background work keeps the loop busy."""
    engine = make_engine("llama")
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(32, 1))
        background = engine.generate([ctx, engine.block("bg")], max_tokens=400, stop_at_eos=False, name="bg")

        async def probe(seed: int) -> int:
            await engine.probe([ctx], ids(4, seed), (" yes", " no"), name=f"p{seed}")
            return engine.steps

        for seed in range(3):
            await probe(100 + seed)
            woke_at = engine.steps
            done = await asyncio.gather(probe(2 * seed), probe(2 * seed + 1))
            assert done == [woke_at + 1] * 2  # one step each, the step right after the wake-up
        background.cancel()


def test_sampling_reads_a_steps_consecutive_logits_rows_in_place():
    """The batched sampling stage takes consecutive rows of one step's logits as a view of them (no
    copy), and any other rows (another order, another tensor) as a stacked copy: the same values."""
    import torch

    from cothink.scheduler.scheduler import _stacked

    step = torch.randn(5, 7)
    rows = [step[i] for i in range(1, 4)]
    view = _stacked(rows)
    assert view.data_ptr() == step[1].data_ptr() and torch.equal(view, step[1:4])
    other = torch.randn(2, 7)
    for mixed in ([step[2], step[1]], [step[0], step[2]], [step[4], other[0]], [step[0, :6], step[1, :6]]):
        copy = _stacked(mixed)
        assert torch.equal(copy, torch.stack(mixed)) and copy.data_ptr() != mixed[0].data_ptr()


async def test_off_loop_hands_back_results_and_lets_a_cancelled_step_finish():
    """The step's compute leaves the event loop through `_off_loop`: its result or exception comes back,
    and when the awaiting task is cancelled (the engine stopping) the CancelledError only goes on once
    the job has finished, so nothing the running forward reads is released under it."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from cothink.scheduler.scheduler import _off_loop

    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as executor:
        assert await _off_loop(loop, executor, lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await _off_loop(loop, executor, lambda: 1 / 0)

        started, finished = threading.Event(), threading.Event()

        def long_job() -> str:
            started.set()
            time.sleep(0.2)
            finished.set()
            return "done"

        task = asyncio.ensure_future(_off_loop(loop, executor, long_job))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()  # not raised before the job's end


async def test_short_fused_steps_run_on_the_event_loop(monkeypatch):
    """A step of the fused C decode path whose width took at most `INLINE_STEP_S` lately runs its
    forward on the event-loop thread: its torch ops on one thread (no second OpenMP pool), the C
    kernels on the step's chosen count. Other steps (prefill, or any step with the bound at 0) run on
    the compute thread. The tokens are the same either way."""
    import threading

    import torch

    from cothink.ops import native
    from cothink.scheduler import scheduler as S

    if not native.available():
        pytest.skip("the fused decode path needs cothink's C kernels")
    loop_thread = threading.current_thread().name

    async def run(bound: float) -> tuple[list[int], list[tuple[str, str, int, int]]]:
        monkeypatch.setattr(S, "INLINE_STEP_S", bound)
        engine = make_engine("llama", threads=2)
        seen, forward = [], engine.runner.forward

        def spy(batch):
            thread = threading.current_thread().name
            seen.append((batch.path, thread, torch.get_num_threads(), native._threads()))
            return forward(batch)

        engine.runner.forward = spy
        async with engine:
            ctx = engine.block("ctx")
            await engine.extend(ctx, token_ids=ids(24, 3))
            gen = engine.generate([ctx, engine.block("out")], max_tokens=24, stop_at_eos=False)
            result = await gen.collect()
        records = [r for r in engine.timeline if r.path]
        assert [r.path for r in records] == [s[0] for s in seen]
        assert all(s[3] == r.threads for s, r in zip(seen, records) if s[1] == loop_thread)
        return result.token_ids, seen

    tokens, seen = await run(1.0)
    on_loop = [s for s in seen if s[1] == loop_thread]
    assert on_loop and all(path == "fused" and torch_threads == 1 for path, _, torch_threads, _ in on_loop)
    # the first steps of a width wait for its figure; prefill chunks never run on the loop
    assert seen[-1][1] == loop_thread and all(s[1] != loop_thread for s in seen if s[0] != "fused")
    off_tokens, off_seen = await run(0.0)
    assert off_tokens == tokens and off_seen and all(s[1] != loop_thread for s in off_seen)
