"""User-supplied workloads for `cothink eval --script FILE`: timed events run against one engine.

A script is a JSON or YAML document:

    name: barge-in on a long think          # optional, shown in the report
    events:
      - {at: 0.0, op: start, coroutine: thinker, text: "Plan a week of meals.", priority: background}
      - {at: 0.0, op: generate, coroutine: thinker, max_tokens: 128}
      - {at: 0.4, op: start, coroutine: user, text: "Actually, no fish."}
      - {at: 0.5, op: probe, coroutine: user, reads: [thinker, user], question: " Any fish?",
         choices: [" yes", " no"]}
      - {at: 0.6, op: extend, coroutine: user, text: " And cheap."}
      - {at: 0.7, op: generate, coroutine: user, reads: [thinker, user], max_tokens: 16}

Operations (`at`: seconds after the script starts, events need not be sorted):
- `start`: create the coroutine's block (`text`, optional, is read into it; `chat: true` wraps it in
  the model's chat template). A coroutine exists from its `start` on; each name starts once.
- `extend`: append `text` to the coroutine's block.
- `generate`: generate up to `max_tokens` into the coroutine's block (greedy, `stop_at_eos`).
- `probe`: choice probabilities of `choices` after `question`, read over `reads`.
`reads` (extend, generate, probe): the view, coroutine names whose blocks are read, the written block
last (default: the coroutine's own block). `priority`: `interactive` or `background` (default: the
engine's default for the operation).

Every event of one coroutine runs in order (an event waits for the coroutine's previous one, as one
coroutine of an application would); events of different coroutines run concurrently. An event is
measured from its scheduled time: `lag_s` (scheduled -> submitted, non-zero when the coroutine was
still busy), `first_s` (submitted -> first token, generations), `done_s` (submitted -> finished).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cothink.errors import InvalidParameterError

Op = Literal["start", "extend", "generate", "probe"]


class ScriptEvent(BaseModel):
    """One timed event of a workload script."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float = Field(ge=0, description="seconds after the script starts")
    op: Op
    coroutine: str = Field(min_length=1)
    text: str | None = None
    chat: bool = False
    reads: tuple[str, ...] | None = None
    max_tokens: int = Field(default=32, ge=1, le=4096)
    question: str | None = None
    choices: tuple[str, ...] = (" yes", " no")
    priority: Literal["interactive", "background"] | None = None

    @model_validator(mode="after")
    def _fields_fit_the_op(self) -> ScriptEvent:
        if self.op == "extend" and not self.text:
            raise ValueError("an 'extend' event needs a non-empty 'text'")
        if self.op == "probe":
            if not self.question:
                raise ValueError("a 'probe' event needs a 'question'")
            if not self.choices or len(set(self.choices)) != len(self.choices):
                raise ValueError("a 'probe' event needs distinct, non-empty 'choices'")
        if self.op == "start" and self.reads is not None:
            raise ValueError("a 'start' event reads only its own block: drop 'reads'")
        if self.reads is not None and self.op != "probe" and self.reads[-1:] != (self.coroutine,):
            raise ValueError(
                f"'reads' of a {self.op!r} event must end with its own coroutine {self.coroutine!r}"
            )
        return self


class Script(BaseModel):
    """A workload script: a name and its timed events."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "script"
    events: tuple[ScriptEvent, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _coroutines_exist_when_used(self) -> Script:
        started: dict[str, float] = {}
        for i, e in enumerate(self.events):
            if e.op == "start":
                if e.coroutine in started:
                    raise ValueError(f"events[{i}]: coroutine {e.coroutine!r} is started twice")
                started[e.coroutine] = e.at
        for i, e in enumerate(self.events):
            for name in (e.coroutine, *(e.reads or ())):
                if name not in started:
                    raise ValueError(f"events[{i}]: coroutine {name!r} is never started")
                if started[name] > e.at:
                    raise ValueError(
                        f"events[{i}] at {e.at} s uses coroutine {name!r} before its start "
                        f"at {started[name]} s"
                    )
        return self

    @property
    def duration_s(self) -> float:
        return max(e.at for e in self.events)


def load_script(path: str | Path) -> Script:
    """Read and validate a script (JSON, or YAML for .yaml / .yml); InvalidParameterError says where
    it is wrong."""
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as exc:
        raise InvalidParameterError(f"--script {path}: {exc.strerror or exc}", param="script") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        else:
            data = json.loads(raw)
    except Exception as exc:
        raise InvalidParameterError(
            f"--script {path}: not valid {path.suffix[1:] or 'JSON'}: {exc}", param="script"
        ) from None
    try:
        return Script.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        ]
        raise InvalidParameterError(
            f"--script {path} is not a valid workload script:\n" + "\n".join(lines), param="script"
        ) from None


@dataclass(frozen=True, slots=True)
class EventResult:
    """One event as it ran: a row of the scripted workload's table (seconds)."""

    index: int  # position in the script
    at: float
    op: str
    coroutine: str
    lag_s: float  # scheduled -> submitted (the coroutine's previous event was still running)
    first_s: float | None  # submitted -> first token (generate)
    done_s: float | None  # submitted -> finished; None when it failed
    tokens: int  # tokens read (start, extend) or generated (generate); 0 for a probe
    outcome: str  # "ok" or the error's type and message
    answer: str = ""  # a probe's most likely choice, a generation's text


async def run_script(model: Any, engine: Any, script: Script, timeout_s: float = 600.0) -> list[EventResult]:
    """Run every event on the (started) engine; returns one result per event, in script order.
    A failing event is recorded (its outcome names the error), the coroutine's later events still run."""
    blocks: dict[str, Any] = {}
    started: dict[str, asyncio.Event] = {
        e.coroutine: asyncio.Event() for e in script.events if e.op == "start"
    }
    results: dict[int, EventResult] = {}
    t0 = time.perf_counter()

    async def one(i: int, e: ScriptEvent) -> None:
        await asyncio.sleep(max(0.0, t0 + e.at - time.perf_counter()))
        for name in (e.coroutine, *(e.reads or ())):
            if e.op != "start":
                await started[name].wait()  # a coroutine's start reads its text first
        submitted = time.perf_counter()
        lag, first, tokens, answer = submitted - (t0 + e.at), None, 0, ""
        try:
            if e.op == "start":
                blocks[e.coroutine] = engine.block(e.coroutine)
                ids = (model.chat(e.text) if e.chat else model.encode(e.text)) if e.text else []
                if ids:
                    await engine.extend(
                        blocks[e.coroutine], token_ids=ids, name=e.coroutine, priority=e.priority
                    )
                tokens = len(ids)
            elif e.op == "extend":
                ids = model.encode(e.text or "")
                view = [blocks[n] for n in e.reads] if e.reads else None
                await engine.extend(
                    blocks[e.coroutine], token_ids=ids, view=view, name=e.coroutine, priority=e.priority
                )
                tokens = len(ids)
            elif e.op == "generate":
                view = [blocks[n] for n in e.reads] if e.reads else blocks[e.coroutine]
                out: list[int] = []
                async for piece in engine.generate(
                    view, max_tokens=e.max_tokens, name=e.coroutine, priority=e.priority
                ):
                    if first is None and piece.token_ids:
                        first = time.perf_counter() - submitted
                    out.extend(piece.token_ids)
                tokens, answer = len(out), model.tokenizer.decode(out, skip_special_tokens=True)
            else:
                view = [blocks[n] for n in (e.reads or (e.coroutine,))]
                probs = await engine.probe(
                    view, e.question or "", e.choices, name=e.coroutine, priority=e.priority
                )
                answer = max(probs, key=probs.__getitem__)
            outcome, done = "ok", time.perf_counter() - submitted
        except Exception as exc:  # recorded: the script's check reports it
            outcome, done = f"{type(exc).__name__}: {exc}", None
        finally:
            if e.op == "start":
                started[e.coroutine].set()
        results[i] = EventResult(i, e.at, e.op, e.coroutine, lag, first, done, tokens, outcome, answer)

    async def coroutine_events(name: str) -> None:
        for i, e in sorted(
            ((i, e) for i, e in enumerate(script.events) if e.coroutine == name),
            key=lambda x: (x[1].at, x[0]),
        ):
            await one(i, e)

    names = list(dict.fromkeys(e.coroutine for e in script.events))
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(coroutine_events(n) for n in names))
    except TimeoutError:
        pass  # events that never finished are reported as such below
    finally:
        for block in blocks.values():
            engine.release(block)
    return [
        results.get(i)
        or EventResult(
            i,
            e.at,
            e.op,
            e.coroutine,
            float("nan"),
            None,
            None,
            0,
            f"did not finish within {timeout_s:.0f} s",
        )
        for i, e in enumerate(script.events)
    ]
