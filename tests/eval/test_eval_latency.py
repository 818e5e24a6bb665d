"""The latency suite's verdicts: it fails on a scheduler that ignores priorities and passes on the real one;
streamed input, scripted workloads and the throughput knee."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from cothink.eval import models
from cothink.eval.common import FAIL, INFO, PASS, SuiteContext
from cothink.eval.script import load_script, run_script
from cothink.eval.streamed import StreamPlan, run_streamed, utterance_pieces
from cothink.eval.suites import latency
from cothink.scheduler import policy
from cothink.scheduler.policy import Priority, PriorityClass, StepChoice

SERVICE_CHECK = (
    "while the interactive foreground decodes, every step carries at most interactive_step_tokens "
    "tokens in all, background work included (priority order of service)"
)

SCRIPT = """\
name: barge-in
events:
  - {at: 0.0, op: start, coroutine: thinker, text: "Plan the maintenance of the pumps.", chat: true}
  - {at: 0.0, op: generate, coroutine: thinker, max_tokens: 24, priority: background}
  - {at: 0.05, op: start, coroutine: user, text: "Wait, the boiler first."}
  - {at: 0.1, op: probe, coroutine: user, reads: [thinker, user], question: " Is it urgent?"}
  - {at: 0.15, op: extend, coroutine: user, text: " It is leaking."}
  - {at: 0.2, op: generate, coroutine: user, reads: [thinker, user], max_tokens: 6, priority: interactive}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return models.load(str(models.build_tiny_model(tmp_path_factory.mktemp("tiny-latency"))))


@pytest.fixture
def ctx(tiny, tmp_path):
    return SuiteContext(tiny, True, tmp_path)


@dataclasses.dataclass(frozen=True)
class _Unclassed:
    """A work as a priority-blind policy sees it: in the background class (its weight kept)."""

    work: Any

    @property
    def coroutine(self) -> str:
        return self.work.coroutine

    @property
    def priority(self) -> Priority:
        return Priority(PriorityClass.BACKGROUND, self.work.priority.weight)

    @property
    def seq(self) -> int:
        return self.work.seq

    @property
    def is_decode(self) -> bool:
        return self.work.is_decode

    def wanted_tokens(self) -> int:
        return self.work.wanted_tokens()


def priority_blind_plan_step(works, cfg, shares, admit) -> StepChoice:
    """The engine's policy with priority classes ignored: every work is planned as background work
    (no interactive step cap, no class order); batching, budgets and admission unchanged."""
    seen = [_Unclassed(w) for w in works]
    choice = policy.plan_step(seen, cfg, shares, lambda s, n: admit(s.work, n))
    return StepChoice([(s.work, n) for s, n in choice.chosen], [s.work for s in choice.refused])


def _plan(script: str | None = None) -> latency.LatencyPlan:
    # enough requests and tokens that every percentile the suite compares has its samples (p99: 200 gaps)
    return dataclasses.replace(
        latency.plan(True),
        background=(0, 4),
        requests=10,
        fg_tokens=24,
        bg_prompt=24,
        bg_tokens=8,
        gap_s=0.0,
        stream=StreamPlan(utterances=2, words=4, piece_s=0.01, answer_tokens=2, thinker_tokens=8),
        script=script,
    )


def _by_name(res):
    return {c.name: c for c in res.checks}


def test_latency_suite_fails_when_the_scheduler_ignores_priorities(ctx):
    # every engine the suite makes takes the priority-blind policy (EngineLimits.policy)
    handle = dataclasses.replace(ctx.model, limits={"policy": priority_blind_plan_step})
    blind = dataclasses.replace(ctx, model=handle)
    res = asyncio.run(latency.run(blind, dataclasses.replace(_plan(), stream=None)))
    checks = _by_name(res)
    assert res.status == FAIL
    assert checks[SERVICE_CHECK].status == FAIL and not checks[SERVICE_CHECK].timing
    fair = next(r for r in res.records if r.get("mode") == "fair" and r["background"] == 4)
    assert fair["service"]["over_cap"] > 0
    # the requests themselves were all answered: the failure is the order of service, nothing else
    assert (
        checks["every foreground request completed with all its tokens (no starvation, no deadlock)"].status
        == PASS
    )


def test_latency_suite_passes_its_property_checks_with_the_real_scheduler(ctx, tmp_path):
    script = tmp_path / "workload.yaml"
    script.write_text(SCRIPT)
    res = asyncio.run(latency.run(ctx, _plan(str(script))))
    checks = _by_name(res)
    # every verdict that does not compare times holds: priorities, completion, streamed input, the script
    properties = {c.name: c.status for c in res.checks if not c.timing and c.status != INFO}
    assert properties and set(properties.values()) == {PASS}, properties
    assert checks[SERVICE_CHECK].status == PASS
    assert "every scripted event finished without an error" in properties
    assert any(n.startswith("streamed input: the block holds") for n in properties)
    fair = next(r for r in res.records if r.get("mode") == "fair" and r["background"] == 4)
    assert fair["service"]["over_cap"] == 0 and fair["service"]["shared_steps"] > 0
    assert fair["itl_n"] >= 200 and fair["ttft_n"] == 10
    # the one-class control shows the cap is not met by accident: the same workload exceeds it
    one_class = next(r for r in res.records if r.get("mode") == "one-class")
    assert one_class["service"]["over_cap"] > 0
    assert any(t.title.startswith("Throughput ramp") for t in res.tables)
    assert "knee_concurrency" in res.headline


def test_percentiles_without_enough_samples_are_not_a_pass(ctx):
    p = dataclasses.replace(_plan(), requests=2, fg_tokens=6, stream=None)
    res = asyncio.run(latency.run(ctx, p))
    itl = next(c for c in res.checks if "inter-token p99" in c.name)
    assert itl.status == FAIL and "insufficient samples" in itl.detail
    for r in res.records:
        assert r["ttft_n"] == 2 and r["itl_n"] == 10
        assert r["ttft_p50"] != r["ttft_p50"] and r["itl_p99"] != r["itl_p99"]  # NaN: not reported


def test_streamed_input_absorbs_every_piece_in_order(tiny):
    p = StreamPlan(utterances=2, words=6, piece_s=0.005, answer_tokens=2, thinker_tokens=8)
    rows = asyncio.run(run_streamed(tiny, p, seed=3))
    assert len(rows) == 2
    for r in rows:
        assert r.error == "" and r.absorbed_in_order
        assert 1 <= r.appends <= r.pieces and r.absorb_steps >= 1
        assert 1 <= r.tokens_per_step_max <= r.piece_tokens
        assert r.last_piece_to_answer_s > 0


def test_utterance_pieces_are_half_words():
    import random

    from cothink.eval.workload import filler_words

    pieces = utterance_pieces(random.Random(0), 8)
    words = filler_words(random.Random(0), 8).split()
    assert "".join(pieces) == " " + " ".join(words)  # nothing lost, nothing added, in order
    assert len(pieces) == sum(2 if len(w) > 3 else 1 for w in words)


def test_script_runs_every_event(tiny, tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(SCRIPT)
    script = load_script(path)

    async def go():
        engine = tiny.engine(kv_tokens=2048)
        async with engine:
            return await run_script(tiny, engine, script)

    events = asyncio.run(go())
    assert [e.op for e in events] == [e.op for e in script.events]
    assert all(e.outcome == "ok" for e in events), events
    assert events[1].tokens == 24 and events[1].first_s is not None
    assert events[3].answer in (" yes", " no")
    assert events[5].tokens == 6


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"events": [{"at": 0, "op": "jump", "coroutine": "a"}]}', "events.0.op"),
        (
            '{"events": [{"at": 0, "op": "start", "coroutine": "a"}, '
            '{"at": 0, "op": "extend", "coroutine": "a"}]}',
            "needs a non-empty 'text'",
        ),
        ('{"events": [{"at": 0, "op": "generate", "coroutine": "a"}]}', "'a' is never started"),
        (
            '{"events": [{"at": 1, "op": "start", "coroutine": "a"}, '
            '{"at": 0, "op": "generate", "coroutine": "a"}]}',
            "before its start",
        ),
        ('{"events": []}', "events"),
        ('{"events": [{"at": -1, "op": "start", "coroutine": "a"}]}', "events.0.at"),
        ("{not json", "not valid json"),
    ],
)
def test_script_errors_name_the_problem(tmp_path, text, message):
    from cothink.errors import InvalidParameterError

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidParameterError, match=message):
        load_script(path)
