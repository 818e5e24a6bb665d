"""Strategist and actor: a slow strategist writes plans into a block; a fast actor reads
[context, recent observations, plan] and emits one action per tick, never waiting for the strategist.

Coroutines (engine names ``<name>.strategist`` / ``<name>.actor``, or bare when ``name=""``):

- **strategist** (background priority): over and over, writes a short plan into a fresh plan block while
  reading ``[ctx, *observation window, plan]``; when a plan is complete it becomes the current one (the
  previous plan block is released). It never blocks the actor: a tick reads whichever plan is current.
- **actor** (interactive priority): per tick, appends the observation to the bounded observation window,
  then probes ``[ctx, *window, plan]`` with "Observation: ... Which action now?" and the actions as
  choices (one forward pass for single-token choices). Early exit: when the best action's probability is
  at least ``early_exit`` it acts at once; otherwise it writes up to ``think_tokens`` tokens of reasoning
  in a scratch block and probes again after them, then takes the best action.

Modes (the paper's baselines use the same classes): ``"async"`` (the above), ``"probe-only"`` (no
strategist, no reasoning: one probe per tick), ``"sequential"`` (no strategist; every tick writes its
reasoning before choosing, i.e. the early exit never fires).

The environment is anything with ``async observe() -> str`` and ``async act(action) -> float`` (the
reward) and a ``done`` attribute; see :class:`Environment`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from cothink.agents.base import Agent, AgentEvent, ObservationWindow

Mode = Literal["async", "probe-only", "sequential"]


class Environment(Protocol):
    done: bool

    async def observe(self) -> str: ...

    async def act(self, action: str) -> float: ...


@dataclass(frozen=True)
class ActionRecord:
    tick: int
    action: str
    probability: float  # of the chosen action at the decision
    early_exit: bool  # decided on the first probe
    plan: int  # index of the plan it read (-1: none yet)
    reward: float
    forward_passes: int  # the actor's forward passes for this tick
    seconds: float  # observation -> action


@dataclass
class StrategistActorResult:
    actions: list[ActionRecord]
    plans: list[str]
    total_reward: float
    events: list[AgentEvent] = field(default_factory=list)
    strategist_forward_passes: int = 0
    actor_forward_passes: int = 0


class StrategistActor(Agent):
    """Constructor:

    - ``engine``: a running ``cothink.Engine``; ``task``: what the agent is for (goes into ctx);
    - ``actions``: the action names the actor chooses among (probe choices, tokenized exactly as
      given, right after the assistant's answer opener);
    - ``mode``: "async" | "probe-only" | "sequential";
    - ``early_exit``: probability at which the first probe decides (async);
    - ``think_tokens``: reasoning tokens when it does not; ``plan_tokens``: tokens per plan;
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
        early_exit: float = 0.8,
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
        self._plan_block: Any = None
        self._deciding = False
        self._retired_plans: list[Any] = []

    def _action_question(self, observation: str) -> str:
        return (
            f"Observation: {observation}\nWhich action now? Choose one of: {', '.join(self.actions)}. "
            "Answer with the action only."
        )

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
            block = engine.block(f"{name}-plan-{len(self.plans)}")
            try:
                # pinned: the actor may drop old observation chunks while the instruction is prefilled
                with window.pinned() as observed:
                    view = [ctx, *observed, block]
                    await engine.extend(block, instruction, view=view, name=name, priority="background")
                    gen = engine.generate(
                        view,
                        max_tokens=self.plan_tokens,
                        stop=["\n"],
                        name=name,
                        priority="background",
                        seed=self.seed,
                    )
                text = ""
                async for piece in gen:
                    text += piece.text
                    if stop.is_set():
                        gen.cancel()
                        break
            except BaseException:
                engine.release(block)
                raise
            if stop.is_set() and not text.strip():
                engine.release(block)
                return
            old, self._plan_block = self._plan_block, block
            if old is not None:
                # the actor may be deciding on the old plan: it releases it when it is done
                (self._retired_plans.append(old) if self._deciding else engine.release(old))
            self.plans.append(text.strip())
            self.emit(
                "plan", "strategist", text.strip(), tokens=len(gen.result.token_ids) if gen.result else 0
            )

    async def _decide(self, view: list[Any], observation: str, tick: int) -> tuple[str, float, bool]:
        engine, name = self.engine, self.coroutine("actor")
        question = self.chat.question(self._action_question(observation))
        probs = await engine.probe(view, question, choices=self.actions, name=name, priority="interactive")
        best = max(probs, key=probs.get)
        self.emit("probe", "actor", best, value=probs[best])
        if self.mode == "probe-only" or (self.mode == "async" and probs[best] >= self.early_exit):
            return best, probs[best], True
        # Not sure (or sequential): reason briefly in a scratch block, then choose after the reasoning.
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
        return best, probs[best], False

    async def run(self, env: Environment, ticks: int) -> StrategistActorResult:
        """Play `ticks` ticks (or until ``env.done``); returns the actions, plans and costs."""
        engine = self.engine
        self._start_clock()
        ctx, window = await self.open_context(
            self.task, "actor", "observations", chunk_tokens=self.chunk_tokens, max_tokens=self.window_tokens
        )
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
                plan = self._plan_block
                view = [ctx, *window.blocks, *([plan] if plan is not None else [])]
                self._deciding = True
                try:
                    action, p, early = await self._decide(view, observation, tick)
                finally:
                    self._deciding = False
                    for old in self._retired_plans:
                        engine.release(old)
                    self._retired_plans.clear()
                reward = float(await env.act(action))
                records.append(
                    ActionRecord(
                        tick,
                        action,
                        p,
                        early,
                        len(self.plans) - 1,
                        reward,
                        self.forward_passes("actor") - passes0,
                        self.elapsed() - t0,
                    )
                )
                self.emit("action", "actor", action, value=reward)
        finally:
            stop.set()
            if strategist is not None:
                try:
                    await asyncio.wait_for(strategist, timeout=60)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    strategist.cancel()
            window.close()
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
        )
