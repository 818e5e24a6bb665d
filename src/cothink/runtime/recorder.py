"""Record a whole multi-coroutine run of an engine to a file, and replay it on a fresh engine.

`Recorder(engine, path)` stands in for the engine: the same calls (block, fork, truncate, seal, pin,
unpin, release, load, extend, generate, probe, start, stop; a generation's cancel, pause and resume)
are recorded, then passed on; everything else is the engine's own. `replay(path)` re-runs the file on a
fresh engine and checks every step's tokens and every probe's answer.

The file is JSON lines, append-only, flushed after every record:

- ``header``: the model identity (`ModelRunner.identity()`), where the model came from (when known),
  the dtype, the runner's memory geometry and the engine limits;
- ``image`` (hash, png): the pixels of an image or frame the run extended a block with, as a
  base64 PNG, written once per distinct image (by the SHA-256 of its PNG) before the first call that
  uses it; a call names its images by hash;
- ``call`` (seq, step, during, op, args): one per call, in the order they were made. `step` is the
  number of steps completed when the call was made; `during` tells whether step `step + 1` was
  running then. A call with during false lands before step `step + 1` is planned; with during true it
  lands while that step runs (a work it submits is first planned in step `step + 2`; a cancel drops
  the cancelled work's items of the running step). Blocks are named by keys the recorder hands out in
  creation order; a generation is named by the seq of its `generate` call;
- ``step`` (index, items, writes): after every step, which coroutines' items it carried (coroutine,
  kind, tokens) and the tokens every recorded block gained (block key, writer coroutine, start,
  token ids);
- ``submitted`` (call, step, during): when an image, clip or frame group extend handed its encoding
  to the scheduler (its pixels are prepared off the event loop first, so this comes some time after
  the call);
- ``answer`` (call, step, coroutine, answer): a probe's probabilities, with the step that answered it;
- ``error`` (call, step, coroutine, error): a call that raised (the error's type name).

Replay re-makes each call at the same point of the step sequence (a call with during false from a
step listener, before the next step is planned; one with during true while the next step runs: the
replaying engine runs every step off the event loop for it), so
every step is planned over the same works as in the recording, and compares each step record and
outcome as it comes. In float32 on the same machine a run replays identically; otherwise the report
names the first step that differs, its coroutine and both values.

Images, clips and frame groups are recorded as the RGB pixels the engine reads (a file path or
bytes is decoded once, by the recorder, and those pixels are what the engine gets), so a replay feeds
the same pixels. Their preparation runs off the event loop and takes its own time, so the replay also
fixes when each one's encoding reaches the scheduler: a step is not planned before the image extends
recorded as submitted before it are submitted again, and an encoding submitted earlier than recorded
is kept out of the steps before its recorded point (the replay wraps the engine's step policy).

What a recording cannot repeat: a token constraint (structured output) is refused at replay
(RecordingError); deadlines and `on_pool_full="wait"` timeouts depend on the clock and are not replayed.
A sampled generation given no seed is given one by the recorder (drawn at random, so the run stays
random and becomes replayable).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from PIL import Image

from cothink.errors import InvalidParameterError, RecordingError, RecordingMismatchError
from cothink.memory.block import Block
from cothink.models.image_processing import load_rgb
from cothink.runtime.engine import Engine, EngineLimits
from cothink.runtime.generation import Generation
from cothink.scheduler.accounting import StepRecord, WorkEvent
from cothink.scheduler.policy import Priority, PriorityClass, SchedulerConfig

__all__ = ["Difference", "Recorder", "ReplayReport", "load_recording", "replay", "replay_async"]

FORMAT = "cothink-recording"
VERSION = 1

Record = dict[str, Any]


# ---- recording ---------------------------------------------------------------------------------
class Recorder:
    """An engine that records every call, step and outcome to `path` (JSON lines; module docstring).

    Attach it before any block is made and use it wherever the engine would be used (agents, the
    server's `create_app`). `model` and `quantize` name how the engine's model was loaded, so that
    `cothink replay FILE` can load it again. `on_record` receives every record as it is written
    (`path` None: records go only there).
    """

    def __init__(
        self,
        engine: Engine,
        path: str | Path | None,
        *,
        model: str | Path | None = None,
        quantize: str | None = None,
        on_record: Callable[[Record], None] | None = None,
    ):
        self.engine = engine
        self.path = Path(path) if path is not None else None
        self._on_record = on_record
        self._file: TextIO | None = None
        if self.path is not None:
            try:
                self._file = self.path.open("w", encoding="utf-8")
            except OSError as exc:
                raise RecordingError(f"cannot write the recording {self.path}: {exc}") from None
        self._seq = 0
        self._keys: dict[int, int] = {}  # block id -> key
        self._blocks: dict[int, Block] = {}  # key -> block (live handles only)
        self._lengths: dict[int, int] = {}  # key -> length after the last step
        self._writers: dict[int, str] = {}  # key -> coroutine of its last extend or generate
        self._answers: list[tuple[str, tuple[tuple[str, float], ...], int]] = []
        self._images: set[str] = set()  # hashes of the images written to the recording
        self._encoding: dict[str, list[int]] = {}  # coroutine -> its image extends not yet submitted
        self.closed = False
        self._emit(_header(engine, model, quantize))
        engine.step_listeners.append(self._on_step)
        engine.work_listeners.append(self._on_work)

    # ---- delegation and lifecycle ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def __aenter__(self) -> Recorder:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        """Stop the engine (recorded), then close the file."""
        if not self.closed:
            self._call("stop", {})
        await self.engine.stop()
        self.close()

    def close(self) -> None:
        """Stop recording (the engine keeps running)."""
        if self.closed:
            return
        self.closed = True
        if self._on_step in self.engine.step_listeners:
            self.engine.step_listeners.remove(self._on_step)
        if self._on_work in self.engine.work_listeners:
            self.engine.work_listeners.remove(self._on_work)
        if self._file is not None:
            self._file.close()

    # ---- blocks ---------------------------------------------------------------------------------
    def block(self, name: str | None = None) -> Block:
        seq = self._call("block", {"name": name})
        with self._errors(seq):
            return self._track(self.engine.block(name), seq)

    def fork(self, block: Block, name: str | None = None) -> Block:
        seq = self._call("fork", {"block": self._key(block), "name": name})
        with self._errors(seq):
            return self._track(self.engine.fork(block, name), seq)

    def truncate(self, block: Block, n: int) -> None:
        key = self._key(block)
        with self._errors(self._call("truncate", {"block": key, "n": n})):
            self.engine.truncate(block, n)
        self._lengths[key] = len(block)

    def seal(self, block: Block) -> None:
        with self._errors(self._call("seal", {"block": self._key(block)})):
            self.engine.seal(block)

    def pin(self, block: Block) -> None:
        with self._errors(self._call("pin", {"block": self._key(block)})):
            self.engine.pin(block)

    def unpin(self, block: Block) -> None:
        with self._errors(self._call("unpin", {"block": self._key(block)})):
            self.engine.unpin(block)

    def release(self, block: Block) -> None:
        key = self._key(block)
        with self._errors(self._call("release", {"block": key})):
            self.engine.release(block)
        self._blocks.pop(key, None)

    def load(self, path: str | Path) -> list[Block]:
        """`Engine.load`, recorded by the snapshot's path: a replay reads the same file."""
        seq = self._call("load", {"path": str(Path(path).resolve())})
        with self._errors(seq):
            return [self._track(b, seq) for b in self.engine.load(path)]

    # ---- coroutine operations -------------------------------------------------------------------
    async def extend(
        self,
        block: Block,
        text: str | None = None,
        token_ids: list[int] | None = None,
        view: list[Block] | None = None,
        *,
        image: Any = None,
        video: Any = None,
        frames: Any = None,
        fps: float | None = None,
        timestamp: float | None = None,
        priority: Priority | str | None = None,
        name: str | None = None,
        deadline: Any = None,
    ) -> None:
        """`Engine.extend`, recorded; an image, clip or frame group by the hashes of its pixels
        (each distinct image is written to the recording once, as a PNG)."""
        name = _resolve_name(name)
        args: Record = {
            "block": self._key(block),
            "text": text,
            "token_ids": list(token_ids) if token_ids is not None else None,
            "view": self._keys_of(view) if view is not None else None,
            "priority": _priority_json(priority),
            "name": name,
        }
        visual: dict[str, Any] = {}
        for kind, value in (("image", image), ("video", video), ("frames", frames)):
            if value is not None:
                prepared = await asyncio.to_thread(_prepare, kind, value)
                visual[kind] = value if prepared is None else prepared.pixels
                args[kind] = None if prepared is None else self._image_refs(prepared)
        if fps is not None:
            args["fps"] = fps
        if timestamp is not None:
            args["timestamp"] = timestamp
        seq = self._call("extend", args)
        self._writers[args["block"]] = name
        if visual:
            self._encoding.setdefault(name, []).append(seq)
        try:
            await self._outcome(
                seq, name, self.engine.extend(
                    block, text, token_ids, view, fps=fps, timestamp=timestamp, priority=priority,
                    name=name, deadline=deadline, **visual,
                )
            )
        finally:
            if seq in self._encoding.get(name, ()):  # refused before its encoding was submitted
                self._encoding[name].remove(seq)

    def _image_refs(self, prepared: _Prepared) -> str | list[str]:
        """Write the images not yet in the recording; their hashes (one, or a list for frames)."""
        for digest, png in prepared.pngs:
            if digest not in self._images:
                self._images.add(digest)
                self._emit({"type": "image", "hash": digest, "png": base64.b64encode(png).decode("ascii")})
        refs = [digest for digest, _ in prepared.pngs]
        return refs if isinstance(prepared.pixels, list) else refs[0]

    def generate(self, view: list[Block] | Block, **kw: Any) -> Generation:
        """`Engine.generate`, recorded with its sampling parameters (a sampled generation without a
        seed gets a random one, so it can be replayed). A token constraint is recorded as present
        but cannot be replayed."""
        kw["name"] = _resolve_name(kw.get("name"))
        if kw.get("temperature", 0.0) > 0 and kw.get("seed") is None:
            kw["seed"] = random.getrandbits(62)
        keys = self._keys_of(view)
        args = {k: _jsonable(v) for k, v in kw.items() if k not in ("constraint", "deadline", "priority")}
        args["view"] = keys
        args["priority"] = _priority_json(kw.get("priority"))
        args["constraint"] = kw.get("constraint") is not None
        seq = self._call("generate", args)
        with self._errors(seq, kw["name"]):
            inner = self.engine.generate(view, **kw)
        self._writers[keys[-1]] = kw["name"]
        # cancel, pause and resume are recorded (also the implicit cancel when the task iterating it ends)
        inner.observe(lambda control: self._call(control, {"call": seq}))
        return inner

    async def probe(
        self,
        view: list[Block] | Block,
        question: str | list[int],
        choices: tuple[str, ...] | list[str] = ("yes", "no"),
        *,
        priority: Priority | str | None = None,
        name: str | None = None,
        deadline: Any = None,
    ) -> dict[str, float]:
        name = _resolve_name(name)
        args = {
            "view": self._keys_of(view),
            "question": question if isinstance(question, str) else list(question),
            "choices": list(choices),
            "priority": _priority_json(priority),
            "name": name,
        }
        seq = self._call("probe", args)
        answer = await self._outcome(
            seq, name, self.engine.probe(
                view, question, choices, priority=priority, name=name, deadline=deadline
            )
        )
        self._answer(seq, name, answer)
        return answer

    # ---- records --------------------------------------------------------------------------------
    def _emit(self, record: Record) -> None:
        if self.closed:
            return
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._on_record is not None:
            self._on_record(record)

    def _call(self, op: str, args: Record) -> int:
        """Record a call now (before it acts): its seq and its point in the step sequence."""
        self._seq += 1
        during = self.engine.occupancy().in_flight > 0
        self._emit({"type": "call", "seq": self._seq, "step": self.engine.steps, "during": during,
                    "op": op, "args": args})
        return self._seq

    async def _outcome(self, seq: int, name: str, call: Any) -> Any:
        """Await an extend or probe; record its error, or its cancellation by the caller."""
        try:
            with self._errors(seq, name):
                return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the caller was cancelled: the work with it
                self._call("cancel", {"call": seq})
            raise

    @contextlib.contextmanager
    def _errors(self, seq: int, name: str = "") -> Iterator[None]:
        """Record the error a call raises (then let it go on)."""
        try:
            yield
        except Exception as exc:
            self._error(seq, name, exc)
            raise

    def _error(self, seq: int, name: str, exc: BaseException) -> None:
        self._emit({"type": "error", "call": seq, "step": self.engine.steps, "coroutine": name,
                    "error": type(exc).__name__})

    def _answer(self, seq: int, name: str, answer: dict[str, float]) -> None:
        """A probe's answer, with the step that produced it (seen by the work listener)."""
        pairs = tuple(answer.items())
        step = self.engine.steps
        for i, (coroutine, got, at) in enumerate(self._answers):
            if coroutine == name and got == pairs:
                step = at
                del self._answers[i]
                break
        self._emit({"type": "answer", "call": seq, "step": step, "coroutine": name, "answer": answer})

    def _on_work(self, event: WorkEvent) -> None:
        if event.work == "encode" and event.event == "submit" and self._encoding.get(event.coroutine):
            seq = self._encoding[event.coroutine].pop(0)
            self._emit({"type": "submitted", "call": seq, "step": self.engine.steps,
                        "during": self.engine.occupancy().in_flight > 0})
        if event.work == "probe" and event.event == "finish" and event.answer:
            self._answers.append((event.coroutine, event.answer, self.engine.steps))

    def _on_step(self, record: StepRecord) -> None:
        writes = []
        for key, block in self._blocks.items():
            before, now = self._lengths.get(key, 0), len(block)
            if now != before:
                writes.append([key, self._writers.get(key, ""), before, list(block.tokens[before:now])])
                self._lengths[key] = now
        items = [[i.coroutine, i.kind, i.tokens] for i in record.items]
        self._emit({"type": "step", "index": record.index, "items": items, "writes": writes})

    # ---- block keys -----------------------------------------------------------------------------
    def _track(self, block: Block, seq: int) -> Block:
        key = len(self._keys) + 1
        self._keys[block.id] = key
        self._blocks[key] = block
        self._lengths[key] = len(block)
        block.owner = self  # `block.truncate(n)` goes through the recorder
        self._emit({"type": "block", "call": seq, "key": key, "name": block.name})
        return block

    def _key(self, block: Block) -> int:
        key = self._keys.get(getattr(block, "id", -1))
        if key is None or self._blocks.get(key) is not block:
            name = getattr(block, "name", block)
            raise RecordingError(f"block {name!r} is not a live block made through this recorder")
        return key

    def _keys_of(self, view: list[Block] | Block) -> list[int]:
        return [self._key(b) for b in ([view] if isinstance(view, Block) else view)]


def _header(engine: Engine, model: str | Path | None, quantize: str | None) -> Record:
    runner = engine.runner
    store = runner.store
    limits = asdict(engine.limits)
    limits["spill_dir"] = str(limits["spill_dir"]) if limits["spill_dir"] is not None else None
    policy = engine.limits.policy  # a function: recorded by its module and qualified name
    limits["policy"] = f"{policy.__module__}:{policy.__qualname__}"
    return {
        "type": "header",
        "format": FORMAT,
        "version": VERSION,
        "model": asdict(runner.identity()),
        "source": {"model": str(model) if model is not None else None, "quantize": quantize},
        "dtype": str(runner.dtype).removeprefix("torch."),
        "runner": {
            "kv_tokens": store.pool.num_pages * store.page_size,
            "page_size": store.page_size,
            "max_context": runner.max_context,
            "dense_summary_min_tokens": runner.dense_summary_min_tokens,
            "attention_backend": runner.backend.name,
        },
        "limits": limits,
    }


@dataclass(frozen=True)
class _Prepared:
    """An extend's image (one array) or frames (a list), as the engine reads them, and each image's
    (SHA-256, PNG)."""

    pixels: np.ndarray | list[np.ndarray]
    pngs: list[tuple[str, bytes]]


def _prepare(kind: str, value: Any) -> _Prepared | None:
    """The RGB pixels of an image (`kind` "image") or of each frame of a clip or frame group, and their
    PNGs; None when the input does not decode (the engine then refuses it). Runs off the event loop."""
    try:
        if kind == "image":
            pixels: np.ndarray | list[np.ndarray] = load_rgb(value, kind)
        else:
            if isinstance(value, np.ndarray) and value.ndim == 4:
                value = list(value)
            single = isinstance(value, (str, bytes, Path, Image.Image, np.ndarray))
            if single or not isinstance(value, Sequence):
                return None
            pixels = [load_rgb(frame, kind) for frame in value]
    except InvalidParameterError:
        return None
    pngs = [_png(p) for p in (pixels if isinstance(pixels, list) else [pixels])]
    return _Prepared(pixels, [(hashlib.sha256(png).hexdigest(), png) for png in pngs])


def _png(rgb: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="PNG")
    return out.getvalue()


def _unpng(data: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return np.array(image.convert("RGB"))


# bytes that no image decoder reads: replays a recorded call whose image did not decode
_UNDECODABLE = b"not an image"


def _resolve_name(name: str | None) -> str:
    """The coroutine name the engine would use (a task's name by default), fixed for the replay."""
    if name:
        return name
    task = asyncio.current_task()
    return task.get_name() if task is not None else "main"


def _priority_json(priority: Priority | str | None) -> Any:
    if isinstance(priority, Priority):
        return {"class": priority.klass.name.lower(), "weight": priority.weight}
    return priority


def _priority_of(value: Any) -> Priority | str | None:
    if isinstance(value, dict):
        return Priority(PriorityClass[value["class"].upper()], value["weight"])
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return value


# ---- reading -----------------------------------------------------------------------------------
@dataclass
class Recording:
    """A recording file, read: its header, calls (by seq), step records and outcomes."""

    header: Record
    calls: list[Record]
    steps: dict[int, Record]
    answers: dict[int, Record]  # call seq -> answer record
    errors: dict[int, Record]  # call seq -> error record
    blocks: dict[int, list[int]]  # call seq -> keys of the blocks it made
    images: dict[str, str] = field(default_factory=dict)  # hash -> base64 PNG
    submitted: dict[int, Record] = field(default_factory=dict)  # call seq -> when its encoding was submitted

    def pixels(self, refs: str | list[str] | None) -> Any:
        """A recorded call's image (a hash) or frames (a list of hashes) as RGB arrays; None (input
        that did not decode) as bytes that do not decode either."""
        if refs is None:
            return _UNDECODABLE
        try:
            if isinstance(refs, list):
                return [_unpng(self.images[r]) for r in refs]
            return _unpng(self.images[refs])
        except KeyError as exc:
            raise RecordingError(f"the recording lacks the image {exc.args[0]}") from None

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)


def load_recording(path: str | Path) -> Recording:
    """Read a recording; RecordingError if it is missing or not a cothink recording (a torn last
    line, as a killed process leaves, is dropped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RecordingError(f"cannot read the recording {path}: {exc}") from None
    records: list[Record] = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise RecordingError(f"{path}: line {n} is not a JSON record") from None
    if not records or records[0].get("type") != "header" or records[0].get("format") != FORMAT:
        raise RecordingError(f"{path} is not a cothink recording")
    if records[0].get("version") != VERSION:
        raise RecordingError(f"{path}: recording version {records[0].get('version')} (this is {VERSION})")
    rec = Recording(records[0], [], {}, {}, {}, {})
    for r in records[1:]:
        kind = r.get("type")
        if kind == "call":
            rec.calls.append(r)
        elif kind == "step":
            rec.steps[r["index"]] = r
        elif kind == "answer":
            rec.answers[r["call"]] = r
        elif kind == "error":
            rec.errors[r["call"]] = r
        elif kind == "block":
            rec.blocks.setdefault(r["call"], []).append(r["key"])
        elif kind == "image":
            rec.images[r["hash"]] = r["png"]
        elif kind == "submitted":
            rec.submitted[r["call"]] = r
    for call in rec.calls:
        if call["op"] == "generate" and call["args"].get("constraint"):
            raise RecordingError(
                f"{path}: call {call['seq']} generates under a token constraint, which a recording "
                "does not hold: it cannot be replayed"
            )
    return rec


# ---- replay ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    """Where a replay first departed from its recording."""

    step: int
    coroutine: str
    what: str  # "tokens", "items", "answer", "error", "steps"
    expected: Any
    actual: Any

    def describe(self) -> str:
        who = f" ({self.coroutine})" if self.coroutine else ""
        return (
            f"step {self.step}{who}: {self.what} differ: "
            f"recorded {self.expected!r}, replayed {self.actual!r}"
        )


@dataclass(frozen=True)
class ReplayReport:
    dtype: str
    recorded_steps: int
    replayed_steps: int
    calls: int
    first_difference: Difference | None

    @property
    def identical(self) -> bool:
        return self.first_difference is None

    def describe(self) -> str:
        head = f"{self.calls} calls, {self.recorded_steps} steps recorded ({self.dtype})"
        if self.first_difference is None:
            return f"{head}: replayed identically"
        return f"{head}: the replay differs at {self.first_difference.describe()}"


def replay(path: str | Path, engine: Engine | None = None, **load: Any) -> ReplayReport:
    """Replay a recording (synchronously); see `replay_async`."""
    return asyncio.run(replay_async(path, engine, **load))


async def replay_async(
    path: str | Path,
    engine: Engine | None = None,
    *,
    model: str | Path | None = None,
    device: str | torch.device = "cpu",
    idle_s: float = 1.0,
) -> ReplayReport:
    """Re-run a recording on `engine` (fresh: no blocks, not started; default: one loaded from the
    header's model, or `model`) and compare every step and outcome. Raises RecordingMismatchError if
    the engine's model or dtype is not the recording's. `idle_s`: how long a replay engine that has
    run out of work before the recording's last step is waited for before that is reported."""
    rec = load_recording(path)
    own = engine is None
    if engine is None:
        engine = _engine_for(rec, model, device)
    _check_identity(rec, engine, path)
    driver = _Replay(rec, engine, idle_s)
    try:
        return await driver.run()
    finally:
        if own or engine.running:
            await engine.stop()


def _engine_for(rec: Recording, model: str | Path | None, device: str | torch.device) -> Engine:
    from cothink.execution.runner import load_model

    source = model if model is not None else rec.header["source"]["model"]
    if source is None:
        raise RecordingError("the recording does not name its model: give one (cothink replay --model)")
    dtype = getattr(torch, rec.header["dtype"])
    quantize = rec.header["source"]["quantize"]
    runner = load_model(source, device, dtype, quantize=quantize, **rec.header["runner"])
    limits = dict(rec.header["limits"])
    scheduler = SchedulerConfig(**limits.pop("scheduler"))
    if "policy" in limits:
        limits["policy"] = _policy_of(limits["policy"])
    return Engine(runner, EngineLimits(scheduler=scheduler, **limits))


def _policy_of(name: str) -> Any:
    """The step policy a header names ("module:qualname"), imported."""
    import importlib

    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise RecordingError(f"the recording's step policy {name} cannot be imported: give an engine "
                             "built with it (replay(path, engine))") from None
    return found


def _check_identity(rec: Recording, engine: Engine, path: str | Path) -> None:
    mine, theirs = asdict(engine.runner.identity()), rec.header["model"]
    wrong = [k for k in theirs if mine.get(k) != theirs[k]]
    if wrong:
        raise RecordingMismatchError(
            f"{path} was recorded with another model or dtype ({', '.join(wrong)} differ: recorded "
            f"{theirs['family']}/{theirs['dtype']}, this engine {mine['family']}/{mine['dtype']})"
        )


@dataclass
class _Replay:
    """Drives a replay: makes each recorded call at its point, compares what the engine does."""

    rec: Recording
    engine: Engine
    idle_s: float
    observer: Recorder = field(init=False)
    blocks: dict[int, Block] = field(default_factory=dict)  # recorded key -> replay block
    generations: dict[int, Generation] = field(default_factory=dict)  # generate seq -> handle
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)  # call seq -> its task
    differences: list[Difference] = field(default_factory=list)
    points: dict[tuple[int, bool], list[Record]] = field(default_factory=dict)
    issued: int = 0
    ended: bool = False

    def __post_init__(self) -> None:
        self.observer = Recorder(self.engine, None, on_record=self._observe)
        # every step off the event loop, so a call the recording made while a step ran (`during`) can
        # be made while that step runs here too (a short step may run on the loop: scheduler.py)
        self.engine._scheduler.inline_step_s = 0.0
        for call in self.rec.calls:
            self.points.setdefault((call["step"], call["during"]), []).append(call)

    async def run(self) -> ReplayReport:
        gate = _EncodeGate.of(self.rec, self.engine)
        try:
            return await self._run()
        finally:
            gate.remove()

    async def _run(self) -> ReplayReport:
        self.engine.step_listeners.append(self._after_step)
        await self.engine.start()
        self._issue(0)
        idle_since: float | None = None
        loop = asyncio.get_running_loop()
        while not self.ended:
            await asyncio.sleep(0.002)
            if any(d.what in ("tokens", "items") for d in self.differences):
                break
            issued = self.issued == len(self.rec.calls)
            settled = all(t.done() for t in self.tasks.values()) or self.engine.steps > self.rec.last_step
            if issued and settled and (self.engine.steps >= self.rec.last_step or not self.engine.running):
                break
            occupancy = self.engine.occupancy()
            if occupancy.runnable or occupancy.in_flight or not self.engine.running:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since > self.idle_s and self.engine.steps < self.rec.last_step:
                self._differ(self.engine.steps + 1, "", "steps", self.rec.last_step, self.engine.steps)
                break
        self.ended = True
        self.observer.close()
        if self._after_step in self.engine.step_listeners:
            self.engine.step_listeners.remove(self._after_step)
        await self.engine.stop()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        first = min(self.differences, key=lambda d: d.step, default=None)
        return ReplayReport(
            self.rec.header["dtype"], self.rec.last_step, self.engine.steps, len(self.rec.calls), first
        )

    # ---- making the calls -----------------------------------------------------------------------
    def _after_step(self, record: StepRecord) -> None:
        if not self.ended:
            self._issue(record.index)

    def _issue(self, step: int) -> None:
        """Start the calls recorded at `step`: each in a task started now, in seq order. Tasks made
        here run their first part (where the call is made) before the scheduler plans the next
        step: the step loop yields to the event loop between steps, and the event loop runs ready
        tasks in the order they were made."""
        for call in self.points.get((step, False), ()):
            self.tasks[call["seq"]] = asyncio.create_task(self._make(call))
        for call in self.points.get((step, True), ()):
            self.tasks[call["seq"]] = asyncio.create_task(self._make(call, during=step))

    async def _make(self, call: Record, during: int | None = None) -> None:
        if during is not None:  # wait until step `during + 1` runs
            while not (self.engine.occupancy().in_flight or self.engine.steps > during or self.ended):
                await asyncio.sleep(0)
        self.issued += 1
        if self.ended:
            return
        seq, op, args = call["seq"], call["op"], call["args"]
        name = args.get("name") or "" if op in ("extend", "generate", "probe") else ""
        try:
            result = await self._do(seq, op, args)
        except asyncio.CancelledError:
            if self.ended:
                return
            raise
        except Exception as exc:
            self._compare_error(seq, name, exc)
            return
        self._compare_error(seq, name, None)
        if op == "probe" and not self.ended:
            expected = self.rec.answers.get(seq)
            if expected is not None and expected["answer"] != result:
                self._differ(expected["step"], args["name"], "answer", expected["answer"], result)

    async def _do(self, seq: int, op: str, args: Record) -> Any:
        o, b = self.observer, self.blocks
        if op in ("block", "fork", "load"):
            if op == "block":
                made = [o.block(args["name"])]
            elif op == "fork":
                made = [o.fork(b[args["block"]], args["name"])]
            else:
                made = o.load(args["path"])
            for key, block in zip(self.rec.blocks.get(seq, []), made):
                b[key] = block
            return made
        if op in ("truncate", "seal", "pin", "unpin", "release"):
            block = b[args["block"]]
            return o.truncate(block, args["n"]) if op == "truncate" else getattr(o, op)(block)
        if op == "extend":
            view = [b[k] for k in args["view"]] if args["view"] is not None else None
            visual = {k: self.rec.pixels(args[k]) for k in ("image", "video", "frames") if k in args}
            return await o.extend(
                b[args["block"]], args["text"], args["token_ids"], view, fps=args.get("fps"),
                timestamp=args.get("timestamp"), priority=_priority_of(args["priority"]),
                name=args["name"], **visual,
            )
        if op == "probe":
            question = args["question"]
            return await o.probe(
                [b[k] for k in args["view"]], question, tuple(args["choices"]),
                priority=_priority_of(args["priority"]), name=args["name"],
            )
        if op == "generate":
            kw = {k: v for k, v in args.items() if k not in ("view", "constraint", "priority")}
            kw["priority"] = _priority_of(args["priority"])
            self.generations[seq] = o.generate([b[k] for k in args["view"]], **kw)
            return None
        if op in ("cancel", "pause", "resume"):
            target = args["call"]
            if target in self.generations:
                return getattr(self.generations[target], op)()
            task = self.tasks.get(target)
            if op == "cancel" and task is not None:
                task.cancel()
            return None
        if op == "stop":
            self.ended = True
            await self.engine.stop()
            return None
        raise RecordingError(f"call {seq}: unknown operation {op!r}")

    # ---- comparing ------------------------------------------------------------------------------
    def _observe(self, record: Record) -> None:
        if record["type"] != "step" or self.ended:
            return
        index = record["index"]
        expected = self.rec.steps.get(index)
        if expected is None:
            return  # past the recording's last step (it was closed while the engine ran on)
        if expected["writes"] != record["writes"]:
            e, a = _first_write_difference(expected["writes"], record["writes"])
            who = (e or a)[1]
            self._differ(index, who, "tokens", e, a)
        elif expected["items"] != record["items"]:
            e, a = _first_difference(expected["items"], record["items"])
            self._differ(index, (e or a)[0], "items", e, a)

    def _compare_error(self, seq: int, name: str, exc: BaseException | None) -> None:
        if self.ended:
            return
        expected = self.rec.errors.get(seq)
        got = type(exc).__name__ if exc is not None else None
        want = expected["error"] if expected is not None else None
        if got != want:
            step = expected["step"] if expected is not None else self.engine.steps
            self._differ(step, name, "error", want, got)

    def _differ(self, step: int, coroutine: str, what: str, expected: Any, actual: Any) -> None:
        self.differences.append(Difference(step, coroutine, what, expected, actual))


@dataclass
class _EncodeGate:
    """The replay's hold on image encodings: wraps the engine's step policy so that every encoding
    is first planned where the recording's was possible, whenever the replay's pixel preparation ends.

    The recording says when each image extend's encoding was submitted (step s; during: while step
    s + 1 ran), so it could first be planned in step `s + 1 + during`. A coroutine's encodings are
    matched in order. Planning a step waits (an empty plan; the scheduler waits for the next
    submission) while an encoding due by then has not been submitted; one submitted before its
    recorded point is left out of the steps before it."""

    engine: Engine
    inner: Any  # the engine's own step policy
    due: dict[str, list[int]]  # coroutine -> first possible step of each of its encodings, in order
    submitted: dict[str, int] = field(default_factory=dict)  # coroutine -> encodings submitted so far
    seen: dict[str, int] = field(default_factory=dict)  # coroutine -> encodings the policy has seen
    index: dict[int, tuple[str, int]] = field(default_factory=dict)  # work seq -> (coroutine, its nth)

    @classmethod
    def of(cls, rec: Recording, engine: Engine) -> _EncodeGate:
        due: dict[str, list[int]] = {}
        for call in rec.calls:
            sub = rec.submitted.get(call["seq"])
            if sub is not None:
                due.setdefault(call["args"]["name"], []).append(sub["step"] + 1 + int(sub["during"]))
        scheduler = engine._scheduler  # the step policy the engine's scheduler calls
        gate = cls(engine, scheduler.policy, due)
        if due:
            scheduler.policy = gate
            engine.work_listeners.append(gate.on_work)
        return gate

    def remove(self) -> None:
        scheduler = self.engine._scheduler
        if scheduler.policy is self:
            scheduler.policy = self.inner
        if self.on_work in self.engine.work_listeners:
            self.engine.work_listeners.remove(self.on_work)

    def on_work(self, event: WorkEvent) -> None:
        if event.work == "encode" and event.event == "submit":
            self.submitted[event.coroutine] = self.submitted.get(event.coroutine, 0) + 1

    def __call__(self, works: list, cfg: SchedulerConfig, shares: Any, admit: Any) -> Any:
        from cothink.scheduler.policy import StepChoice

        step = self.engine.steps + 1  # the step being planned
        for w in sorted((w for w in works if w.kind == "encode" and w.seq not in self.index),
                        key=lambda w: w.seq):
            n = self.seen.get(w.coroutine, 0)
            self.index[w.seq] = (w.coroutine, n)
            self.seen[w.coroutine] = n + 1
        for coroutine, dues in self.due.items():
            if any(e <= step for e in dues[self.submitted.get(coroutine, 0):]):
                return StepChoice()  # an encoding due by this step is still being prepared
        allowed = [w for w in works if not self._early(w, step)]
        return self.inner(allowed, cfg, shares, admit)

    def _early(self, work: Any, step: int) -> bool:
        if work.kind != "encode":
            return False
        coroutine, n = self.index[work.seq]
        dues = self.due.get(coroutine, [])
        return n < len(dues) and dues[n] > step


def _first_difference(expected: list, actual: list) -> tuple[Any, Any]:
    for e, a in zip(expected, actual):
        if e != a:
            return e, a
    n = min(len(expected), len(actual))
    return (expected[n] if n < len(expected) else None), (actual[n] if n < len(actual) else None)


def _first_write_difference(expected: list, actual: list) -> tuple[Any, Any]:
    """The first differing write, by block key (a write: [key, coroutine, start, tokens])."""
    exp, act = {w[0]: w for w in expected}, {w[0]: w for w in actual}
    for key in sorted(exp.keys() | act.keys()):
        if exp.get(key) != act.get(key):
            return exp.get(key), act.get(key)
    return None, None
