"""ViZDoom experiment: the text world, the pass clock, the baselines, a --quick run on a tiny model, and
the async strategy never blocking its actor on the strategist."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("vizdoom")

from cothink.experiments import harness  # noqa: E402
from cothink.experiments import vizdoom as vd  # noqa: E402
from cothink.experiments.vizdoom_env import (  # noqa: E402
    SCENARIOS,
    DoomWorld,
    Frame,
    SeenObject,
    bearing_deg,
    play_baseline,
)


def test_bearing_is_left_positive_and_wraps():
    assert bearing_deg(0, 0, 0, 10, 0) == pytest.approx(0)
    assert bearing_deg(0, 0, 0, 0, 10) == pytest.approx(90)  # counter-clockwise = left
    assert bearing_deg(0, 0, 90, 10, 0) == pytest.approx(-90)
    assert bearing_deg(0, 0, 350, 10, 1) == pytest.approx(15.71, abs=0.01)  # wraps through 0


def test_frame_text_format():
    frame = Frame(tic=12, health=64.4, recent_reward=8.0,
                  objects=(SeenObject("Medikit", 230.4, 12.2), SeenObject("Zombieman", 500, -3.0)))
    assert frame.text() == ("tic 12 | health 64 | reward +8.0\nMedikit: 230 units, 12 deg left\n"
                            "Zombieman: 500 units, ahead")
    assert Frame(0, 100, 0, ()).text().endswith("\nnothing in view")


def test_world_runs_headless_and_holds_actions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sc = SCENARIOS["health_gathering"]
    with DoomWorld(sc, seed=3, max_tics=60) as world:
        first = world.observe()
        assert first.tic == 0 and first.health > 0 and not first.finished
        assert any(o.kind == "Medikit" for o in first.objects)
        world.act(sc.action("forward"))
        world.advance(5)
        assert world.tics == 5 and world.held.name == "forward" and world.actions_taken == 1
        world.advance(100)  # the timeout ends the episode
        assert world.finished and world.tics <= 60 and world.observe().finished
    assert not any(p.name.endswith(".ini") for p in tmp_path.iterdir())  # no _vizdoom.ini in the cwd


def test_baselines_give_a_scale():
    sc = SCENARIOS["deadly_corridor"]
    heuristic = play_baseline(sc, "heuristic", seed=1, tics_per_pass=4)
    rnd = play_baseline(sc, "random", seed=1, tics_per_pass=4)
    assert heuristic.total_reward > rnd.total_reward + 500  # the script reaches the vest; random does not
    assert heuristic.actions_taken == -(-heuristic.tics // 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hybrid", hybrid=True, seed=5)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["experiment", "vizdoom", *argv])


def test_quick_run_rows_latency_in_passes(tiny, tmp_path):
    out = tmp_path / "out"
    args = _parse(["--model", str(tiny), "--quick", "--strategies", "sequential", "actor", "async", "layout",
                   "random", "heuristic", "--tics-per-pass", "2", "--reason-tokens", "3", "--out", str(out),
                   "--no-progress"])
    assert args.func(args) == 0
    raw = json.loads((out / "results.json").read_text())
    assert set(raw) == {"config", "rows", "summary"}
    assert (out / "report.md").exists() and (out / "reward_vs_latency.png").stat().st_size > 1000
    for row in raw["rows"]:
        assert set(row) == {"scenario", "strategy", "episode", "seed", "reward", "mean_latency_passes",
                            "forward_passes", "actions"}
    results = harness.read_results(out / "results.json", vd.VizdoomConfig, vd.VizdoomRow)
    rows = {(r.scenario, r.strategy): r for r in results.rows}
    assert len(results.rows) == 2 * 6
    # the tiny model cannot write a valid layout in 48 tokens: it was told its errors once, then fell back
    for sc in SCENARIOS:
        design = results.config.layout_designs[sc]
        assert design["source"] == "fallback" and design["attempts"] == 2 and design["issues"]
        assert (out / f"layout_{sc}.json").exists()
        lay = rows[(sc, "layout")]
        assert lay.forward_passes > 0 and lay.actions >= 1 and lay.mean_latency_passes >= 1
    report = (out / "report.md").read_text()
    assert f"Model-designed layouts that ran: 0 of {len(SCENARIOS)} scenarios" in report
    for sc in SCENARIOS:
        actor, seq = rows[(sc, "actor")], rows[(sc, "sequential")]
        # the game advanced 2 tics per pass and the episode is 40 tics (quick): at most 20 passes
        assert 0 < actor.forward_passes <= 20 and actor.actions >= 1
        # probe-only: append the frame + probe it (a pass or two each, by token count), nothing else
        assert 2.0 <= actor.mean_latency_passes <= 4.0
        if seq.actions:  # sequential writes its thought first: more passes between frame and action
            assert seq.mean_latency_passes > actor.mean_latency_passes
        assert rows[(sc, "random")].forward_passes == 0 and rows[(sc, "random")].mean_latency_passes == 0
    assert set(results.summary) == set(SCENARIOS)
    assert vd.render(out).rows == results.rows  # a saved run re-renders (summary, report, plot)
    entry = results.summary["deadly_corridor"]["async"]
    assert {"reward_mean", "reward_se", "latency_mean", "latency_se"} <= set(entry)
    # the async agent's own record: one line per async episode, its decisions add up
    details = vd.read_async_episodes(out)
    assert sorted(d.scenario for d in details) == sorted(SCENARIOS)
    for d in details:
        assert d.followed + d.own == d.decisions and d.replans <= d.decisions
        assert d.decisions >= rows[(d.scenario, "async")].actions
    assert "## async: plans followed and early exits" in (out / "report.md").read_text()


def test_merge_replaces_only_the_rerun_rows(tmp_path):
    """`--merge` reruns some strategies into a saved run: their rows are replaced, the others kept, the
    rerun recorded; a run with other settings is refused (model-free baselines: no model needed)."""
    from cothink.errors import InvalidParameterError

    out = tmp_path / "out"
    common = ["--quick", "--scenarios", "health_gathering", "--tics-per-pass", "4", "--out", str(out),
              "--no-progress"]
    first = _parse([*common, "--strategies", "random", "heuristic"])
    assert first.func(first) == 0
    before = harness.read_results(out / "results.json", vd.VizdoomConfig, vd.VizdoomRow)
    # mark every saved reward: a replaced row gets its real value back, a kept row keeps the mark
    raw = json.loads((out / "results.json").read_text())
    for row in raw["rows"]:
        row["reward"] = -12345.0
    (out / "results.json").write_text(json.dumps(raw))
    again = _parse([*common, "--strategies", "heuristic", "--merge", "--note", "checked"])
    assert again.func(again) == 0
    after = harness.read_results(out / "results.json", vd.VizdoomConfig, vd.VizdoomRow)
    assert [(r.strategy, r.episode) for r in after.rows] == [(r.strategy, r.episode) for r in before.rows]
    for new, old in zip(after.rows, before.rows):  # the baselines are deterministic per seed
        assert new.reward == (old.reward if new.strategy == "heuristic" else -12345.0)
    assert after.config.strategies == ["random", "heuristic"] and after.config.started_at == \
        before.config.started_at
    (rerun,) = after.config.reruns
    assert rerun.strategies == ["heuristic"] and rerun.note == "checked"
    assert "replace the earlier ones. checked" in (out / "report.md").read_text()
    other = _parse([*common, "--strategies", "heuristic", "--merge", "--tics-per-pass", "2"])
    with pytest.raises(InvalidParameterError, match="tics_per_pass"):
        other.func(other)


def test_resume_runs_only_the_missing_episodes(tmp_path):
    """`--resume` keeps the saved run's finished episodes and runs the rest; other settings are refused, and
    so is `--merge` with it (model-free baselines: no model needed)."""
    from cothink.errors import InvalidParameterError

    out = tmp_path / "out"
    common = ["--scenarios", "health_gathering", "--strategies", "random", "heuristic", "--episodes", "2",
              "--max-tics", "40", "--tics-per-pass", "4", "--out", str(out), "--no-progress"]
    first = _parse(common)
    assert first.func(first) == 0
    full = harness.read_results(out / "results.json", vd.VizdoomConfig, vd.VizdoomRow)
    # cut the run short after three episodes and mark them: kept rows keep the mark
    raw = json.loads((out / "results.json").read_text())
    raw["rows"] = raw["rows"][:3]
    for row in raw["rows"]:
        row["reward"] = -12345.0
    (out / "results.json").write_text(json.dumps(raw))
    again = _parse([*common, "--resume"])
    assert again.func(again) == 0
    after = harness.read_results(out / "results.json", vd.VizdoomConfig, vd.VizdoomRow)
    assert [(r.strategy, r.episode) for r in after.rows] == [(r.strategy, r.episode) for r in full.rows]
    assert [r.reward for r in after.rows[:3]] == [-12345.0] * 3
    assert after.rows[3].reward == full.rows[3].reward  # the one missing episode ran again, same seed
    (part,) = after.config.earlier_parts
    assert part.units == 3 and "resumed run" in (out / "report.md").read_text()
    other = _parse([*common, "--resume", "--tics-per-pass", "2"])
    with pytest.raises(harness.ResumeMismatchError, match="tics_per_pass"):
        other.func(other)
    both = _parse([*common, "--resume", "--merge"])
    with pytest.raises(InvalidParameterError, match="exclude"):
        both.func(both)


@pytest.mark.parametrize(("early_exit", "plan_tokens"), [(0.0, 400), (1.01, 3)])
def test_async_actor_never_waits_for_the_strategist(tiny, early_exit, plan_tokens):
    """The strategist writes plans alongside; the actor must never wait for it: every engine pass between
    reading a frame and pressing the action carried the actor's own work. At threshold 0 every plan fits
    (long plans: the actor acts before any exists); above 1 none does: each plan the actor reads is
    exited early (replan, own judgement: a second probe), and still no pass is spent waiting."""
    handle = harness.load_model(str(tiny))
    config = vd.VizdoomConfig(experiment="vizdoom", model=str(tiny), scenarios=[], strategies=[], episodes=1,
                              tics_per_pass=1, max_tics=40, reason_tokens=4, plan_tokens=plan_tokens,
                              early_exit=early_exit)

    async def episode() -> tuple[vd.PassClock, object, int]:
        engine = handle.engine(kv_tokens=8192)
        world = DoomWorld(SCENARIOS["health_gathering"], seed=0, max_tics=40)
        clock = vd.PassClock(world, 1)
        try:
            async with engine:
                engine.step_listeners.append(clock.on_step)
                result = await vd.play(engine, clock, "async", config, seed=0)
                strategist = engine.stats["strategist"].forward_passes
        finally:
            world.close()
        return clock, result, strategist

    clock, result, strategist_passes = asyncio.run(episode())
    # (an action chosen after the episode's last tic is not pressed: at most one more record)
    assert len(clock.latencies) >= 8 and len(result.actions) - len(clock.latencies) in (0, 1)
    for latency, action in zip(clock.latencies, result.actions):
        assert latency == action.forward_passes  # no pass without the actor in it: it never waited
        assert action.early_exit == (not action.replanned)
    assert any(a.plan == -1 for a in result.actions)  # the actor acted before any plan existed
    if early_exit == 0.0:  # the strategist really was at work alongside
        assert strategist_passes >= clock.passes // 2 and not result.replans
    else:  # plans were written, read, found not to fit, and replaced
        read = [a for a in result.actions if a.plan >= 0]
        assert read and all(a.replanned for a in read) and len(result.replans) == len(read)


def test_cli_lists_both_experiments():
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "vizdoom", "--tics-per-pass", "4"])
    assert args.tics_per_pass == 4 and args.func is vd.run
    assert args.strategies == list(vd.STRATEGIES) and args.episodes == 10


def test_a_resumed_run_keeps_the_designed_layouts(tmp_path):
    from cothink.layouts.design import layout_json, shipped_layout

    layout = shipped_layout("strategist-actor")
    (tmp_path / "layout_health_gathering.json").write_text(layout_json(layout) + "\n")
    (tmp_path / "layout_deadly_corridor.json").write_text("{not json")
    config = vd.VizdoomConfig(experiment="vizdoom", model="m",
                              scenarios=["health_gathering", "deadly_corridor"], strategies=["layout"],
                              episodes=1, tics_per_pass=1, max_tics=40, reason_tokens=4, plan_tokens=4,
                              early_exit=0.5, design_tokens=48,
                              layout_designs={"health_gathering": {"source": "model"},
                                              "deadly_corridor": {"source": "model"}})
    kept = vd.saved_layouts(config, tmp_path)
    # the valid saved design is reused; one that no longer parses is designed again
    assert list(kept) == ["health_gathering"] and layout_json(kept["health_gathering"]) == layout_json(layout)
    config.layout_designs = {}
    assert vd.saved_layouts(config, tmp_path) == {}  # no record of a design: designed again
