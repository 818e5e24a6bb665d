"""ViZDoom: act while thinking (`cothink experiment vizdoom`).

The game's clock is the engine's forward passes: a step listener advances the world by
`--tics-per-pass` tics (default 1) after every engine step, with the action the agent holds at that
moment (actions are held keys, see `vizdoom_env`). Nothing else moves the game. So an agent that thinks
for 20 passes before it acts lets the world run 20 passes on its last action, whatever this CPU's speed.

Strategies (per episode, on a fresh engine over the shared weights):

- `sequential`: per decision, the frame is appended to a fresh turn block, the model writes a short
  thought (`--reason-tokens`, stops at a newline), then an action probe reads [system, turn].
- `actor`: probe only: one action probe per decision over [system] + the frame (no thinking).
- `async`: a slow strategist coroutine keeps writing one-sentence plans (up to `--plan-tokens` tokens)
  over the observation window while a fast actor, per decision, follows the latest plan: one probe over
  [system, frames, plan] asks whether the plan still fits the newest frame, with `No` and the actions
  as choices (one forward pass). Early exit: when P(fits) < `--early-exit` the actor drops the plan,
  tells the strategist to replan from the newest frames (a plan it is writing from older ones is
  abandoned) and acts on its own judgement (an action probe without the plan). Before the first plan it
  acts on its own judgement. The actor never awaits the strategist.
- `layout`: the coroutine layout the model designs from the scenario description (`cothink.layouts`:
  parsed, validated, errors sent back once, fallback to the default strategist/actor layout).
- `random`, `heuristic`: model-free baselines acting once per pass-equivalent with zero latency
  (`vizdoom_env.RandomPolicy`, `HeuristicPolicy`): the scale of the rewards.

Metrics per episode: total reward; mean observation-to-action latency in forward passes (engine passes
between reading the frame and pressing the chosen action); forward passes of the episode; actions taken.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cothink.experiments import harness
from cothink.experiments.harness import ExperimentConfig, Results, Row
from cothink.experiments.vizdoom_env import SCENARIOS, Action, DoomWorld, Scenario, play_baseline

NAME = "vizdoom"
log = logging.getLogger("cothink.experiments.vizdoom")
MODEL_STRATEGIES = ("sequential", "actor", "async", "layout")
BASELINES = ("random", "heuristic")
STRATEGIES = (*MODEL_STRATEGIES, *BASELINES)


class Rerun(BaseModel):
    """Rows replaced in a saved run by a later run with the same settings (`--merge`)."""

    strategies: list[str]
    scenarios: list[str]
    started_at: str
    wall_s: float
    note: str = ""


class VizdoomConfig(ExperimentConfig):
    scenarios: list[str]
    strategies: list[str]
    episodes: int
    tics_per_pass: int
    max_tics: int | None
    reason_tokens: int
    plan_tokens: int
    early_exit: float
    design_tokens: int = 400
    layout_designs: dict[str, dict[str, Any]] = {}  # scenario -> how its layout came about
    reruns: list[Rerun] = []  # strategies whose rows a later run replaced (`--merge`)


class AsyncEpisode(Row):
    """What the async strategy's agent did in one episode (`async_episodes.jsonl`, beside the rows)."""

    scenario: str
    episode: int
    seed: int
    decisions: int
    plans: int  # plans the strategist completed
    abandoned_plans: int  # plans it stopped writing on a replan
    followed: int  # decisions that followed a plan (its fit probe said it fits)
    replans: int  # early exits: the plan no longer fit
    own: int  # decisions on the actor's own judgement (no plan yet, or just dropped)
    mean_plan_fit: float | None  # mean P(plan fits) over the decisions that read a plan


class VizdoomRow(Row):
    scenario: str
    strategy: str
    episode: int
    seed: int
    reward: float
    mean_latency_passes: float | None  # None: the episode ended before the agent pressed anything
    forward_passes: int
    actions: int


# ------------------------------------------------------------------------------------------ prompts


def task_prompt(scenario: Scenario) -> str:
    words = ", ".join(a.name for a in scenario.actions)
    return (
        f"You play Doom. {scenario.description}\n"
        "Each observation lists the tic, your health, the recent reward and the objects you see "
        "(distance in map units, angle left or right of where you look).\n"
        f"Actions (one word): {words}. An action stays pressed until the next one."
    )


SYSTEM = "You control a player in a fast game. Be brief."


# ------------------------------------------------------------------------------------ world clock


@dataclass
class PassClock:
    """Advances the world after every engine forward pass and measures latency in passes.

    Attached to `engine.step_listeners`; `passes` counts the steps since the episode began."""

    world: DoomWorld
    tics_per_pass: int
    passes: int = 0
    started: bool = False  # the game starts at the agent's first observation (after its prompt prefill)
    latencies: list[int] = field(default_factory=list)

    def on_step(self, record: Any) -> None:
        if self.started and not self.world.finished:  # passes after the episode's end do not count
            self.passes += 1
            self.world.advance(self.tics_per_pass)

    def act(self, action: Action, observed_at: int) -> None:
        if self.world.finished:
            return
        self.world.act(action)
        self.latencies.append(self.passes - observed_at)

    @property
    def mean_latency(self) -> float | None:
        return statistics.fmean(self.latencies) if self.latencies else None


@dataclass
class DoomEnvironment:
    """The game as the strategist/actor pattern sees it (`cothink.agents.strategist.Environment`):
    `observe()` returns the frame text and notes the pass it was read at; `act()` presses the action and
    returns the reward earned since the previous action."""

    clock: PassClock
    observed_at: int = 0
    frames: int = 0
    _reward_mark: float = 0.0

    @property
    def done(self) -> bool:
        return self.clock.world.finished

    async def observe(self) -> str:
        self.clock.started = True
        self.observed_at = self.clock.passes
        self.frames += 1
        return self.clock.world.observe().text()

    async def act(self, action: str) -> float:
        self.clock.act(self.clock.world.scenario.action(action), self.observed_at)
        earned = self.clock.world.total_reward - self._reward_mark
        self._reward_mark = self.clock.world.total_reward
        return earned


# strategy -> StrategistActor mode (the paper's two baselines are modes of the same pattern)
PATTERN_MODES = {"sequential": "sequential", "actor": "probe-only", "async": "async"}


async def play(engine: Any, clock: PassClock, strategy: str, config: VizdoomConfig, seed: int) -> Any:
    """One episode of a model strategy on a running engine; returns the pattern's result."""
    from cothink.agents.strategist import StrategistActor

    scenario = clock.world.scenario
    agent = StrategistActor(
        engine,
        task=task_prompt(scenario),
        actions=[a.name for a in scenario.actions],
        mode=PATTERN_MODES[strategy],
        early_exit=config.early_exit,
        think_tokens=config.reason_tokens,
        plan_tokens=config.plan_tokens,
        system=SYSTEM,
        seed=seed,
    )
    env = DoomEnvironment(clock)
    return await agent.run(env, ticks=10**9)


# ---------------------------------------------------------------------------------------- episodes


# ------------------------------------------------------------------------------ model-designed layout


def environment_description(scenario: Scenario) -> str:
    """What the model reads to design its own coroutine layout for a scenario."""
    words = ", ".join(a.name for a in scenario.actions)
    return (
        f"{task_prompt(scenario)}\n"
        "Input events: one game observation (text) per forward pass of the model; the world keeps moving "
        "while you think. Output: a probe coroutine marked as output whose choices are exactly the actions "
        f"({words}); each of its answers is pressed in the game at once."
    )


def fit_fallback(layout: Any, scenario: Scenario) -> Any:
    """The default strategist/actor layout, told this scenario's task and actions (only the fallback is
    adapted: a layout the model designed runs as it was designed)."""
    words = [a.name for a in scenario.actions]
    coroutines = [
        c.model_copy(update={"choices": words, "prompt": f"Which action now? Answer {', '.join(words)}."})
        if c.role == "probe" and c.output
        else c
        for c in layout.coroutines
    ]
    return layout.model_copy(update={"task": task_prompt(scenario), "coroutines": coroutines})


async def design(handle: Any, scenario: Scenario, config: VizdoomConfig) -> Any:
    """The model designs a layout from the scenario description (validated; the errors go back once;
    fallback: the shipped strategist-actor layout). Returns cothink.layouts.design.DesignOutcome."""
    from cothink.layouts.design import design_layout, engine_proposer

    engine = handle.engine(kv_tokens=8192)
    async with engine:
        outcome = await design_layout(
            environment_description(scenario),
            engine_proposer(engine, max_tokens=config.design_tokens or None),
            fallback="strategist-actor",
        )
    if outcome.source == "fallback":
        outcome.layout = fit_fallback(outcome.layout, scenario)
    return outcome


async def play_layout(engine: Any, clock: PassClock, layout: Any, seed: int, idle_s: float = 2.0) -> Any:
    """Run a layout against the game: a new frame is offered after every pass (the runner's rules queue
    them, dropping stale ones); an answer of an output probe that names an action is pressed, its
    latency counted from the pass that produced the frame the rules delivered last. The episode ends
    with the game, or when the layout leaves the engine idle for `idle_s` seconds (nothing will move)."""
    from cothink.layouts.runner import LayoutRunner

    scenario = clock.world.scenario
    actions = {a.name for a in scenario.actions}
    outputs = {c.name for c in layout.coroutines if c.role == "probe" and c.output}
    produced: dict[str, int] = {}  # frame text -> pass it was produced at
    delivered = [0]

    def on_event(event: Any) -> None:
        if event.kind == "event" and event.text in produced:
            delivered[0] = produced[event.text]
        elif event.kind == "probe" and event.coroutine in outputs and event.text.strip() in actions:
            clock.act(scenario.action(event.text.strip()), delivered[0])

    async def frames() -> Any:
        clock.started = True
        last, idle_since = -1, None
        while not clock.world.finished:
            if clock.passes != last:
                last, idle_since = clock.passes, None
                text = clock.world.observe().text()
                produced[text] = last
                yield text
                continue
            if engine.occupancy().works == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > idle_s:
                    return
            await asyncio.sleep(0.001)

    runner = LayoutRunner(engine, layout, on_event=on_event, seed=seed)
    return await runner.run(frames(), max_seconds=24 * 3600)


# ---------------------------------------------------------------------------------------- episodes


async def model_episode(
    handle: Any,
    scenario: Scenario,
    strategy: str,
    seed: int,
    config: VizdoomConfig,
    layout: Any = None,
) -> tuple[VizdoomRow, AsyncEpisode | None]:
    engine = handle.engine(kv_tokens=8192)
    world = DoomWorld(scenario, seed=seed, max_tics=config.max_tics)
    clock = PassClock(world, config.tics_per_pass)
    detail = None
    try:
        async with engine:
            engine.step_listeners.append(clock.on_step)
            if strategy == "layout":
                await play_layout(engine, clock, layout, seed)
            else:
                result = await play(engine, clock, strategy, config, seed)
                if strategy == "async":
                    detail = async_episode(result, scenario, seed)
    finally:
        world.close()
    row = VizdoomRow(
        scenario=scenario.name,
        strategy=strategy,
        episode=0,
        seed=seed,
        reward=world.total_reward,
        mean_latency_passes=clock.mean_latency,
        forward_passes=clock.passes,
        actions=world.actions_taken,
    )
    return row, detail


def async_episode(result: Any, scenario: Scenario, seed: int) -> AsyncEpisode:
    """The async agent's decisions in one episode: plans followed, early exits, own judgement."""
    fits = [a.plan_fit for a in result.actions if a.plan_fit is not None]
    return AsyncEpisode(
        scenario=scenario.name,
        episode=0,
        seed=seed,
        decisions=len(result.actions),
        plans=len(result.plans),
        abandoned_plans=result.abandoned_plans,
        followed=sum(a.plan >= 0 and not a.replanned for a in result.actions),
        replans=len(result.replans),
        own=sum(a.plan < 0 or a.replanned for a in result.actions),
        mean_plan_fit=statistics.fmean(fits) if fits else None,
    )


def baseline_episode(scenario: Scenario, strategy: str, seed: int, config: VizdoomConfig) -> VizdoomRow:
    world = play_baseline(
        scenario, strategy, seed, tics_per_pass=config.tics_per_pass, max_tics=config.max_tics
    )
    return VizdoomRow(
        scenario=scenario.name,
        strategy=strategy,
        episode=0,
        seed=seed,
        reward=world.total_reward,
        mean_latency_passes=0.0,
        forward_passes=0,
        actions=world.actions_taken,
    )


# ----------------------------------------------------------------------------------------- summary


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = statistics.fmean(vals)
    se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0
    return m, se


def summarize(rows: Sequence[VizdoomRow]) -> dict[str, Any]:
    """summary[scenario][strategy] = {n, reward_mean, reward_se, latency_mean, latency_se, ...}."""
    out: dict[str, Any] = {}
    for sc in dict.fromkeys(r.scenario for r in rows):
        out[sc] = {}
        for st in dict.fromkeys(r.strategy for r in rows if r.scenario == sc):
            rs = [r for r in rows if r.scenario == sc and r.strategy == st]
            entry: dict[str, float] = {"n": len(rs)}
            for key, attr in (
                ("reward", "reward"),
                ("latency", "mean_latency_passes"),
                ("forward_passes", "forward_passes"),
                ("actions", "actions"),
            ):
                m, se = mean_se([float(v) for r in rs if (v := getattr(r, attr)) is not None])
                entry[f"{key}_mean"], entry[f"{key}_se"] = m, se
            # episodes that ended before the agent pressed anything have no latency (not averaged in)
            entry["episodes_without_action"] = sum(r.actions == 0 for r in rs)
            out[sc][st] = entry
    return out


def plot(path: Path, summary: dict[str, Any]) -> Path:
    """Mean reward vs mean latency in passes, one point (with standard errors) per strategy."""
    with harness.figure(path, len(summary)) as axes:
        for ax, (sc, by_strategy) in zip(axes, summary.items()):
            draw_strategies(ax, sc, by_strategy)
    return path


def draw_strategies(ax: Any, sc: str, by_strategy: dict[str, Any]) -> None:
    """One scenario's panel: a point per strategy at (mean latency, mean reward), with standard errors."""
    for st, e in by_strategy.items():
        ax.errorbar(
            [e["latency_mean"]],
            [e["reward_mean"]],
            xerr=[e["latency_se"]],
            yerr=[e["reward_se"]],
            fmt="s" if st in BASELINES else "o",
            capsize=3,
            label=st,
        )
    ax.set_title(sc)
    ax.set_xlabel("mean observation-to-action latency (forward passes)")
    ax.set_ylabel("mean episode reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def async_table(episodes: Sequence[AsyncEpisode]) -> list[list[Any]]:
    """Per scenario: the async agent's decisions summed over its episodes, and the mean P(plan fits)."""
    table = []
    for sc in dict.fromkeys(d.scenario for d in episodes):
        ds = [d for d in episodes if d.scenario == sc]
        counts = ("decisions", "followed", "replans", "own", "plans", "abandoned_plans")
        fits = [d.mean_plan_fit for d in ds if d.mean_plan_fit is not None]
        table.append([sc, len(ds), *(sum(getattr(d, k) for d in ds) for k in counts),
                      statistics.fmean(fits) if fits else None])
    return table


def report(results: Results[VizdoomConfig, VizdoomRow], async_episodes: Sequence[AsyncEpisode] = ()) -> str:
    c = results.config
    lines = [
        "# ViZDoom: reward vs latency",
        "",
        f"Model: {c.model_description or c.model} ({c.dtype}); {c.episodes} episodes per scenario and "
        f"strategy; {c.tics_per_pass} tic(s) per forward pass; max tics {c.max_tics or 'scenario default'}; "
        f"reason tokens {c.reason_tokens}, plan tokens {c.plan_tokens}; async: the actor exits a plan when "
        f"P(plan fits) < {c.early_exit}. Machine: {harness.machine_line(c.machine)}; wall {c.wall_s:.0f} s.",
        "",
    ]
    if c.earlier_parts:
        lines += [harness.parts_line(c, "episodes"), ""]
    for r in c.reruns:
        lines += [
            f"Rerun ({r.started_at}, wall {r.wall_s:.0f} s, same settings): the rows of "
            f"{', '.join(r.strategies)} on {', '.join(r.scenarios)} replace the earlier ones."
            + (f" {r.note}" if r.note else ""),
            "",
        ]
    for sc, by_strategy in results.summary.items():
        lines += [
            f"## {sc}",
            "",
            harness.markdown_table(
                [
                    "strategy",
                    "episodes",
                    "reward",
                    "± se",
                    "latency (passes)",
                    "± se",
                    "forward passes",
                    "actions",
                    "episodes without action",
                ],
                [
                    [
                        st,
                        int(e["n"]),
                        e["reward_mean"],
                        e["reward_se"],
                        e["latency_mean"],
                        e["latency_se"],
                        e["forward_passes_mean"],
                        e["actions_mean"],
                        int(e.get("episodes_without_action", 0)),
                    ]
                    for st, e in by_strategy.items()
                ],
            ),
            "",
        ]
    if async_episodes:
        lines += [
            "## async: plans followed and early exits",
            "",
            harness.markdown_table(
                ["scenario", "episodes", "decisions", "followed a plan", "early exits (replans)",
                 "own judgement", "plans written", "plans abandoned", "mean P(plan fits)"],
                async_table(async_episodes),
            ),
            "",
        ]
    if c.layout_designs:
        ran = sum(d["source"] != "fallback" for d in c.layout_designs.values())
        lines.append(
            f"Model-designed layouts that ran: {ran} of {len(c.layout_designs)} scenarios (the others ran "
            "the fallback layout)."
        )
    for sc, d in c.layout_designs.items():
        lines.append(
            f"Layout for {sc}: `{d['layout']}` from the model's {d['source']} after {d['attempts']} "
            f"proposal(s)" + (f"; first issues: {'; '.join(d['issues'][:3])}" if d["issues"] else "") + "."
        )
    lines += ["", "![reward vs latency](reward_vs_latency.png)", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- CLI


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--episodes", type=int, default=10, help="episodes per scenario and strategy (default 10)")
    p.add_argument(
        "--tics-per-pass", type=int, default=1, help="game tics per engine forward pass (default 1)"
    )
    p.add_argument(
        "--max-tics", type=int, default=None, help="episode timeout in tics (default: the scenario's, 2100)"
    )
    p.add_argument(
        "--reason-tokens",
        type=int,
        default=16,
        help="thought tokens before an action when the actor reasons (default 16)",
    )
    p.add_argument("--plan-tokens", type=int, default=24, help="async: most tokens per plan (default 24)")
    p.add_argument(
        "--design-tokens",
        type=int,
        default=400,
        help="layout: most tokens per layout proposal the model writes (default 400; 0: the layout "
        "schema's worst case, so every proposal completes)",
    )
    p.add_argument(
        "--early-exit",
        type=float,
        default=0.5,
        help="async: the actor exits the plan (replan, own judgement) when its probe gives "
        "P(plan still fits) below this (default 0.5)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="replace only the rows of these strategies and scenarios in the saved run in --out "
        "(its settings must match); the other rows are kept and the rerun is recorded",
    )
    p.add_argument("--note", default="", help="with --merge: why the rows were rerun (goes into the report)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out: keep its finished episodes (and designed layouts), run the "
        "rest; its settings must match",
    )


def build_config(args: argparse.Namespace) -> VizdoomConfig:
    quick = bool(args.quick)
    return VizdoomConfig(
        experiment=NAME,
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        limit=args.limit,
        quick=quick,
        max_tokens=args.max_tokens,
        threads=args.threads,
        scenarios=args.scenarios,
        strategies=args.strategies,
        episodes=1 if quick else args.episodes,
        tics_per_pass=args.tics_per_pass,
        max_tics=min(args.max_tics or 40, 40) if quick else args.max_tics,
        reason_tokens=min(args.reason_tokens, 4) if quick else args.reason_tokens,
        plan_tokens=min(args.plan_tokens, 6) if quick else args.plan_tokens,
        early_exit=args.early_exit,
        design_tokens=min(args.design_tokens or 48, 48) if quick else args.design_tokens,
    )


ASYNC_EPISODES = "async_episodes.jsonl"
# settings a `--merge` run must share with the saved run whose rows it replaces
MERGE_SETTINGS = (
    "model", "dtype", "seed", "episodes", "tics_per_pass", "max_tics", "reason_tokens", "plan_tokens",
    "early_exit",
)
# and a `--resume` run with the run it continues (the same jobs, and layouts designed the same way)
RESUME_SETTINGS = (*MERGE_SETTINGS, "quick", "max_tokens", "scenarios", "strategies", "design_tokens")


def merge_base(config: VizdoomConfig, out: Path) -> Results[VizdoomConfig, VizdoomRow]:
    """`--merge`: the saved run in `out` whose rows of this run's (scenario, strategy) pairs are replaced;
    refuses a run whose settings differ (the merged table would mix two experiments)."""
    from cothink.errors import InvalidParameterError

    path = out / "results.json"
    if not path.exists():
        raise InvalidParameterError(f"--merge: no saved run at {path}", param="merge")
    saved = harness.read_results(path, VizdoomConfig, VizdoomRow)
    keys = (*MERGE_SETTINGS, *(("design_tokens",) if "layout" in config.strategies else ()))
    differ = [f"{k}: saved {getattr(saved.config, k)!r}, now {getattr(config, k)!r}"
              for k in keys if getattr(saved.config, k) != getattr(config, k)]
    if differ:
        raise InvalidParameterError("--merge: settings differ from the saved run: " + "; ".join(differ),
                                    param="merge")
    return saved


def merged_config(saved: VizdoomConfig, config: VizdoomConfig, wall_s: float, note: str) -> VizdoomConfig:
    """The saved config, told which strategies were rerun (and the new layout designs, if any)."""
    rerun = Rerun(strategies=config.strategies, scenarios=config.scenarios, started_at=config.started_at,
                  wall_s=round(wall_s, 1), note=note)
    return saved.model_copy(update={
        "scenarios": list(dict.fromkeys([*saved.scenarios, *config.scenarios])),
        "strategies": list(dict.fromkeys([*saved.strategies, *config.strategies])),
        "layout_designs": {**saved.layout_designs, **config.layout_designs},
        "reruns": [*saved.reruns, rerun],
    })


def _job(scenario: str, strategy: str, episode: int) -> str:
    return f"{scenario}|{strategy}|{episode}"


def saved_layouts(config: VizdoomConfig, out: Path) -> dict[str, Any]:
    """`--resume`: the layouts the saved run designed (`layout_<scenario>.json`), so its episodes and the
    ones still to run play the same layout; a scenario without one is designed again."""
    from cothink.layouts.validate import parse

    layouts: dict[str, Any] = {}
    for sc_name in config.scenarios:
        path = out / f"layout_{sc_name}.json"
        if sc_name in config.layout_designs and path.exists():
            layout, issues = parse(path.read_text())
            if layout is not None and not issues:
                layouts[sc_name] = layout
    return layouts


def resumed(config: VizdoomConfig, out: Path) -> tuple[list[VizdoomRow], dict[str, Any]]:
    """`--resume`: the saved run's finished rows and the layouts it designed (config takes over its
    `layout_designs`); no saved run: nothing."""
    rows = harness.resume(out, config, VizdoomRow, unit=lambda r: _job(r.scenario, r.strategy, r.episode),
                          rows_per_unit=1, same=RESUME_SETTINGS)
    if not config.earlier_parts:
        return rows, {}
    before = harness.read_results(out / "results.json", VizdoomConfig, VizdoomRow).config
    config.layout_designs = dict(before.layout_designs)
    return rows, saved_layouts(config, out)


def design_layouts(handle: Any, config: VizdoomConfig, out: Path, layouts: dict[str, Any]) -> None:
    """Have the model design a layout for each scenario `layouts` lacks (once per scenario, used by all its
    episodes); each is saved as `layout_<scenario>.json` and recorded in `config.layout_designs`."""
    from cothink.layouts.design import layout_json

    for sc_name in [s for s in config.scenarios if s not in layouts]:
        outcome = asyncio.run(design(handle, SCENARIOS[sc_name], config))
        layouts[sc_name] = outcome.layout
        out.mkdir(parents=True, exist_ok=True)
        (out / f"layout_{sc_name}.json").write_text(layout_json(outcome.layout) + "\n")
        config.layout_designs[sc_name] = {
            "source": outcome.source,
            "attempts": len(outcome.attempts),
            "issues": [str(i) for a in outcome.attempts for i in a.issues][:10],
            "layout": outcome.layout.name,
            "proposals": [a.text[:400] for a in outcome.attempts],
        }


def job_order(config: VizdoomConfig) -> Any:
    """Sort key of the rows: episode-major, then scenario and strategy in the config's order."""
    return lambda r: (r.episode, config.scenarios.index(r.scenario), config.strategies.index(r.strategy))


def run_experiment(
    config: VizdoomConfig,
    out: Path,
    *,
    show_progress: bool | None = None,
    merge: bool = False,
    note: str = "",
    resume: bool = False,
) -> Results[VizdoomConfig, VizdoomRow]:
    """Run every (scenario, strategy, episode); with `merge`, replace only those rows of the saved run in
    `out` (same settings required) and keep the others; with `resume`, keep the saved run's finished
    episodes and run the rest."""
    if merge and resume:
        from cothink.errors import InvalidParameterError

        raise InvalidParameterError("--merge and --resume exclude each other", param="resume")
    t0 = harness.begin(config)
    saved = merge_base(config, out) if merge else None
    kept = [r for r in saved.rows if (r.scenario, r.strategy) not in
            {(sc, st) for sc in config.scenarios for st in config.strategies}] if saved else []
    rows, layouts = resumed(config, out) if resume else ([], {})
    done = {_job(r.scenario, r.strategy, r.episode) for r in rows}
    details = [d for d in read_async_episodes(out) if _job(d.scenario, "async", d.episode) in done]
    handle = None
    if any(s in MODEL_STRATEGIES for s in config.strategies):
        handle = harness.load_model(config.model, config.dtype)
        config.model_description = handle.description
    # episode-major: a run cut short still has every (scenario, strategy) with about as many episodes
    jobs = [
        (sc, st, ep) for ep in range(config.episodes) for sc in config.scenarios for st in config.strategies
        if _job(sc, st, ep) not in done
    ]
    if "layout" in config.strategies:
        design_layouts(handle, config, out, layouts)

    def write(final: bool) -> Results[VizdoomConfig, VizdoomRow]:
        wall = time.perf_counter() - t0
        if saved is None:
            config.wall_s = wall
            return save(out, config, rows, final=final)
        merged = merged_config(saved.config, config, wall, note)
        return save(out, merged, sorted([*kept, *rows], key=job_order(merged)), final=final)

    with harness.progress(len(jobs), "vizdoom episodes", enabled=show_progress) as advance:
        for sc_name, strategy, episode in jobs:
            scenario, seed = SCENARIOS[sc_name], config.seed * 1000 + episode
            detail = None
            if strategy in BASELINES:
                row = baseline_episode(scenario, strategy, seed, config)
            else:
                row, detail = asyncio.run(
                    model_episode(handle, scenario, strategy, seed, config, layouts.get(sc_name))
                )
            rows.append(row.model_copy(update={"episode": episode}))
            if detail is not None:
                details.append(detail.model_copy(update={"episode": episode}))
                write_async_episodes(out, details)
            advance(1)
            log.info("%d/%d %s", len(rows), len(jobs), rows[-1].model_dump_json())
            write(final=False)
    return write(final=True)


def write_async_episodes(out: Path, details: Sequence[AsyncEpisode]) -> Path:
    """One line per async episode (rewritten whole: the file belongs to the latest run of `async`)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / ASYNC_EPISODES
    path.write_text("".join(d.model_dump_json() + "\n" for d in details))
    return path


def read_async_episodes(out: Path) -> list[AsyncEpisode]:
    path = out / ASYNC_EPISODES
    if not path.exists():
        return []
    return [AsyncEpisode.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


FOLDER = harness.ResultsFolder(
    VizdoomConfig,
    VizdoomRow,
    summarize,
    lambda results, out: report(results, read_async_episodes(out)),
    plot,
    "reward_vs_latency.png",
)
save = FOLDER.save  # results.json + report.md (after every episode), the plot at the end
render = FOLDER.render  # redo summary, report and plot from a saved results.json


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # SIGTERM unwinds like Ctrl-C, so every open game is closed (its engine process would outlive us)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        results = run_experiment(
            build_config(args), args.out, show_progress=args.progress, merge=args.merge, note=args.note,
            resume=args.resume,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(report(results, read_async_episodes(args.out)))
    print(f"results: {args.out / 'results.json'}")
    return 0


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="ViZDoom: a slow strategist and a fast actor vs sequential reasoning (reward vs latency in passes)",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
    default_max_tokens=32,
)
