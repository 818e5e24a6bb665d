"""Record and replay: a recorded multi-coroutine run re-runs identically on a fresh engine (fp32), and a
changed sampling seed is reported at the first step it changes, with its coroutine.

Two runs are recorded: the demo's coroutines (a thinker generating, a narrator probing and generating
over its blocks, the user's correction extended into ctx mid-run) on a tiny chat model, and a scripted
run on a tiny byte-level model with sampled generations (seeded), a probe, an extend into a block that
a running generation reads, a pause, a resume and a cancel. Engines run one torch thread: torch's CPU
kernels may round differently on another thread count.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import cothink
from cothink import cli
from cothink.errors import RecordingError, RecordingMismatchError
from cothink.runtime.recorder import Recorder, load_recording, replay_async
from cothink.scheduler import scheduler
from support import ids, make_engine, running_server, tiny_chat_model_dir, tiny_engine, tiny_folder, until


class _Quiet:
    """A demo display that keeps nothing."""

    def thinker(self, text: str) -> None: ...
    def narrator(self, text: str) -> None: ...
    def probe(self, sync: object) -> None: ...
    def user(self, text: str) -> None: ...
    def status(self, text: str) -> None: ...


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _scripted_run(eng: Recorder) -> None:
    """A thinker (sampled) and a dreamer (sampled; paused, resumed, cancelled) generate; a narrator
    probes the thinker's live block, then writes and generates over its own; the user extends ctx
    while both generations read it. The user's extend and the dreamer's cancel are made while a step
    runs."""
    ctx, thoughts, dream, notes = (eng.block(n) for n in ("ctx", "thoughts", "dream", "notes"))
    await eng.extend(ctx, token_ids=ids(24, 1), name="user")
    thinker = eng.generate([ctx, thoughts], max_tokens=40, temperature=1.0, seed=11, name="thinker")
    dreamer = eng.generate([ctx, dream], max_tokens=200, temperature=0.7, seed=5, name="dreamer")

    async def narrator() -> None:
        seen = 0
        async for piece in thinker:
            seen += len(piece.token_ids)
            if seen >= 8 and len(notes) == 0:
                await eng.probe([ctx, thoughts], "Answer:", (" yes", " no"), name="narrator")
                await eng.extend(notes, token_ids=ids(5, 2), view=[ctx, thoughts, notes], name="narrator")
                await eng.generate([ctx, thoughts, notes], max_tokens=6, name="narrator").collect()

    def running() -> bool:
        return eng.occupancy().in_flight > 0

    async def user() -> None:  # while a step runs: the extend is first planned in the step after it
        await until(lambda: len(thoughts) >= 12 and running())
        await eng.extend(ctx, token_ids=ids(6, 3), name="user")

    async def dreaming() -> None:
        await until(lambda: len(dream) >= 4)
        dreamer.pause()
        await until(lambda: len(thoughts) >= 24)
        dreamer.resume()
        await until(lambda: len(dream) >= 10 and running())
        dreamer.cancel()  # while a step runs: the dreamer's items of that step are dropped

    await asyncio.wait_for(asyncio.gather(narrator(), user(), dreaming()), 120)


async def _record_scripted(path: Path) -> None:
    async with Recorder(make_engine("llama", threads=1), path, model=tiny_folder("llama")) as eng:
        await _scripted_run(eng)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recording") / "scripted.jsonl"
    with pytest.MonkeyPatch.context() as mp:  # every step off the event loop: the user's calls land mid-step
        mp.setattr(scheduler, "INLINE_STEP_S", 0.0)
        asyncio.run(_record_scripted(path))
    return path


def _with_seed(src: Path, dst: Path, coroutine: str, seed: int) -> None:
    out = []
    for r in _records(src):
        if r["type"] == "call" and r["op"] == "generate" and r["args"]["name"] == coroutine:
            r["args"]["seed"] = seed
        out.append(json.dumps(r))
    dst.write_text("\n".join(out) + "\n")


def test_the_recording_holds_every_call_and_step(scripted):
    rec = load_recording(scripted)
    ops = [c["op"] for c in rec.calls]
    for op in ("block", "extend", "generate", "probe", "pause", "resume", "cancel", "stop"):
        assert op in ops, (op, ops)
    assert [c["seq"] for c in rec.calls] == list(range(1, len(rec.calls) + 1))
    points = [(c["step"], c["during"]) for c in rec.calls]
    assert [s for s, _ in points] == sorted(s for s, _ in points), "calls are in step order"
    user_extends = [c for c in rec.calls if c["op"] == "extend" and c["args"]["name"] == "user"]
    assert user_extends[1]["step"] > 0 and user_extends[1]["during"], "the user's extend lands mid-step"
    cancel = next(c for c in rec.calls if c["op"] == "cancel")
    assert cancel["during"], "the dreamer is cancelled while a step runs"
    assert sorted(rec.steps) == list(range(1, rec.last_step + 1))
    writers = {w[1] for s in rec.steps.values() for w in s["writes"]}
    assert {"thinker", "dreamer", "narrator", "user"} <= writers
    assert len(rec.answers) == 1 and set(next(iter(rec.answers.values()))["answer"]) == {" yes", " no"}
    header = rec.header
    assert header["dtype"] == "float32" and header["model"]["family"] == "llama"


async def test_a_recorded_run_replays_identically(scripted):
    report = await replay_async(scripted)
    assert report.identical, report.describe()
    assert report.replayed_steps == report.recorded_steps == load_recording(scripted).last_step


async def test_a_changed_seed_is_reported_at_its_first_step(scripted, tmp_path):
    changed = tmp_path / "changed.jsonl"
    _with_seed(scripted, changed, "thinker", 12)
    rec = load_recording(scripted)
    first_thinker_write = min(
        s["index"] for s in rec.steps.values() if any(w[1] == "thinker" for w in s["writes"])
    )
    report = await replay_async(changed)
    diff = report.first_difference
    assert diff is not None, report.describe()
    assert (diff.step, diff.coroutine, diff.what) == (first_thinker_write, "thinker", "tokens"), diff
    assert diff.expected != diff.actual
    assert f"step {first_thinker_write} (thinker)" in report.describe()


def test_cothink_replay_exit_codes(scripted, tmp_path, capsys):
    assert cli.main(["replay", str(scripted)]) == 0
    assert "replayed identically" in capsys.readouterr().out
    changed = tmp_path / "changed.jsonl"
    _with_seed(scripted, changed, "dreamer", 6)
    assert cli.main(["replay", str(changed)]) == 1
    out = capsys.readouterr().out
    assert "differs at step" in out and "(dreamer)" in out
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"type": "nothing"}\n')
    assert cli.main(["replay", str(junk)]) == 1
    assert "not a cothink recording" in capsys.readouterr().err


async def test_a_recording_of_another_model_is_refused(scripted):
    with pytest.raises(RecordingMismatchError, match="another model"):
        await replay_async(scripted, make_engine("qwen3"))


async def test_an_untracked_block_is_refused():
    engine = make_engine("llama")
    async with engine:
        rec = Recorder(engine, None)
        outside = engine.block("outside")
        with pytest.raises(RecordingError, match="outside"):
            await rec.extend(outside, token_ids=[1, 2])
        rec.close()


async def test_the_demo_replays_identically(tmp_path):
    from cothink.agents.demo import run_demo

    path = tmp_path / "demo.jsonl"
    async with Recorder(tiny_engine(threads=1), path, model=tiny_chat_model_dir()) as eng:
        await run_demo(eng, _Quiet(), max_tokens=24, narrate_every=6, interject_at=10, narration_tokens=6)
    rec = load_recording(path)
    names = {c["args"].get("name") for c in rec.calls if c["op"] in ("extend", "generate", "probe")}
    assert any("thinker" in str(n) for n in names) and any("narrator" in str(n) for n in names), names
    assert rec.answers, "the narrator probed"
    report = await replay_async(path)
    assert report.identical, report.describe()
    assert report.replayed_steps == rec.last_step > 0


def test_a_server_run_with_record_replays(tmp_path):
    path = tmp_path / "server.jsonl"
    engine = Recorder(tiny_engine(threads=1), path, model=tiny_chat_model_dir())
    with running_server(engine) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for seed in (1, 2):
                r = client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "Count: one two", "max_tokens": 8,
                    "temperature": 0.9, "seed": seed})
                assert r.status_code == 200, r.text
    rec = load_recording(path)
    assert [c["op"] for c in rec.calls].count("generate") == 2
    assert rec.calls[-1]["op"] == "stop"
    report = asyncio.run(replay_async(path))
    assert report.identical, report.describe()


def test_recorder_is_exported():
    assert cothink.Recorder is Recorder


# ---- images, clips and frame groups ------------------------------------------------------------------
def _pixels(h: int, w: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


async def _record_vision(path: Path, photo: Path) -> None:
    """Text, an image from a file and the same pixels again as an array, a two-frame clip, then live
    frame groups extended while a sampled generation reads their block (their pixels are prepared off
    the event loop, so when each one's encoding reaches the scheduler varies from run to run), a probe
    over all of it, and an image that does not decode (a tiny random-weight Qwen3.5 VL)."""
    from support import tiny_vision_folder

    folder = tiny_vision_folder("qwen35_vl")
    engine = cothink.Engine.from_pretrained(folder, threads=1, max_prefill_chunk=5)
    async with Recorder(engine, path, model=folder) as eng:
        ctx, pic, again, clip, stream, out = (
            eng.block(n) for n in ("ctx", "pic", "again", "clip", "stream", "out"))
        await eng.extend(ctx, token_ids=ids(6, 1), name="user")
        await eng.extend(pic, image=str(photo), view=[ctx, pic], name="user")
        import numpy as np
        from PIL import Image

        await eng.extend(again, image=np.array(Image.open(photo)), view=[ctx, pic, again], name="user")
        await eng.extend(clip, video=[_pixels(24, 24, 3), _pixels(24, 24, 4)], fps=2.0,
                         view=[ctx, pic, again, clip], name="user")
        view = [ctx, pic, again, clip, stream]
        await eng.extend(stream, frames=[_pixels(24, 24, 10), _pixels(24, 24, 20)], timestamp=0.0,
                         view=view, name="camera")
        thinker = eng.generate([*view, out], max_tokens=40, temperature=0.9, seed=3, stop_at_eos=False,
                               banned_token_ids=[296, 297, 298, 299], name="thinker")

        async def camera() -> None:
            for t in range(1, 4):
                await asyncio.sleep(0.003)
                await eng.extend(stream, frames=[_pixels(24, 24, 10 + t), _pixels(24, 24, 20 + t)],
                                 timestamp=0.5 * t, view=view, name="camera")

        await asyncio.gather(thinker.collect(), camera())
        await eng.probe([*view, out], "Answer:", (" yes", " no"), name="narrator")
        with pytest.raises(cothink.errors.InvalidParameterError):
            await eng.extend(out, image=b"\x89PNG broken", name="user")


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("vision-recording")
    photo = folder / "photo.png"
    Image.fromarray(_pixels(40, 16, 1)).save(photo)
    path = folder / "vision.jsonl"
    asyncio.run(_record_vision(path, photo))
    photo.unlink()  # the replay reads the pixels from the recording alone
    return path


def test_a_recorded_vision_run_replays_identically(vision_run):
    records = _records(vision_run)
    images = [r for r in records if r["type"] == "image"]
    # the photo (once, though extended twice), two clip frames, eight stream frames
    assert len(images) == 11 and len({r["hash"] for r in images}) == 11
    extends = [r for r in records if r["type"] == "call" and r["op"] == "extend"]
    assert extends[1]["args"]["image"] == extends[2]["args"]["image"] == images[0]["hash"]
    assert [e["args"].get("timestamp") for e in extends[4:8]] == [0.0, 0.5, 1.0, 1.5]
    assert extends[-1]["args"]["image"] is None
    rec = load_recording(vision_run)
    assert len(rec.answers) == 1 and len(rec.errors) == 1
    # every image extend but the one that did not decode reached the scheduler; frame groups did so
    # while the thinker's steps ran
    assert sorted(rec.submitted) == [e["seq"] for e in extends[1:8]]
    thinker_steps = {s["index"] for s in rec.steps.values() if any(i[0] == "thinker" for i in s["items"])}
    assert any(rec.submitted[e["seq"]]["step"] in thinker_steps for e in extends[5:8])
    report = asyncio.run(replay_async(vision_run))
    assert report.identical, report.describe()
    assert report.replayed_steps == rec.last_step > 0
    assert cli.main(["replay", str(vision_run)]) == 0


def test_other_pixels_are_reported_where_they_change_the_tokens(vision_run, tmp_path):
    """A stream frame's pixels replaced in the file: the replay departs at a reader of the frame."""
    import base64
    import io

    from PIL import Image

    records = _records(vision_run)
    frame = next(r for r in records if r["type"] == "call" and r["args"].get("frames"))["args"]["frames"][0]
    out = io.BytesIO()
    Image.fromarray(_pixels(24, 24, 99)).save(out, format="PNG")
    for r in records:
        if r["type"] == "image" and r["hash"] == frame:
            r["png"] = base64.b64encode(out.getvalue()).decode("ascii")
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = asyncio.run(replay_async(changed))
    assert report.first_difference is not None, report.describe()
    # the thinker reads the frame first; its tokens are sampled with the recorded seed, so a small change
    # of a random model's logits can leave every draw where it was (seen once in a recording made under
    # heavy load): then the next reader, the narrator's probe, is where the replay departs
    where = (report.first_difference.coroutine, report.first_difference.what)
    assert where in {("thinker", "tokens"), ("narrator", "answer")}, report.describe()
