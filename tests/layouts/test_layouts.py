"""Coroutine layouts as data: schema, validation errors, the generic runner, model-designed layouts."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

import cothink
from cothink.cli import main as cli_main
from cothink.layouts.design import (
    SHIPPED,
    ProposalBounds,
    design_layout,
    design_prompt,
    engine_proposer,
    extract_json,
    layout_json,
    max_chars,
    proposal_schema,
    shipped_layout,
    shipped_text,
)
from cothink.layouts.model import Layout
from cothink.layouts.runner import InvalidLayoutError, LayoutRunner
from cothink.layouts.validate import check_text, parse, validate

BASE = json.loads(shipped_text("think-narrate"))


def _issues(data: dict) -> list[str]:
    issues, _ = check_text(json.dumps(data))
    return [str(i) for i in issues]


def _check_cli(tmp_path: Path, data: dict | str, capsys) -> tuple[int, str]:
    path = tmp_path / "layout.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    code = cli_main(["layout", "check", str(path)])
    out = capsys.readouterr()
    return code, out.err + out.out


def test_schema_command_prints_json_schema(capsys):
    assert cli_main(["layout", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Layout" and {"blocks", "coroutines"} <= set(schema["required"])
    assert "CoroutineSpec" in schema["$defs"] and "ProbeTrigger" in schema["$defs"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layouts_are_valid(name, tmp_path, capsys):
    assert isinstance(shipped_layout(name), Layout)
    code, out = _check_cli(tmp_path, shipped_text(name), capsys)
    assert code == 0 and "valid layout" in out


@pytest.mark.parametrize("name", SHIPPED)
def test_a_written_layout_reads_back(name):
    """layout_json is how runs save the layout they played: it must parse back to the same layout (a
    trigger's `kind` is a default value, and a dump without defaults could not be read)."""
    layout = shipped_layout(name)
    again, issues = parse(layout_json(layout))
    assert issues == [] and again == layout


def test_unknown_block(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    data["coroutines"][2]["reads"] = ["ctx", "notes"]  # the progress probe
    code, out = _check_cli(tmp_path, data, capsys)
    assert code == 2 and "coroutines[2].reads[1]: unknown block 'notes'" in out


def test_block_written_by_two_coroutines(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    data["coroutines"][3]["writes"] = "thoughts"  # the narrator writes the thinker's block
    data["coroutines"][3]["reads"] = ["ctx", "thoughts"]
    code, out = _check_cli(tmp_path, data, capsys)
    assert code == 2
    assert (
        "coroutines[3].writes: block 'thoughts' is written by two coroutines ('thinker' and 'narrator')"
        in out
    )


def test_trigger_cycle_without_progress(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    # the thinker waits for the narrator, which waits for the probe, which waits for the thinker's tokens
    data["coroutines"][1]["triggers"] = [{"kind": "done", "coroutine": "narrator"}]
    code, out = _check_cli(tmp_path, data, capsys)
    assert code == 2
    assert (
        "coroutines[1].triggers: trigger cycle with no progress: thinker -> progress -> narrator -> thinker"
        in out
    )
    # the same cycle with a start trigger on one member can progress
    data["coroutines"][1]["triggers"].append({"kind": "start"})
    assert _issues(data) == []


def test_view_must_end_with_written_block(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    data["coroutines"][1]["reads"] = ["thoughts", "ctx"]
    code, out = _check_cli(tmp_path, data, capsys)
    assert code == 2 and "coroutines[1].reads: the view must end with the written block 'thoughts'" in out


def test_structural_errors_name_the_field(tmp_path, capsys):
    data = copy.deepcopy(BASE)
    data["coroutines"][2]["triggers"][0]["tokens"] = 0
    data["coroutines"][0]["role"] = "shell"
    code, out = _check_cli(tmp_path, data, capsys)
    assert code == 2
    assert "coroutines[2].triggers[0].tokens:" in out and "coroutines[0].role:" in out
    code, out = _check_cli(tmp_path, "{not json", capsys)
    assert code == 2 and "layout: not valid JSON" in out
    # other semantic checks: a probe choice a trigger waits for must exist
    data = copy.deepcopy(BASE)
    data["coroutines"][3]["triggers"][0]["choice"] = "Maybe"
    assert _issues(data) == ["coroutines[3].triggers[0].choice: 'Maybe' is not a choice of 'progress'"]


# --------------------------------------------------------------------------------------- execution


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("layouts") / "hybrid", hybrid=True, seed=7)


async def _events(lines, delay=0.02):
    for line in lines:
        await asyncio.sleep(delay)
        yield line


def test_runner_executes_shipped_think_narrate(hybrid_dir):
    layout = shipped_layout("think-narrate")
    layout.coroutines[1].stop.max_tokens = 40  # the thinker
    layout.coroutines[3].stop.max_tokens = 5  # the narrator

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=8192) as engine:
            run = await LayoutRunner(engine, layout, name="tn").run(
                _events(["Use 5 apples."]), max_seconds=60
            )
            return run, dict(engine.stats)

    run, stats = asyncio.run(main())
    # the probe is triggered every 16 thinker tokens; a trigger that fires while it runs is remembered
    # for after that run, which the layout skips once it is closing (the thinker done), so how many
    # runs fit depends on how fast the thinker is next to the probe; each run of it is a probe event
    probes = [e for e in run.events if e.kind == "probe"]
    assert run.runs["thinker"] == 1 and run.runs["progress"] == len(probes) >= 1
    # the thinker's prompt, then one pass per generated token: up to 40, fewer where the random model
    # samples its end-of-sequence token first (greedy argmax near-ties differ between CPUs)
    thinker = stats["tn.thinker"]
    assert thinker.forward_passes >= 2 and run.forward_passes["progress"] >= len(probes)
    # the user's event went into ctx through the rule, with no model call
    assert run.events_in == 1 and [e.text for e in run.events if e.kind == "event"] == ["Use 5 apples."]
    assert run.forward_passes["user"] >= 1  # its extend is a (prefill) pass, not a generation
    # the narrator spoke when the probe said Yes (threshold 0.5), and its text is the layout's output
    yes = [e for e in probes if e.text == "Yes"]
    assert run.runs["narrator"] <= len(yes) and len(run.outputs) <= run.runs["narrator"]
    assert all(o.coroutine == "narrator" for o in run.outputs)


def test_runner_executes_stream_agent_layout_with_storm(hybrid_dir):
    layout = shipped_layout("stream-agent")
    # the probes always let the next part run: threshold 0 on the triggers that wait for them
    for c in layout.coroutines:
        for t in c.triggers:
            if t.kind == "probe":
                t.threshold = 0.0

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=8192) as engine:
            runner = LayoutRunner(engine, layout, name="sa")
            return await runner.run(_events([f"event {i}" for i in range(10)], delay=0.0), max_seconds=60)

    run = asyncio.run(main())
    assert run.events_in == 10 and run.events_dropped > 0  # max_pending 4 under a storm
    assert run.runs["describer"] >= 1 and run.outputs and run.forward_passes["thinker"] > 0


def test_runner_rejects_invalid_layout(hybrid_dir):
    data = copy.deepcopy(BASE)
    data["coroutines"][1]["reads"] = ["thoughts", "ctx"]
    layout = Layout.model_validate(data)

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=1024) as engine:
            LayoutRunner(engine, layout)

    with pytest.raises(InvalidLayoutError, match="must end with the written block"):
        asyncio.run(main())


# ---------------------------------------------------------------------------------- model-designed


class Scripted:
    """A proposer that answers with fixed texts, in order, and keeps the prompts it got."""

    def __init__(self, *answers: str):
        self.answers = list(answers)
        self.prompts: list[str] = []

    async def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answers.pop(0)


ENV = "A log stream of a web service; report memory leaks."


def test_design_valid_first_proposal():
    good = shipped_text("monitor")
    proposer = Scripted("Here is my layout:\n```json\n" + good + "\n```")
    outcome = asyncio.run(design_layout(ENV, proposer))
    assert outcome.source == "proposal" and outcome.layout.name == "monitor" and len(proposer.prompts) == 1
    assert ENV in proposer.prompts[0]


def test_design_invalid_then_valid_gets_errors_back():
    bad = copy.deepcopy(json.loads(shipped_text("monitor")))
    bad["coroutines"][1]["reads"] = ["ctx", "logs"]
    proposer = Scripted(json.dumps(bad), shipped_text("monitor"))
    outcome = asyncio.run(design_layout(ENV, proposer))
    assert outcome.source == "retry" and len(proposer.prompts) == 2
    assert "coroutines[1].reads[1]: unknown block 'logs'" in proposer.prompts[1]
    assert [len(a.issues) for a in outcome.attempts] == [1, 0]


def test_design_invalid_twice_falls_back():
    proposer = Scripted("no idea", '{"name": "x", "blocks": [], "coroutines": []}')
    outcome = asyncio.run(design_layout(ENV, proposer, fallback="monitor"))
    assert outcome.source == "fallback" and outcome.fallback == "monitor" and outcome.layout.name == "monitor"
    assert len(outcome.attempts) == 2 and all(a.issues for a in outcome.attempts)


def test_design_with_the_model_cut_short_falls_back(hybrid_dir):
    """A budget below the schema's worst case can cut a proposal: cut twice, the default is used."""

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=16384) as engine:
            return await design_layout(ENV, engine_proposer(engine, max_tokens=8))

    outcome = asyncio.run(main())
    assert (
        outcome.source == "fallback" and outcome.layout.name == "think-narrate" and len(outcome.attempts) == 2
    )
    assert not outcome.designed and all("not valid JSON" in str(a.issues[0]) for a in outcome.attempts)


# small bounds keep a random model's proposals short (it fills every string to its bound)
SMALL = ProposalBounds(name_chars=6, text_chars=12, stop_chars=2, items=2, blocks=2, coroutines=2, max_int=64)


def test_proposal_schema_bounds_and_shipped_layouts():
    schema = proposal_schema()
    assert max_chars(schema) > max_chars(proposal_schema(SMALL)) > 0
    # every trigger names its kind (the tag pydantic needs); no oneOf is left for the grammar compiler
    text = json.dumps(schema)
    assert "oneOf" not in text and "discriminator" not in text
    assert all("kind" in schema["$defs"][t]["required"] for t in ("StartTrigger", "ProbeTrigger"))
    import jsonschema

    for name in SHIPPED:  # the shipped layouts (the prompt's example among them) are valid proposals
        data = json.loads(shipped_text(name))
        jsonschema.validate(data, schema)
        assert len(json.dumps(data)) <= max_chars(schema)
    with pytest.raises(jsonschema.ValidationError):  # a trigger without its kind is not
        jsonschema.validate({**data, "coroutines": [{"name": "x", "role": "rule", "triggers": [{}]}]}, schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_designed_layouts_always_parse(hybrid_dir, seed):
    """Constrained by the layout's schema, a random model's proposals always parse into a Layout (its
    unconstrained answer is not even JSON); the outcome is a valid layout, the model's or the default."""

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=16384) as engine:
            block = engine.block("free")
            await engine.extend(block, design_prompt(ENV))
            free = await engine.generate([block], max_tokens=48, temperature=1.0, seed=seed).collect()
            engine.release(block)
            proposer = engine_proposer(engine, bounds=SMALL, temperature=1.0, seed=seed)
            return free.text, await design_layout(ENV, proposer)

    free, outcome = asyncio.run(main())
    assert parse(extract_json(free))[0] is None  # garbage without the constraint
    assert outcome.attempts
    for attempt in outcome.attempts:
        layout, issues = parse(extract_json(attempt.text))
        assert layout is not None and issues == [], (attempt.text, issues)
        assert len(attempt.text.encode()) <= max_chars(proposal_schema(SMALL))
    assert validate(outcome.layout) == []
    assert outcome.designed == (outcome.source != "fallback")


def test_runner_timer_and_done_triggers(hybrid_dir):
    layout = Layout.model_validate(
        {
            "name": "ticker",
            "task": "Count.",
            "blocks": [
                {"name": "ctx", "kind": "context"},
                {"name": "notes", "kind": "scratch", "max_tokens": 8},
            ],
            "coroutines": [
                {
                    "name": "tick",
                    "role": "probe",
                    "reads": ["ctx"],
                    "prompt": "Go on?",
                    "choices": ["Yes", "No"],
                    "triggers": [{"kind": "timer", "seconds": 0.05}],
                    "stop": {"max_runs": 3},
                    "output": True,
                },
                {
                    "name": "note",
                    "role": "generate",
                    "reads": ["ctx", "notes"],
                    "writes": "notes",
                    "triggers": [{"kind": "done", "coroutine": "tick"}],
                    "priority": {"class": "background", "weight": 3},
                    "stop": {"max_tokens": 3, "max_runs": 2},
                },
            ],
        }
    )

    async def main():
        async with cothink.Engine.from_pretrained(hybrid_dir, kv_tokens=4096) as engine:
            return await LayoutRunner(engine, layout).run(None, max_seconds=30)

    run = asyncio.run(main())
    # no input at all: the timer drives the probe three times, each end of it triggers the note (2 at most)
    assert run.runs == {"tick": 3, "note": 2}
    assert [o.coroutine for o in run.outputs] == ["tick"] * 3
