"""StrategistActor's async rule on a tiny random Qwen3.5 hybrid: the actor follows the latest plan, a fit
probe in the same forward pass checks it, and when the plan no longer fits the actor exits it early (the
strategist is told to replan) and acts on its own judgement, never waiting for the strategist.

The fit probe's answer is forced by the threshold (``early_exit``: 0 = the plan always fits, above 1 = it
never does), so the mechanics are checked whatever the random model says.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import cothink
from cothink.agents import StrategistActor


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("strategist") / "hybrid", hybrid=True, seed=5)


class PassCountingCorridor:
    """Walk from 0 to the goal; records, per tick, the engine passes (``engine.step_listeners``) that
    started after the observation was read and ended before its action came, and how many of them did
    not carry the actor's work (a pass already running at the observation is not counted). It can also
    ask the agent to replan at a given tick."""

    def __init__(self, engine, actor: str, observation: str = "", replan_at: int | None = None):
        self.position, self.done = 0, False
        self.actor = actor
        self.observation = observation
        self.replan_at, self.agent, self.ticks = replan_at, None, 0
        self.replanned_at: int | None = None
        self.plans_seen: list[int] = []  # per tick: plans the strategist had completed at the observation
        self.observed_at: float | None = None
        self.passes: list[int] = []  # per tick: passes between the observation and the action
        self.without_actor: list[int] = []  # per tick: of those, passes the actor had no work in
        engine.step_listeners.append(self._on_step)

    def _on_step(self, record) -> None:
        if self.observed_at is None or record.start < self.observed_at:
            return
        self.passes[-1] += 1
        self.without_actor[-1] += not any(i.coroutine == self.actor for i in record.items)

    async def observe(self) -> str:
        await asyncio.sleep(0.005)  # the strategist gets passes of its own between ticks
        if self._replan_now():
            self.agent.replan(self.ticks)
            self.replanned_at = self.ticks
        self.plans_seen.append(len(self.agent.plans) if self.agent is not None else 0)
        self.ticks += 1
        self.passes.append(0)
        self.without_actor.append(0)
        self.observed_at = time.perf_counter()
        return self.observation or f"position {self.position}, goal at 100"

    def _replan_now(self) -> bool:
        """Replan once, at the first tick from `replan_at` on where the strategist is still writing the
        plan it was writing at the previous tick's observation (no plan completed since): that plan reads
        older observations only, so the replan must abandon it. (Replanning at a fixed tick raced the
        strategist: a plan that ended early left a new one started from the newest observations.)"""
        if self.agent is None or self.replan_at is None or self.replanned_at is not None:
            return False
        # from tick 2: at tick 0 the window was empty, so the strategist had not begun a plan
        return self.ticks >= max(self.replan_at, 2) and self.plans_seen[-1] == len(self.agent.plans)

    async def act(self, action: str) -> float:
        self.observed_at = None
        self.position += action == "forward"
        return 1.0 if action == "forward" else -0.1


def _play(folder: Path, *, ticks: int, plan_tokens: int = 3, replan_at: int | None = None, **kw):
    async def main():
        async with cothink.Engine.from_pretrained(folder, kv_tokens=8192) as engine:
            agent = StrategistActor(
                engine,
                task="Reach the goal.",
                actions=["left", "right", "forward"],
                plan_tokens=plan_tokens,
                window_tokens=96,
                chunk_tokens=32,
                name="sa",
                **kw,
            )
            env = PassCountingCorridor(engine, "sa.actor", replan_at=replan_at)
            env.agent = agent
            result = await agent.run(env, ticks=ticks)
            loop = asyncio.get_running_loop()
            end = loop.time() + 5
            while engine.memory().live_blocks and loop.time() < end:
                await asyncio.sleep(0.01)
            return result, env, engine.memory().live_blocks

    return asyncio.run(main())


def _never_waited(result, env) -> None:
    # every engine pass between an observation and its action carried the actor's own work
    assert len(env.passes) == len(result.actions) and not any(env.without_actor)
    assert env.passes == [a.forward_passes for a in result.actions]


def test_actor_follows_a_plan_that_fits(hybrid_dir):
    result, env, live = _play(hybrid_dir, ticks=14, early_exit=0.0)
    assert live == 0 and not result.replans and result.abandoned_plans == 0
    assert not any(a.replanned for a in result.actions) and all(a.early_exit for a in result.actions)
    followed = [a for a in result.actions if a.plan >= 0]
    assert followed, "no tick read a plan: the strategist never completed one"
    assert all(a.plan_fit is not None and 0 <= a.plan_fit <= 1 for a in followed)
    assert all(a.plan_fit is None for a in result.actions if a.plan < 0)
    # the fit question and the plan's action are one probe: a tick with a plan costs no more passes
    without = max(a.forward_passes for a in result.actions if a.plan < 0)
    assert max(a.forward_passes for a in followed) <= without
    _never_waited(result, env)


def test_plan_that_no_longer_fits_makes_the_strategist_replan(hybrid_dir):
    result, env, live = _play(hybrid_dir, ticks=14, early_exit=1.01)
    assert live == 0
    with_plan = [a for a in result.actions if a.plan >= 0]
    assert with_plan, "no tick read a plan: the strategist never completed one"
    # every plan in view was rejected: the actor exited it, asked for a replan and acted on its own
    # judgement (a second probe, without the plan)
    assert all(a.replanned and a.plan_fit is not None and not a.early_exit for a in with_plan)
    assert [(r.tick, r.plan) for r in result.replans] == [(a.tick, a.plan) for a in with_plan]
    assert [e.text for e in result.events if e.kind == "plan" and e.coroutine == "sa.actor"] == [
        f"replan at t={a.tick}" for a in with_plan
    ]
    # a dropped plan is never read again: the next plan in view is a newer one
    assert all(b.plan > a.plan for a, b in zip(with_plan, with_plan[1:]))
    # the strategist started over after each replan (plans read later are newer ones); the actor never
    # waited for them (below)
    assert len(result.plans) > with_plan[-1].plan >= len(with_plan) - 1
    assert result.strategist_forward_passes > 0
    _never_waited(result, env)


def test_replan_hook_abandons_a_plan_from_older_observations(hybrid_dir):
    """A plan being written from older observations is abandoned on a replan and restarted; the actor
    keeps acting meanwhile (the strategist writes long plans; the hook is called from tick 3 on, while a
    plan from older observations is being written)."""
    result, env, live = _play(hybrid_dir, ticks=14, plan_tokens=400, early_exit=0.0, replan_at=3)
    assert env.replanned_at is not None, "the strategist completed a plan between every two ticks"
    assert live == 0 and len(result.replans) == 1 and result.replans[0].tick == env.replanned_at >= 3
    assert result.abandoned_plans >= 1
    assert len(result.actions) == 14
    _never_waited(result, env)


@pytest.mark.parametrize("mode", ["probe-only", "sequential", "async"])
def test_observation_is_prefilled_once(mode, hybrid_dir):
    """The tick writes the observation into the window; the actor's questions name it ([t=N]) instead
    of repeating it, so each tick prefills a long observation once, not twice."""
    observation = "wall " * 150

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=16384) as engine:
            agent = StrategistActor(
                engine, task="Reach the goal.", actions=["left", "right", "forward"], mode=mode,
                think_tokens=2, plan_tokens=2, window_tokens=4096, chunk_tokens=2048, name="once",
            )
            env = PassCountingCorridor(engine, "once.actor", observation=observation)
            ctx_tokens = len(agent.chat.encode(agent.chat.conversation(
                [{"role": "system", "content": agent.system}, {"role": "user", "content": agent.task}])))
            await agent.run(env, ticks=3)
            return engine.stats["once.actor"].tokens_written - ctx_tokens, len(agent.chat.encode(observation))

    per_run, obs_tokens = asyncio.run(main())
    assert 3 * obs_tokens <= per_run < 3 * obs_tokens * 1.5
