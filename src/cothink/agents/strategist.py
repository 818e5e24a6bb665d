"""Strategist and actor: a slow strategist writes plans into a block; a fast actor reads
[context, recent observations, plan] and emits one action per tick, never waiting for the strategist.

Coroutines (engine names ``<name>.strategist`` / ``<name>.actor``, or bare when ``name=""``):

- **strategist** (background priority): over and over, writes a short plan into a fresh plan block while
  reading ``[ctx, *observation window, plan]``; when a plan is complete it becomes the current one (the
  previous plan block is released). It never blocks the actor: a tick reads whichever plan is current.
  On a replan request (:meth:`StrategistActor.replan`) it abandons a plan it started before the newest
  observation and starts again from the newest observations.
- **actor** (interactive priority): per tick, appends the observation to the bounded observation window.
  By default it follows the current plan: one probe over ``[ctx, *window, plan]`` asks what the plan says
  to do now, with ``stop`` (the plan no longer fits the newest observation) and the actions as choices
  (one forward pass for single-token choices): P(fits) = 1 - P(stop), and the plan's action is the best
  action. ``stop`` is lowercase like the actions: a capitalised exit word wins on case alone. Early exit: when
  P(fits) is below ``early_exit`` the actor exits the plan: the plan is dropped, the strategist is told to
  replan (:meth:`StrategistActor.replan`), and the actor acts on its own judgement, an action probe over
  ``[ctx, *window]`` (one more pass). Before the first plan exists, or after a drop until the new plan is
  complete, it acts on its own judgement at once. It never awaits the strategist.

Modes (the paper's baselines use the same classes): ``"async"`` (the above), ``"probe-only"`` (no
strategist, no reasoning: one probe per tick), ``"sequential"`` (no strategist; every tick probes, writes
``think_tokens`` of reasoning in a scratch block, and chooses after the reasoning).

The observation is written once, into the window (``[t=<tick>] <observation>``); the questions name the
tick instead of repeating it, so nothing is prefilled twice.

The environment is anything with ``async observe() -> str`` and ``async act(action) -> float`` (the
reward) and a ``done`` attribute; see :class:`Environment`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from cothink.agents.base import Agent, AgentEvent, DeferredRelease, ObservationWindow, stop_background

Mode = Literal["async", "probe-only", "sequential"]
NO_FIT = "stop"  # the fit probe's answer that the plan no longer fits (besides the actions)


class Environment(Protocol):
    done: bool

    async def observe(self) -> str: ...

    async def act(self, action: str) -> float: ...


@dataclass(frozen=True)
class ActionRecord:
    tick: int
    action: str
    probability: float  # of the chosen action at the decision
    early_exit: bool  # decided on the first forward pass after the observation (no reasoning)
    plan: int  # index (into ``plans``) of the plan in the actor's view (-1: none)
    reward: float
    forward_passes: int  # the actor's forward passes for this tick
    seconds: float  # observation -> action
    plan_fit: float | None = None  # async: P(the plan still fits) from the fit probe (None: no plan)
    replanned: bool = False  # async: the plan no longer fit: dropped, replan asked, own judgement taken


@dataclass(frozen=True)
class Replan:
    """One early exit from a plan: at `tick` the actor's fit probe gave `fit` for plan `plan`."""

    tick: int
    plan: int
    fit: float | None
    forward_passes: int  # the actor's passes so far (engine.stats) when it asked


@dataclass
class StrategistActorResult:
    actions: list[ActionRecord]
    plans: list[str]
    total_reward: float
    events: list[AgentEvent] = field(default_factory=list)
    strategist_forward_passes: int = 0
    actor_forward_passes: int = 0
    replans: list[Replan] = field(default_factory=list)
    abandoned_plans: int = 0  # plans the strategist stopped writing on a replan (older observations)


@dataclass(frozen=True)
class _Decision:
    action: str
    probability: float
    early_exit: bool
    plan: int = -1
    plan_fit: float | None = None
    replanned: bool = False


class StrategistActor(Agent):
    """Constructor:

    - ``engine``: a running ``cothink.Engine``; ``task``: what the agent is for (goes into ctx);
    - ``actions``: the action names the actor chooses among (probe choices, tokenized exactly as
      given, right after the assistant's answer opener);
    - ``mode``: "async" | "probe-only" | "sequential";
    - ``early_exit`` (async): the actor exits the plan when the fit probe's P(the plan still fits) is
      below this (0: always follow the plan; above 1: never);
    - ``think_tokens`` (sequential): reasoning tokens per tick; ``plan_tokens``: tokens per plan;
    - ``window_tokens`` / ``chunk_tokens``: the observation window's bound;
    - ``system``: the system prompt; ``name``: coroutine name prefix; ``on_event``: event callback.
    """

    def __init__(
        self,
        engine: Any,
        *,
        task: str,
        actions: Sequence[str],
        mode: Mode = "async",
        early_exit: float = 0.5,
        think_tokens: int = 16,
        plan_tokens: int = 48,
        window_tokens: int = 512,
        chunk_tokens: int = 128,
        system: str | None = None,
        name: str = "",
        on_event: Callable[[AgentEvent], None] | None = None,
        seed: int = 0,
    ):
        super().__init__(engine, name=name, on_event=on_event)
        if len(set(actions)) != len(actions) or not actions:
            raise ValueError("actions must be distinct and non-empty")
        if mode == "async" and NO_FIT in actions:
            raise ValueError(f"{NO_FIT!r} is the fit probe's answer: it cannot be an action")
        self.task = task
        self.actions = tuple(actions)
        self.mode = mode
        self.early_exit = early_exit
        self.think_tokens = think_tokens
        self.plan_tokens = plan_tokens
        self.window_tokens = window_tokens
        self.chunk_tokens = chunk_tokens
        self.system = system or "You control an agent in an environment. Be brief."
        self.seed = seed
        self.plans: list[str] = []
        self.replans: list[Replan] = []
        self.abandoned_plans = 0
        self._plan_block: Any = None
        self._plan_index = -1
        # plans replaced while the actor decides on them: released when its decision is done
        self._plans = DeferredRelease(engine)
        self._window: ObservationWindow | None = None
        # a plan the strategist started before this many observations were in the window is abandoned
        self._replan_from = 0

    # ------------------------------------------------------------------------------------ questions

    def _action_question(self, tick: int) -> str:
        # the observation is already in the window as "[t=<tick>] ...": name it, do not repeat it
        return f"Which action now, for [t={tick}]? Answer one of: {', '.join(self.actions)}."

    def _fit_question(self, tick: int) -> str:
        return (
            f"What does your plan say to do now, at [t={tick}]? Answer {', '.join(self.actions)}, "
            f"or {NO_FIT} if the plan no longer fits what you see."
        )

    # ------------------------------------------------------------------------------------ replan hook

    def _retire(self, block: Any) -> None:
        self._plans.drop(block)

    def replan(self, tick: int = -1, fit: float | None = None, plan: int | None = None) -> None:
        """Drop the current plan and have the strategist start a new one from the newest observations
        (a plan it is writing from older ones is abandoned). Never waits: the next ticks act without a
        plan until the new one is complete. `plan`: the index of the plan found wanting; when a newer
        plan has replaced it meanwhile (the strategist finished one while the actor was judging the
        old), the newer one was never judged and stays."""
        judged = self._plan_index if plan is None else plan
        self.replans.append(Replan(tick, judged, fit, self.forward_passes("actor")))
        if self._plan_block is not None and self._plan_index == judged:
            self._retire(self._plan_block)
            self._plan_block, self._plan_index = None, -1
        if self._window is not None:
            self._replan_from = self._window.appended
        self.emit("plan", "actor", f"replan at t={tick}", value=fit)

    # ------------------------------------------------------------------------------------ coroutines

    async def _strategist(self, ctx: Any, window: ObservationWindow, stop: asyncio.Event) -> None:
        engine, name = self.engine, self.coroutine("strategist")
        instruction = (
            self.chat.question(
                "Given the task and the observations so far, write a short plan (one sentence)."
            )
            + "Plan:"
        )
        while not stop.is_set():
            if not window.blocks:
                await asyncio.sleep(0.01)
                continue
            block = engine.block(f"{name}-plan-{len(self.plans)}-{self.abandoned_plans}")
            started = window.appended  # observations this plan reads

            def outdated() -> bool:
                return self._replan_from > started

            gen = None
            text = ""
            try:
                # pinned: the actor may drop old observation chunks while the instruction is prefilled
                with window.pinned() as observed:
                    view = [ctx, *observed, block]
                    await engine.extend(block, instruction, view=view, name=name, priority="background")
                    if not outdated():
                        gen = engine.generate(
                            view,
                            max_tokens=self.plan_tokens,
                            stop=["\n"],
                            name=name,
                            priority="background",
                            seed=self.seed,
                        )
                if gen is not None:
                    async for piece in gen:
                        text += piece.text
                        if stop.is_set() or outdated():
                            gen.cancel()
                            break
            except BaseException:
                engine.release(block)
                raise
            if stop.is_set() and not text.strip():
                engine.release(block)
                return
            if outdated():  # a replan came after this plan began: start over from the newest observations
                engine.release(block)
                self.abandoned_plans += 1
                continue
            old, self._plan_block = self._plan_block, block
            if old is not None:
                self._retire(old)
            self.plans.append(text.strip())
            self._plan_index = len(self.plans) - 1
            tokens = len(gen.result.token_ids) if gen is not None and gen.result else 0
            self.emit("plan", "strategist", text.strip(), tokens=tokens)

    async def _probe_action(self, view: list[Any], tick: int) -> dict[str, float]:
        return await self.engine.probe(
            view,
            self.chat.question(self._action_question(tick)),
            choices=self.actions,
            name=self.coroutine("actor"),
            priority="interactive",
        )

    async def _follow_or_exit(self, own_view: list[Any], tick: int) -> _Decision:
        """Async mode: follow the current plan unless the actor's probe says it no longer fits."""
        plan, plan_index = self._plan_block, self._plan_index
        if plan is not None:
            # one probe, one forward pass: "stop" (the plan no longer fits) or the action the plan calls for.
            # Not a Yes/No probe beside an action probe: probes awaited together run in tasks that start
            # after the engine has planned its next step, so they would cost the actor a pass of waiting.
            probs = await self.engine.probe(
                [*own_view, plan],
                self.chat.question(self._fit_question(tick)),
                choices=(NO_FIT, *self.actions),
                name=self.coroutine("actor"),
                priority="interactive",
            )
            p_fit = 1.0 - float(probs.pop(NO_FIT))
            self.emit("probe", "actor", f"plan {plan_index} fits", value=p_fit)
            if p_fit >= self.early_exit:
                best = max(probs, key=probs.get)
                p = probs[best] / p_fit if p_fit > 0 else 0.0  # renormalised over the actions
                self.emit("probe", "actor", best, value=p)
                return _Decision(best, p, True, plan_index, p_fit)
            # early exit: the plan no longer fits; drop it, have a new one started, act on own judgement
            self.replan(tick, p_fit, plan_index)
        probs = await self._probe_action(own_view, tick)
        best = max(probs, key=probs.get)
        self.emit("probe", "actor", best, value=probs[best])
        if plan is None:  # nothing to follow yet (or the plan was dropped): own judgement at once
            return _Decision(best, probs[best], True)
        return _Decision(best, probs[best], False, plan_index, p_fit, True)

    async def _decide(self, view: list[Any], tick: int) -> _Decision:
        if self.mode == "async":
            return await self._follow_or_exit(view, tick)
        engine, name = self.engine, self.coroutine("actor")
        question = self.chat.question(self._action_question(tick))
        probs = await engine.probe(view, question, choices=self.actions, name=name, priority="interactive")
        best = max(probs, key=probs.get)
        self.emit("probe", "actor", best, value=probs[best])
        if self.mode == "probe-only":
            return _Decision(best, probs[best], True)
        # sequential: reason briefly in a scratch block, then choose after the reasoning
        scratch = engine.block(f"{name}-think-{tick}")
        try:
            sview = [*view, scratch]
            await engine.extend(
                scratch, question + "Let me think.", view=sview, name=name, priority="interactive"
            )
            res = await engine.generate(
                sview,
                max_tokens=self.think_tokens,
                stop=["\n"],
                name=name,
                priority="interactive",
                seed=self.seed,
            ).collect()
            self.emit("thought", "actor", res.text.strip(), tokens=len(res.token_ids))
            probs = await engine.probe(
                sview,
                self.chat.question("So, which action? Answer with the action only."),
                choices=self.actions,
                name=name,
                priority="interactive",
            )
        finally:
            engine.release(scratch)
        best = max(probs, key=probs.get)
        return _Decision(best, probs[best], False)

    async def run(self, env: Environment, ticks: int) -> StrategistActorResult:
        """Play `ticks` ticks (or until ``env.done``); returns the actions, plans and costs."""
        engine = self.engine
        self._start_clock()
        ctx, window = await self.open_context(
            self.task, "actor", "observations", chunk_tokens=self.chunk_tokens, max_tokens=self.window_tokens
        )
        self._window = window
        stop = asyncio.Event()
        strategist = (
            asyncio.create_task(self._strategist(ctx, window, stop), name=self.coroutine("strategist"))
            if self.mode == "async"
            else None
        )
        records: list[ActionRecord] = []
        try:
            for tick in range(ticks):
                if getattr(env, "done", False):
                    break
                t0 = self.elapsed()
                passes0 = self.forward_passes("actor")
                observation = await env.observe()
                await window.append(f"[t={tick}] {observation}\n", self.coroutine("actor"))
                self.emit("input", "actor", observation)
                with self._plans.held():
                    d = await self._decide([ctx, *window.blocks], tick)
                reward = float(await env.act(d.action))
                records.append(
                    ActionRecord(
                        tick,
                        d.action,
                        d.probability,
                        d.early_exit,
                        d.plan,
                        reward,
                        self.forward_passes("actor") - passes0,
                        self.elapsed() - t0,
                        d.plan_fit,
                        d.replanned,
                    )
                )
                self.emit("action", "actor", d.action, value=reward)
        finally:
            stop.set()
            await stop_background(strategist)
            window.close()
            self._window = None
            if self._plan_block is not None:
                engine.release(self._plan_block)
                self._plan_block = None
            engine.release(ctx)
        return StrategistActorResult(
            records,
            list(self.plans),
            sum(r.reward for r in records),
            list(self.events),
            self.forward_passes("strategist"),
            self.forward_passes("actor"),
            list(self.replans),
            self.abandoned_plans,
        )
