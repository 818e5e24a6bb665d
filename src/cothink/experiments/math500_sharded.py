"""MATH-500-Sharded: does a thinker use a condition that arrives while it is already reasoning?

Each MATH-500 problem is split into an incomplete statement (``partial``) and the missing condition
(``supplement``). A thinker coroutine generates into its own block, reading the view
``[ctx, thoughts]``; ctx holds the system prompt and the user's turn(s). Conditions per problem:

- ``full``: the whole problem up front (upper reference);
- ``partial``: the supplement never arrives (lower reference);
- ``insert`` at step k: after k reasoning steps the supplement is appended to ctx as a new user turn
  (``engine.extend(ctx, ...)``) while the thinker keeps generating: its block, and the memory of what it
  wrote, stay; from the next engine step on it reads the supplement *before* its own thoughts in the view;
- ``restart`` at step k (the text-passing baseline): at step k the thinker is stopped, and a fresh context
  [system, partial, supplement] + the thoughts' *text* so far is encoded again, then it continues.

A step is a line of reasoning (a newline ending a non-empty line) or ``--step-tokens`` (32) tokens
without one, whichever comes first. Budget: every condition gets ``--max-tokens`` thinking tokens *with
the information it will ever have*: full and partial from the start, insert and restart after the
supplement (tokens written before it are extra), so the k axis measures the effect of having committed
to k steps of reasoning without the condition, not a smaller budget. When the thinking holds no
``\\boxed{...}``, an answer cue (``Final answer: $\\boxed{``) is appended to the thinker's block and up to
``--answer-tokens`` more are generated. The last boxed answer is compared with the reference answer by
``math-verify``.

Splitter (deterministic, ``split_problem``): the statement is cut into sentences (never inside ``$...$``
or ``\\[...\\]``); formatting instructions ("Express your answer...", "Enter ...") are kept in the
partial statement; the question is the last sentence that asks (ends with "?" or starts with What,
Find, Compute, ...). The supplement is the first other sentence that states something mathematical (has
math or a digit). Single-sentence problems of the form "If <condition>, <question>" give the "If"
clause. Anything else cannot be split: it is listed in the results and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cothink.experiments import harness
from cothink.experiments.harness import ExperimentConfig, Results, Row

NAME = "math500-sharded"
DEFAULT_DATA = Path("../shared/data/math500/test.jsonl")
DEFAULT_STEPS = (0, 1, 2, 4, 8)
CONDITIONS = ("full", "partial", "insert", "restart")
Condition = Literal["full", "partial", "insert", "restart"]
SYSTEM = (
    "You are a careful math solver. Reason step by step, one step per line, "
    "and put the final answer in \\boxed{}."
)
SUPPLEMENT_PREFIX = "Additional information for the problem: "
ANSWER_CUE = "\n\nFinal answer: $\\boxed{"

# ------------------------------------------------------------------------------------------- data


class Shard(BaseModel):
    """One problem split in two; the ``--shards`` / ``--write-shards`` JSONL format, one object a line."""

    model_config = ConfigDict(extra="ignore")

    unique_id: str
    partial: str
    supplement: str
    answer: str


@dataclass(frozen=True)
class Problem:
    unique_id: str
    problem: str
    answer: str


def load_problems(path: Path) -> list[Problem]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Problem(d["unique_id"], d["problem"], d["answer"]))
    return out


def read_shards(path: Path) -> list[Shard]:
    return [Shard.model_validate_json(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_shards(path: Path, shards: Sequence[Shard]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(s.model_dump_json() + "\n" for s in shards))
    return path


# --------------------------------------------------------------------------------------- splitter

_QUESTION_START = re.compile(
    r"^(what|which|who|how|find|compute|determine|evaluate|simplify|solve|calculate|show|prove|convert|"
    r"give|list|let\b.*\bfind|is|are|does|do|can|in how many)\b",
    re.IGNORECASE,
)
_FORMAT_START = re.compile(r"^(express|enter|write your|give your|round|your answer|separate)", re.IGNORECASE)
_IF_START = re.compile(r"^(if|given that|given|suppose that|suppose|assume that|assume)\s", re.IGNORECASE)


def _sentences(text: str) -> list[str]:
    """Sentences of a statement; boundaries are never inside $...$, $$...$$ or \\[...\\]."""
    out, cur, i, math = [], [], 0, None  # math: the closing delimiter while inside math
    n = len(text)
    while i < n:
        c = text[i]
        if math is None:
            if text.startswith("$$", i):
                math, step = "$$", 2
            elif c == "$":
                math, step = "$", 1
            elif text.startswith("\\[", i):
                math, step = "\\]", 2
            elif text.startswith("[asy]", i):  # Asymptote figures: code, never sentences
                math, step = "[/asy]", 5
            else:
                step = 1
                cur.append(c)
                at_end = i + 1 >= n or text[i + 1].isspace()
                if (c in ".?!" and at_end) or text.startswith("\n\n", i):
                    out.append("".join(cur))
                    cur = []
                i += step
                continue
            cur.append(text[i : i + step])
            i += step
            continue
        if text.startswith(math, i):
            cur.append(math)
            i += len(math)
            inner = "".join(cur).rstrip("$]\\").rstrip()
            # "...$x = 3.$  Next" or "\\[...\\]Find": the sentence ended inside the math
            if inner.endswith((".", "?", "!")) and (i >= n or text[i].isspace() or math == "\\]"):
                out.append("".join(cur))
                cur = []
            math = None
            continue
        cur.append(c)
        i += 1
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


def _is_question(s: str) -> bool:
    return s.rstrip().endswith("?") or bool(_QUESTION_START.match(s))


def _has_math(s: str) -> bool:
    if "[asy]" in s:  # a figure is not a condition that can be stated in words
        return False
    return "$" in s or "\\[" in s or any(ch.isdigit() for ch in s)


def _top_level_comma(s: str) -> int:
    """Index of the first comma outside math, or -1."""
    math = None
    i = 0
    while i < len(s):
        if math is None:
            if s.startswith("$$", i):
                math, i = "$$", i + 2
                continue
            if s[i] == "$":
                math, i = "$", i + 1
                continue
            if s[i] == ",":
                return i
        elif s.startswith(math, i):
            i += len(math)
            math = None
            continue
        i += 1
    return -1


def split_problem(unique_id: str, problem: str, answer: str) -> Shard | None:
    """Split a problem into (partial, supplement), or None when no condition can be removed."""
    sents = _sentences(problem)
    formatting = [s for s in sents if _FORMAT_START.match(s)]
    content = [s for s in sents if s not in formatting]
    if not content:
        return None
    asks = [i for i, s in enumerate(content) if _is_question(s)]
    q = asks[-1] if asks else len(content) - 1
    for i, s in enumerate(content):
        if i != q and _has_math(s) and not _is_question(s):
            partial = " ".join(x for x in sents if x != s)
            return Shard(unique_id=unique_id, partial=partial, supplement=s, answer=answer)
    question = content[q]
    if _IF_START.match(question):
        comma = _top_level_comma(question)
        clause, rest = question[:comma].strip(), question[comma + 1 :].strip()
        if comma > 0 and _has_math(clause) and rest:
            rest = rest[0].upper() + rest[1:]
            partial = " ".join(rest if x == question else x for x in sents)
            return Shard(unique_id=unique_id, partial=partial, supplement=clause + ".", answer=answer)
    return None


def build_shards(problems: Sequence[Problem]) -> tuple[list[Shard], list[str]]:
    """(shards, unique ids that could not be split), in the data's order."""
    shards, skipped = [], []
    for p in problems:
        s = split_problem(p.unique_id, p.problem, p.answer)
        (shards.append(s) if s is not None else skipped.append(p.unique_id))
    return shards, skipped


# ---------------------------------------------------------------------------------------- scoring


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth, out = start + len("\\boxed{"), 1, []
    while i < len(text):
        c = text[i]
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return "".join(out).strip()
        out.append(c)
        i += 1
    return None


def cued_answer(generated: str) -> str:
    """The answer written after ANSWER_CUE (which opened the box): up to the brace that closes it."""
    depth, out = 1, []
    for c in generated:
        depth += (c == "{") - (c == "}")
        if depth == 0:
            break
        out.append(c)
    return "".join(out).strip()


def _math_verify() -> Any:
    """The optional `math_verify` package (the ``experiments`` extra) that scores the answers."""
    return harness.optional_import("math_verify", "MATH-500-Sharded scoring")


def is_correct(answer: str | None, gold: str) -> bool:
    if not answer:
        return False
    math_verify = _math_verify()
    try:
        gold_parsed, answer_parsed = (math_verify.parse(f"$\\boxed{{{x}}}$") for x in (gold, answer))
        return bool(math_verify.verify(gold_parsed, answer_parsed))
    except Exception:  # math-verify raises on latex it cannot parse: that answer is not verified
        return False


# ---------------------------------------------------------------------------------------- records


class MathConfig(ExperimentConfig):
    data: str | None = None
    shards_file: str | None = None
    steps: list[int] = list(DEFAULT_STEPS)
    conditions: list[str] = list(CONDITIONS)
    step_tokens: int = 32
    answer_tokens: int = 16
    concurrency: int = 2
    kv_tokens: int = 32768
    problems: int = 0
    skipped: list[str] = []


class MathRow(Row):
    unique_id: str
    condition: Condition
    k: int | None
    correct: bool
    answer: str | None
    gold: str
    tokens_generated: int
    tokens_encoded: int
    forward_passes: int
    seconds: float
    # when the supplement arrived: thinker tokens / steps written before it (insert, restart)
    supplement_after_tokens: int | None = None
    supplement_after_steps: int | None = None
    thinking_finish: str = ""  # stop | length | cancelled (the thinking generation's finish reason)
    answer_cued: bool = False  # the answer came from the answer cue, not from the thinking


# ------------------------------------------------------------------------------------- one case


class StepCounter:
    """Counts reasoning steps in a stream: a newline ending a non-empty line, or `step_tokens` tokens."""

    def __init__(self, step_tokens: int):
        self.step_tokens = step_tokens
        self.steps = 0
        self._line = ""
        self._tokens = 0

    def feed(self, text: str, n_tokens: int) -> None:
        self._tokens += n_tokens
        for ch in text:
            if ch == "\n":
                if self._line.strip():
                    self.steps += 1
                    self._tokens = 0
                self._line = ""
            else:
                self._line += ch
        if self._tokens >= self.step_tokens:
            self.steps += 1
            self._tokens = 0
            self._line = ""


@dataclass
class _Thinker:
    """What one case's thinker has written so far."""

    text: str = ""
    tokens: int = 0
    finish: str = ""


@dataclass
class _Case:
    """One (problem, condition, k) on a running engine: its blocks, its thinker, when the supplement
    arrived. All its works are named after the row."""

    engine: Any
    shard: Shard
    cfg: MathConfig
    name: str
    fmt: Any  # ChatFormat
    before: list[dict[str, str]]  # [system, the problem as first given]
    supplement: dict[str, str]
    supplement_text: str  # the supplement as a chat turn, as it goes into ctx
    blocks: list[Any]  # [ctx, thoughts]: the thinker reads both and writes into thoughts
    counter: StepCounter
    th: _Thinker = field(default_factory=_Thinker)
    after_tokens: int | None = None
    after_steps: int | None = None

    @property
    def ctx(self) -> Any:
        return self.blocks[0]

    @property
    def thoughts(self) -> Any:
        return self.blocks[-1]

    def take(self, text: str, n_tokens: int) -> None:
        """Account for a streamed piece of thinking."""
        self.th.tokens += n_tokens
        self.th.text += text
        self.counter.feed(text, n_tokens)

    def mark_supplement(self) -> None:
        self.after_tokens, self.after_steps = self.th.tokens, self.counter.steps

    async def add_supplement(self) -> None:
        await self.engine.extend(self.ctx, self.supplement_text, name=self.name, priority="interactive")

    async def think(self, budget: int, until_step: int | None) -> bool:
        """Generate into the thoughts block; returns True when it stopped at `until_step` (the generation
        is cancelled there), False when it finished (EOS or budget)."""
        gen = self.engine.generate(self.blocks, max_tokens=budget, name=self.name, seed=self.cfg.seed)
        async for piece in gen:
            self.take(piece.text, len(piece.token_ids))
            if until_step is not None and self.counter.steps >= until_step:
                gen.cancel()
                self.th.finish = "cancelled"
                return True
        assert gen.result is not None
        self.th.finish = gen.result.finish_reason
        return False

    async def supplement_first(self, condition: Condition) -> None:
        """full, partial, or k == 0: one generation (insert/restart at 0: the supplement is there first)."""
        if condition in ("insert", "restart"):
            await self.add_supplement()
            self.after_tokens = self.after_steps = 0
        await self.think(self.cfg.max_tokens, None)

    async def insert_at(self, k: int) -> None:
        """Think until step k; at step k the supplement goes into ctx *while the thinker keeps going*."""
        cfg = self.cfg
        gen = self.engine.generate(
            self.blocks, max_tokens=cfg.max_tokens + k * cfg.step_tokens, name=self.name, seed=cfg.seed
        )
        insert_live: asyncio.Task | None = None
        budget_end: int | None = None
        async for piece in gen:
            self.take(piece.text, len(piece.token_ids))
            if insert_live is None and self.counter.steps >= k:
                self.mark_supplement()
                insert_live = asyncio.create_task(self.add_supplement())
                budget_end = self.th.tokens + cfg.max_tokens
            if budget_end is not None and self.th.tokens >= budget_end:
                gen.cancel()
                break
        if gen.result is not None and gen.result.finish_reason != "cancelled":
            self.th.finish = gen.result.finish_reason
        else:
            self.th.finish = "length"
        if insert_live is None:  # it finished before step k: the supplement arrives after, then continue
            self.mark_supplement()
            await self.add_supplement()
            await _reopen(self.engine, self.fmt, self.thoughts, self.blocks, self.name, self.th)
            await self.think(cfg.max_tokens, None)
        else:
            await insert_live

    async def restart_at(self, k: int) -> None:
        """Think until step k, then text passing: a fresh context [system, partial, supplement] + the
        thoughts so far, re-encoded, and think on."""
        engine, fmt, name = self.engine, self.fmt, self.name
        await self.think(k * self.cfg.step_tokens, k)  # stops at step k (or ends earlier)
        self.mark_supplement()
        for b in self.blocks:
            engine.release(b)
        self.blocks = [engine.block(f"{name}/ctx2"), engine.block(f"{name}/thoughts2")]
        await engine.extend(self.ctx, fmt.conversation([*self.before, self.supplement]), name=name)
        carried = fmt.assistant_opener([*self.before, self.supplement]) + self.th.text
        if carried:
            await engine.extend(self.thoughts, carried, view=self.blocks, name=name)
        await self.think(self.cfg.max_tokens, None)

    async def final_answer(self) -> tuple[str | None, bool]:
        """The boxed answer in the thinking, else one cued after it; (answer, cued)."""
        answer = extract_boxed(self.th.text)
        if answer is not None:
            return answer, False
        await self.engine.extend(self.thoughts, ANSWER_CUE, view=self.blocks, name=self.name)
        res = await self.engine.generate(
            self.blocks, max_tokens=self.cfg.answer_tokens, stop=["}$"], name=self.name, seed=self.cfg.seed
        ).collect()
        self.th.tokens += len(res.token_ids)
        return cued_answer(res.text) or None, True


async def _open_case(
    engine: Any, shard: Shard, full_problem: str, condition: Condition, k: int | None, cfg: MathConfig
) -> _Case:
    """The case's blocks, with the conversation so far read (and the assistant turn opened)."""
    from cothink.agents.chat import ChatFormat

    fmt = ChatFormat(engine.tokenizer)
    name = f"{shard.unique_id}|{condition}|{k}"
    system = {"role": "system", "content": SYSTEM}
    user = {"role": "user", "content": full_problem if condition == "full" else shard.partial}
    before = [system, user]
    supplement = {"role": "user", "content": SUPPLEMENT_PREFIX + shard.supplement}
    supplement_text = fmt.turn(before, supplement)
    opener = fmt.assistant_opener(before)
    case = _Case(
        engine,
        shard,
        cfg,
        name,
        fmt,
        before=before,
        supplement=supplement,
        supplement_text=supplement_text,
        blocks=[engine.block(f"{name}/ctx"), engine.block(f"{name}/thoughts")],
        counter=StepCounter(cfg.step_tokens),
    )
    await engine.extend(case.ctx, fmt.conversation(case.before), name=name)
    if opener:
        await engine.extend(case.thoughts, opener, view=case.blocks, name=name)
    return case


async def run_case(
    engine: Any, shard: Shard, full_problem: str, condition: Condition, k: int | None, cfg: MathConfig
) -> MathRow:
    """One (problem, condition, k) on a running engine; all its works are named after the row."""
    t0 = time.perf_counter()
    case = await _open_case(engine, shard, full_problem, condition, k, cfg)
    try:
        if condition in ("full", "partial") or k == 0:
            await case.supplement_first(condition)
        elif condition == "insert":
            assert k is not None
            await case.insert_at(k)
        else:  # restart
            assert k is not None
            await case.restart_at(k)
        answer, cued = await case.final_answer()
    finally:
        for b in case.blocks:
            engine.release(b)
    stats = engine.stats[case.name]
    th = case.th
    return MathRow(
        unique_id=shard.unique_id,
        condition=condition,
        k=k,
        correct=is_correct(answer, shard.answer),
        answer=answer,
        gold=shard.answer,
        tokens_generated=th.tokens,
        tokens_encoded=stats.tokens_written - th.tokens,
        forward_passes=stats.forward_passes,
        seconds=round(time.perf_counter() - t0, 3),
        supplement_after_tokens=case.after_tokens,
        supplement_after_steps=case.after_steps,
        thinking_finish=th.finish,
        answer_cued=cued,
    )


async def _reopen(engine: Any, fmt: Any, thoughts: Any, view: list[Any], name: str, th: _Thinker) -> None:
    """After the thinker ended its turn, open a new assistant turn in its block (through the template)."""
    if th.finish == "stop":
        await engine.extend(thoughts, fmt.reopen(), view=view, name=name)


# ---------------------------------------------------------------------------------------- the run


def cases(cfg: MathConfig) -> list[tuple[Condition, int | None]]:
    out: list[tuple[Condition, int | None]] = []
    for c in cfg.conditions:
        if c in ("full", "partial"):
            out.append((c, None))  # type: ignore[arg-type]
        else:
            out.extend((c, k) for k in cfg.steps)  # type: ignore[misc]
    return out


async def run_all(
    engine: Any,
    shards: Sequence[Shard],
    full_text: dict[str, str],
    cfg: MathConfig,
    advance: Callable[[int], None] = lambda n=1: None,
    on_problem: Callable[[list[MathRow]], None] | None = None,
) -> list[MathRow]:
    """Every case of every shard; `cfg.concurrency` problems at a time, all cases of a problem together."""
    problems = _Problems(
        engine, full_text, cfg, advance, on_problem, gate=asyncio.Semaphore(cfg.concurrency), plan=cases(cfg)
    )
    per = await asyncio.gather(*(problems.solve(s) for s in shards))
    return [r for rows in per for r in rows]


@dataclass
class _Problems:
    """Runs problems for `run_all`: the gate that bounds how many run at once, and the rows done so far."""

    engine: Any
    full_text: dict[str, str]
    cfg: MathConfig
    advance: Callable[[int], None]
    on_problem: Callable[[list[MathRow]], None] | None
    gate: asyncio.Semaphore
    plan: list[tuple[Condition, int | None]]
    done: list[MathRow] = field(default_factory=list)  # rows of the problems finished so far (partial saves)

    async def solve(self, shard: Shard) -> list[MathRow]:
        """All the cases of one problem, together."""
        async with self.gate:
            full = self.full_text.get(shard.unique_id) or f"{shard.partial} {shard.supplement}"
            rows = await asyncio.gather(
                *(run_case(self.engine, shard, full, c, k, self.cfg) for c, k in self.plan)
            )
            self.done.extend(rows)
            self.advance(1)
            if self.on_problem is not None:
                self.on_problem(list(self.done))
            return list(rows)


def summarize(rows: Sequence[MathRow]) -> dict[str, dict[str, float]]:
    """summary[condition][k or "-"] = accuracy."""
    acc: dict[str, dict[str, list[bool]]] = {}
    for r in rows:
        acc.setdefault(r.condition, {}).setdefault("-" if r.k is None else str(r.k), []).append(r.correct)
    return {c: {k: round(sum(v) / len(v), 4) for k, v in by.items()} for c, by in acc.items()}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def cost_table(rows: Sequence[MathRow]) -> list[tuple[str, str, int, float, float, float, float, float]]:
    """(condition, k, n, accuracy, encoded, generated, forward passes, seconds) per group, in order."""
    groups: dict[tuple[str, str], list[MathRow]] = {}
    for r in rows:
        groups.setdefault((r.condition, "-" if r.k is None else str(r.k)), []).append(r)
    order = {c: i for i, c in enumerate(CONDITIONS)}
    out = []
    for (c, k), rs in sorted(
        groups.items(), key=lambda kv: (order[kv[0][0]], -1 if kv[0][1] == "-" else int(kv[0][1]))
    ):
        out.append(
            (
                c,
                k,
                len(rs),
                _mean([r.correct for r in rs]),
                _mean([r.tokens_encoded for r in rs]),
                _mean([r.tokens_generated for r in rs]),
                _mean([r.forward_passes for r in rs]),
                _mean([r.seconds for r in rs]),
            )
        )
    return out


def plot(results: Results[MathConfig, MathRow], path: Path) -> Path:
    table = cost_table(results.rows)
    ks = results.config.steps
    panels = []
    for col, ylabel, title in (
        (3, "accuracy", "accuracy vs insertion step k"),
        (4, "encoded tokens per problem", "tokens encoded vs k"),
    ):
        series = []
        for cond in ("insert", "restart"):
            pts = [(int(t[1]), t[col]) for t in table if t[0] == cond]
            if pts:
                series.append(harness.Series(cond, [p[0] for p in pts], [p[1] for p in pts]))
        for cond in ("full", "partial"):
            flat = [t[col] for t in table if t[0] == cond]
            if flat:
                series.append(harness.Series(f"{cond} (no k)", None, flat))
        panels.append(harness.Panel(title, "k (reasoning steps before the supplement)", ylabel, series))
    cfg = results.config
    title = f"MATH-500-Sharded, {cfg.model}, {cfg.problems} problems, max {cfg.max_tokens} tokens, k={ks}"
    return harness.plot_lines(path, panels, title)


def report(results: Results[MathConfig, MathRow], plot_name: str = "math500_sharded.png") -> str:
    cfg = results.config
    table = cost_table(results.rows)
    # accuracy as a count with its Wilson 95 % interval: a few problems' difference is within it
    rows = [(c, k, harness.format_proportion(round(acc * n), n), enc, gen, fp, s)
            for c, k, n, acc, enc, gen, fp, s in table]
    mid = [
        r for r in results.rows if r.condition == "insert" and r.k and r.supplement_after_steps is not None
    ]
    on_time = sum(1 for r in mid if r.supplement_after_steps == r.k)
    cued = sum(r.answer_cued for r in results.rows)
    lines = [
        f"# MATH-500-Sharded: {cfg.model}",
        "",
        f"- model: {cfg.model_description or cfg.model} ({cfg.dtype})",
        f"- problems: {cfg.problems} split ({len(cfg.skipped)} of the first problems read could not be split "
        f"and were skipped), conditions {', '.join(cfg.conditions)}, k in {cfg.steps}",
        f"- thinking budget {cfg.max_tokens} tokens after the information arrives (step = a line or "
        f"{cfg.step_tokens} tokens), answer cue {cfg.answer_tokens} tokens, seed {cfg.seed}, "
        f"{cfg.concurrency} problems at a time",
        f"- machine: {harness.machine_line(cfg.machine)}, "
        f"{cfg.machine.get('torch_threads', '?')} torch threads; "
        f"run took {cfg.wall_s / 60:.1f} min, started {cfg.started_at}",
        *filter(None, [harness.parts_line(cfg, "problems")]),
        f"- insertions mid-generation at exactly step k: {on_time} of {len(mid)} insert rows with k > 0 "
        "(the rest: the thinker finished before step k; the supplement came after)",
        f"- answers from the answer cue (no \\boxed in the thinking): {cued} of {len(results.rows)} rows",
        "",
        f"![accuracy and encoded tokens vs k]({plot_name})",
        "",
        "Per condition and k (means per problem; seconds are wall time with all cases of "
        f"{cfg.concurrency} problems sharing the engine's batches):",
        "",
        harness.markdown_table(
            [
                "condition",
                "k",
                "correct (share, 95% CI)",
                "tokens encoded",
                "tokens generated",
                "forward passes",
                "seconds",
            ],
            rows,
        ),
        "",
        *_reading(results, table),
        "",
        "Caveats:",
        "",
        "- Small models solve few MATH problems; with a short thinking budget most answers come from the "
        "answer cue. Read the curves' shape and the costs, not the absolute accuracy.",
        "- The splitter is a heuristic: the removed sentence is a stated condition, but not always one the "
        "problem cannot be solved without (then `partial` stays close to `full`).",
        "- `insert` and `restart` at k=0 are the same computation by construction (nothing to re-encode); "
        "a difference between them is floating-point noise of batched decoding flipping a greedy choice; "
        "its paired counts show how far that noise alone moves a comparison.",
        "- The paired p-values are per k: with five k's tested, one below 0.05 by chance is not unlikely "
        "(to hold across all five at 0.05, a p-value must be below 0.01).",
        "- `tokens encoded` = tokens the engine wrote for the row minus the sampled ones: the prompt, the "
        "supplement, the answer cue, for `restart` the re-encoded thoughts, and a one-token re-read when a "
        "generation starts on a view whose last write was not its last block (k=0). Thinking before the "
        "supplement is extra budget.",
        "- Rows of several problems share engine steps, so `seconds` is a wall time under batching on a "
        "shared machine; forward passes are per row (`engine.stats`).",
    ]
    return "\n".join(lines)


def _accuracy_with_count(
    acc: dict[tuple[str, str], float], n: dict[tuple[str, str], int], key: tuple[str, str]
) -> str:
    return f"{acc[key]:.3f} ({round(acc[key] * n[key])}/{n[key]})"


def _reading(results: Results[MathConfig, MathRow], table: list[Any]) -> list[str]:
    """A few sentences computed from the table: accuracy (with counts) and the encoding cost of each k."""
    acc = {(t[0], t[1]): t[3] for t in table}
    enc = {(t[0], t[1]): t[4] for t in table}
    n = {(t[0], t[1]): t[2] for t in table}
    frac = functools.partial(_accuracy_with_count, acc, n)
    out = ["Reading (correct answers are counts of a few problems: differences of one or two are noise):", ""]
    if ("full", "-") in acc and ("partial", "-") in acc:
        out.append(f"- accuracy: full {frac(('full', '-'))}, partial {frac(('partial', '-'))}")
    for k in results.config.steps:
        key_i, key_r = ("insert", str(k)), ("restart", str(k))
        if key_i in acc and key_r in acc:
            only_i, only_r = _discordant(results.rows, "insert", "restart", k)
            extra = round(enc[key_r] - enc[key_i])  # round first: a fraction of a token below 0 reads "+0"
            out.append(
                f"- k={k}: insert {frac(key_i)} vs restart {frac(key_r)}; encoded tokens per problem "
                f"{enc[key_i]:.0f} (insert) vs {enc[key_r]:.0f} (restart, {extra:+d} "
                f"re-encoded); paired: only insert right on {only_i} problems, only restart on {only_r} "
                f"(exact McNemar p = {harness.paired_p_value(only_i, only_r):.2g})"
            )
    return out


def _discordant(rows: Sequence[MathRow], a: Condition, b: Condition, k: int) -> tuple[int, int]:
    """Over the problems that ran both conditions at step k: how many only `a` got right, only `b`."""
    correct_a = {r.unique_id: r.correct for r in rows if r.condition == a and r.k == k}
    correct_b = {r.unique_id: r.correct for r in rows if r.condition == b and r.k == k}
    both = correct_a.keys() & correct_b.keys()
    return (sum(correct_a[u] and not correct_b[u] for u in both),
            sum(correct_b[u] and not correct_a[u] for u in both))


# -------------------------------------------------------------------------------------------- CLI


def _steps(text: str) -> list[int]:
    try:
        steps = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError("steps: comma-separated integers, e.g. 0,1,2,4,8") from e
    if not steps or steps[0] < 0:
        raise argparse.ArgumentTypeError("steps must be >= 0")
    return steps


def _conditions(text: str) -> list[str]:
    out = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in out if c not in CONDITIONS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"conditions: a comma-separated subset of {','.join(CONDITIONS)}")
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"MATH-500 test.jsonl (default: {DEFAULT_DATA} when it exists)",
    )
    p.add_argument(
        "--shards",
        type=Path,
        default=None,
        help="JSONL of {unique_id, partial, supplement, answer} to use instead of the splitter",
    )
    p.add_argument(
        "--write-shards",
        type=Path,
        default=None,
        help="write the built-in split (all splittable problems read) to this JSONL and exit",
    )
    p.add_argument(
        "--steps", type=_steps, default=list(DEFAULT_STEPS), help="insertion steps k (default: 0,1,2,4,8)"
    )
    p.add_argument(
        "--conditions",
        type=_conditions,
        default=list(CONDITIONS),
        help="subset of full,partial,insert,restart (default: all)",
    )
    p.add_argument("--step-tokens", type=int, default=32, help="tokens that make a step without a newline")
    p.add_argument("--answer-tokens", type=int, default=16, help="tokens for the answer cue (default 16)")
    p.add_argument("--concurrency", type=int, default=2, help="problems run at once (default 2)")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV pool size in tokens (default 32768)")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="engine step token budget (default 256)")
    p.add_argument("--save-every", type=int, default=5, help="write partial results every N problems")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in OUT: keep its finished problems, run the rest (its result-changing "
        "settings must match; concurrency and threads may differ)",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite report.md and the plot from the existing OUT/results.json and exit",
    )


def _resolve_data(args: argparse.Namespace) -> Path | None:
    if args.data is not None:
        return args.data
    return DEFAULT_DATA if DEFAULT_DATA.exists() else None


def select(args: argparse.Namespace) -> tuple[list[Shard], dict[str, str], list[str]]:
    """(shards to run, full problem text by id, ids skipped by the splitter among those read)."""
    data = _resolve_data(args)
    problems = load_problems(data) if data is not None else []
    full_text = {p.unique_id: p.problem for p in problems}
    if args.shards is not None:
        shards, skipped = read_shards(args.shards), []
    elif problems:
        shards, skipped = build_shards(problems)
    else:
        raise SystemExit("math500-sharded: give --data PATH to MATH-500 test.jsonl (or --shards FILE)")
    limit = 2 if args.quick and args.limit is None else args.limit
    if limit is not None:
        shards = shards[:limit]
        # skipped problems among those read up to the last one used
        if shards and not args.shards:
            order = [p.unique_id for p in problems]
            last = order.index(shards[-1].unique_id)
            skipped = [u for u in skipped if order.index(u) < last]
    return shards, full_text, skipped


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    console = Console(stderr=True)
    if args.render_only:
        return _render_only(Path(args.out), console)
    if args.write_shards is not None:
        return _write_builtin_shards(args, console)
    _math_verify()  # before any generation: a missing extra fails at once
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.max_tokens = min(args.max_tokens, 24)
        args.steps = [k for k in args.steps if k <= 2] or [0]
    shards, full_text, skipped = select(args)
    cfg = _config(args, shards, skipped)
    kept = _resumed_rows(Path(args.out), cfg, shards) if args.resume else []
    handle = harness.load_model(args.model, args.dtype)
    cfg.model_description = handle.description
    cfg.machine = harness.machine_info()
    torch.manual_seed(args.seed)
    writer = _ResultsWriter(
        cfg,
        Path(args.out),
        shards,
        console,
        kept=kept,
        save_every=args.save_every,
        show_progress=args.progress if args.progress is not None else console.is_terminal,
    )
    done = {r.unique_id for r in kept}
    todo = [s for s in shards if s.unique_id not in done]
    rows = asyncio.run(_run_on_engine(handle, args, todo, full_text, writer))
    results = writer.save(rows, final=True)
    console.print(
        f"{NAME}: {len(shards)} problems, {len(rows)} rows in {cfg.wall_s:.0f}s -> {writer.out}/results.json"
    )
    for c, by in results.summary.items():
        console.print(f"  {c:8s} " + "  ".join(f"k={k}: {v:.2f}" for k, v in by.items()))
    return 0


# the config fields that change what a row measures: a resumed run must keep them
RESULT_FIELDS = (
    "model",
    "dtype",
    "seed",
    "quick",
    "max_tokens",
    "shards_file",
    "steps",
    "conditions",
    "step_tokens",
    "answer_tokens",
)


def _resumed_rows(out: Path, cfg: MathConfig, shards: Sequence[Shard]) -> list[MathRow]:
    """The saved rows of the problems a resumed run has finished, among those selected now."""
    rows = harness.resume(
        out, cfg, MathRow, unit=lambda r: r.unique_id, rows_per_unit=len(cases(cfg)), same=RESULT_FIELDS
    )
    selected = {s.unique_id for s in shards}
    return [r for r in rows if r.unique_id in selected]


def _render_only(out: Path, console: Any) -> int:
    """Re-render the plot and the report from a results folder's results.json."""
    results = harness.read_results(out / "results.json", MathConfig, MathRow)
    plot(results, out / "math500_sharded.png")
    harness.write_report(out, report(results))
    console.print(f"rendered {out}/report.md and {out}/math500_sharded.png")
    return 0


def _write_builtin_shards(args: argparse.Namespace, console: Any) -> int:
    data = _resolve_data(args)
    if data is None:
        raise SystemExit("math500-sharded: --write-shards needs --data")
    shards, skipped = build_shards(load_problems(data))
    write_shards(args.write_shards, shards)
    console.print(f"wrote {len(shards)} shards to {args.write_shards}; {len(skipped)} problems not split")
    return 0


def _config(args: argparse.Namespace, shards: list[Shard], skipped: list[str]) -> MathConfig:
    return MathConfig(
        experiment=NAME,
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        limit=args.limit,
        quick=args.quick,
        max_tokens=args.max_tokens,
        threads=args.threads,
        data=str(args.data) if args.data else None,
        shards_file=str(args.shards) if args.shards else None,
        steps=args.steps,
        conditions=args.conditions,
        step_tokens=args.step_tokens,
        answer_tokens=args.answer_tokens,
        concurrency=args.concurrency,
        kv_tokens=args.kv_tokens,
        problems=len(shards),
        skipped=skipped,
        started_at=harness.now_utc(),
    )


class _ResultsWriter:
    """Writes results.json, the plot and the report: every `save_every` problems (so that partial
    results survive an interrupted run) and at the end."""

    def __init__(
        self,
        cfg: MathConfig,
        out: Path,
        shards: Sequence[Shard],
        console: Any,
        *,
        kept: Sequence[MathRow] = (),
        save_every: int,
        show_progress: bool,
    ):
        self.cfg, self.out, self.console = cfg, out, console
        self.kept = list(kept)  # rows of the problems a resumed run had finished before
        self.save_every, self.show_progress = save_every, show_progress
        self.total = len(shards)
        # rows in a stable order (problem, then case), whatever order the cases finished in
        self.order = {sh.unique_id: i for i, sh in enumerate(shards)}
        self.case_order = {c: i for i, c in enumerate(cases(cfg))}
        self.t0 = time.perf_counter()

    def save(self, rows: list[MathRow], final: bool) -> Results[MathConfig, MathRow]:
        cfg = self.cfg
        rows = sorted(
            [*self.kept, *rows], key=lambda r: (self.order[r.unique_id], self.case_order[(r.condition, r.k)])
        )
        cfg.wall_s = round(time.perf_counter() - self.t0, 1)
        cfg.problems = len({r.unique_id for r in rows}) if not final else self.total
        results = Results[MathConfig, MathRow](config=cfg, rows=rows, summary=summarize(rows))
        harness.write_results(self.out, results)
        plot(results, self.out / "math500_sharded.png")
        harness.write_report(self.out, report(results))
        return results

    def on_problem(self, rows: list[MathRow]) -> None:
        n = len({r.unique_id for r in [*self.kept, *rows]})
        if not self.show_progress:
            self.console.print(
                f"{NAME}: {n}/{self.total} problems done, {time.perf_counter() - self.t0:.0f}s"
            )
        if n % self.save_every == 0 and n < self.total:
            self.save(rows, final=False)


async def _run_on_engine(
    handle: Any,
    args: argparse.Namespace,
    shards: list[Shard],
    full_text: dict[str, str],
    writer: _ResultsWriter,
) -> list[MathRow]:
    engine = handle.engine(kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens)
    async with engine:
        with harness.progress(len(shards), f"{NAME} ({args.model})", enabled=writer.show_progress) as advance:
            return await run_all(engine, shards, full_text, writer.cfg, advance, writer.on_problem)


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="mid-reasoning insertion on MATH-500 split into a partial statement and a supplement",
    description=__doc__.split("\n")[0] + " Conditions full, partial, insert@k (the supplement appended to "
    "the context the thinker reads, live), restart@k (text-passing baseline). Writes results.json, "
    "report.md and an accuracy/cost plot.",
    configure=configure,
    run=run,
    default_max_tokens=160,
)
