"""ShardedVQA: does a model that is already reasoning about a picture use a corrected picture swapped in?

Items come from `cothink.experiments.sharded_vqa_data`: a question with an exact answer, the corrected
picture, and a tampered twin that changes one fact so the answer changes. A thinker generates into its
own block ``thoughts``, reading the view ``[q, img, thoughts]``: ``q`` holds the system prompt and the
user's question, an image block holds the picture and the end of the user's turn (the question comes
first, then the picture). Conditions per item:

- ``clean``: the corrected picture from the start (upper reference);
- ``never``: the tampered picture, never corrected (lower reference);
- ``swap`` at k: after k thinking tokens over ``[q, img_bad, thoughts]`` the view becomes ``[q, img_good,
  thoughts]`` (the corrected picture was encoded in its own block under ``[q, img_good]``) and the thinker
  goes on: its block, and the memory of what it wrote while it saw the tampered picture, stay; nothing is
  re-encoded, and the model is not told that anything changed (docs/runtime.md, "Swapping an image");
- ``restart`` at k (the baseline): at k the thinker is stopped, its thoughts are dropped, and a fresh
  context [q, corrected picture] is encoded again; a new thinker starts from scratch.

Budget: every condition gets ``--max-tokens`` thinking tokens with the picture it ends with (swap and
restart: after the correction; the k tokens before it are extra). Then an answer cue is appended to the
thoughts and up to ``--answer-tokens`` tokens are generated greedily; the first number (counting and sum
questions) or colour word (colour questions) in them is the answer. Rows record whether it is the
corrected answer, whether it is the tampered one, the tokens generated and encoded, and the seconds from
the correction to the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cothink.experiments import harness
from cothink.experiments.harness import ExperimentConfig, Results, Row
from cothink.experiments.sharded_vqa_data import VQA_PX, VQAItem, VQASet, load_vqa, sharded_vqa
from cothink.experiments.streams import COLOURS

NAME = "sharded-vqa"
log = logging.getLogger("cothink.experiments.sharded_vqa")
CONDITIONS = ("clean", "never", "swap", "restart")
SHARDED = ("swap", "restart")  # the conditions with a shard point k
DEFAULT_STEPS = (16, 64)
SYSTEM = "You answer questions about pictures. Look carefully, reason briefly, then answer."
ANSWER_CUE = "\n\nFinal answer (one word or number):"
MARK = "\x00PICTURE\x00"


class VQAConfig(ExperimentConfig):
    data: str  # a ShardedVQA file, or "seed:S count:N px:P" for a generated set
    count: int  # items run
    px: int
    steps: list[int]  # shard points k (thinking tokens before the correction)
    conditions: list[str]
    answer_tokens: int


class VQARow(Row):
    item: str
    kind: str  # question kind (sharded_vqa_data.KINDS)
    condition: str  # clean | never | swap | restart
    k: int | None  # shard point (swap, restart)
    answer: str  # the corrected picture's answer
    tampered_answer: str
    said: str  # what the model wrote after the answer cue
    parsed: str | None  # the answer read from it
    correct: bool
    followed_tampered: bool  # answered the tampered picture's answer
    thinking_tokens: int  # all thinking tokens generated (before the correction too)
    tokens_encoded: int  # tokens written into memory by prefill (pictures' placeholders included)
    forward_passes: int
    seconds_after_correction: float  # from the correction (or the start) to the answer
    thoughts: str  # the thinking text (the last thinker's)


# ------------------------------------------------------------------------------------------ answers


def parse_answer(text: str, kind: str) -> str | None:
    """The first colour word (colour questions) or number (the others) in `text`."""
    if kind == "colour":
        found = re.search(r"\b(" + "|".join(COLOURS) + r")\b", text.lower())
    else:
        found = re.search(r"\d+", text)
    return found.group(0) if found else None


def cases(config: VQAConfig) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for condition in config.conditions:
        if condition in SHARDED:
            out += [(condition, k) for k in config.steps]
        else:
            out.append((condition, None))
    return out


# ---------------------------------------------------------------------------------------------- run


def _turn(chat: Any, item: VQAItem) -> tuple[str, str]:
    """The prompt around the picture: [system, user: question + "\\n"] and the user turn's end with the
    assistant's opener."""
    rendered = chat.render([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": item.question.text() + "\n" + MARK}],
                           generation_prompt=True)
    head, _, tail = rendered.partition(MARK)
    return head, tail


async def _picture(engine: Any, chat: Any, item: VQAItem, q: Any, which: str) -> Any:
    """A picture block ("good": the corrected picture, "bad": the tampered one), written under [q, it]:
    the picture, then the user turn's end."""
    block = engine.block(which)
    pixels = item.corrected if which == "good" else item.tampered
    await engine.extend(block, image=pixels, view=[q, block], name="context")
    await engine.extend(block, _turn(chat, item)[1], view=[q, block], name="context")
    return block


async def _context(
    engine: Any, chat: Any, item: VQAItem, pictures: Sequence[str]
) -> tuple[Any, dict[str, Any]]:
    """The question block q, and a picture block per name in `pictures`."""
    q = engine.block("q")
    await engine.extend(q, _turn(chat, item)[0], name="context")
    return q, {which: await _picture(engine, chat, item, q, which) for which in pictures}


async def _think(engine: Any, view: list[Any], tokens: int, seed: int) -> None:
    if tokens > 0:
        await engine.generate(view, max_tokens=tokens, name="thinker", seed=seed, stop_at_eos=False).collect()


async def _answer(engine: Any, view: list[Any], config: VQAConfig) -> str:
    thoughts = view[-1]
    await engine.extend(thoughts, ANSWER_CUE, view=view, name="thinker")
    result = await engine.generate(view, max_tokens=config.answer_tokens, name="thinker", stop=["\n"],
                                   seed=config.seed).collect()
    return result.text.strip()


def _encoded(engine: Any) -> int:
    return sum(s.tokens_written for s in engine.stats.values())


async def run_case(engine: Any, item: VQAItem, condition: str, k: int | None, config: VQAConfig) -> VQARow:
    """One item under one condition on a fresh running engine. The corrected picture of swap and
    restart is encoded at the shard point (it arrives then), inside the timed part."""
    from cothink.agents.chat import ChatFormat

    chat = ChatFormat(engine.tokenizer)
    passes = [0]
    engine.step_listeners.append(lambda record: passes.__setitem__(0, passes[0] + 1))
    first = "good" if condition == "clean" else "bad"
    q, blocks = await _context(engine, chat, item, [first])
    thoughts = engine.block("thoughts")
    if condition in SHARDED:
        await _think(engine, [q, blocks["bad"], thoughts], k or 0, config.seed)
    before = len(thoughts)
    t0 = time.perf_counter()  # the correction (clean and never: the start of thinking)
    if condition == "swap":  # the corrected picture, written under [q, good]; the thoughts stay
        good = await _picture(engine, chat, item, q, "good")
        view = [q, good, thoughts]
    elif condition == "restart":  # from scratch: a fresh context, a new thinker
        for block in (q, blocks["bad"], thoughts):
            engine.release(block)
        q, fresh = await _context(engine, chat, item, ["good"])
        thoughts = engine.block("thoughts-restart")
        view = [q, fresh["good"], thoughts]
    else:
        view = [q, blocks[first], thoughts]
    start = len(thoughts)
    await _think(engine, view, config.max_tokens, config.seed)
    generated = before + len(thoughts) - start
    text = engine.tokenizer.decode(list(thoughts.tokens))
    said = await _answer(engine, view, config)
    elapsed = time.perf_counter() - t0
    parsed = parse_answer(said, item.question.kind)
    return VQARow(
        item=item.id, kind=item.question.kind, condition=condition, k=k, answer=item.answer,
        tampered_answer=item.tampered_answer, said=said, parsed=parsed, correct=parsed == item.answer,
        followed_tampered=parsed == item.tampered_answer, thinking_tokens=generated,
        tokens_encoded=_encoded(engine), forward_passes=passes[0],
        seconds_after_correction=round(elapsed, 4), thoughts=text,
    )


async def run_item(handle: Any, item: VQAItem, condition: str, k: int | None, config: VQAConfig) -> VQARow:
    async with handle.engine(kv_tokens=16384) as engine:
        return await run_case(engine, item, condition, k, config)


# ------------------------------------------------------------------------------------------ summary


def _key(row: VQARow) -> str:
    return row.condition if row.k is None else f"{row.condition}@{row.k}"


def summarize(rows: Sequence[VQARow]) -> dict[str, Any]:
    """summary["clean" | "never" | "swap@k" | "restart@k"] = accuracy, share answering the tampered
    picture, mean thinking tokens, tokens encoded, forward passes and seconds after the correction."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(_key(r) for r in rows):
        rs = [r for r in rows if _key(r) == key]
        out[key] = {
            "items": len(rs),
            "accuracy": statistics.fmean(r.correct for r in rs),
            "tampered": statistics.fmean(r.followed_tampered for r in rs),
            "thinking_tokens": statistics.fmean(r.thinking_tokens for r in rs),
            "tokens_encoded": statistics.fmean(r.tokens_encoded for r in rs),
            "forward_passes": statistics.fmean(r.forward_passes for r in rs),
            "seconds_after_correction": statistics.fmean(r.seconds_after_correction for r in rs),
        }
    return out


def plot(path: Path, summary: dict[str, Any]) -> Path:
    """Accuracy (and share answering the tampered picture) per condition; tokens encoded per condition."""
    keys = list(summary)
    with harness.figure(path, 2) as (left, right):
        x = range(len(keys))
        left.bar([i - 0.2 for i in x], [summary[k]["accuracy"] for k in keys], width=0.4, label="correct")
        left.bar([i + 0.2 for i in x], [summary[k]["tampered"] for k in keys], width=0.4,
                 label="tampered answer")
        left.set_xticks(list(x), keys, rotation=30)
        left.set_ylim(0, 1)
        left.set_title("answers")
        left.legend(fontsize=8)
        right.bar(list(x), [summary[k]["tokens_encoded"] for k in keys])
        right.set_xticks(list(x), keys, rotation=30)
        right.set_title("tokens encoded per item")
    return path


def report(results: Results[VQAConfig, VQARow]) -> str:
    c = results.config
    lines = [
        "# ShardedVQA: a corrected picture swapped in mid-reasoning",
        "",
        f"Model: {c.model_description or c.model} ({c.dtype}); data {c.data}, {c.count} items, "
        f"{c.px} px pictures; shard points k = {', '.join(map(str, c.steps))} thinking tokens; "
        f"{c.max_tokens} thinking tokens after the correction, {c.answer_tokens} answer tokens. "
        f"Machine: {harness.machine_line(c.machine)}; wall {c.wall_s:.0f} s.",
        "",
        "These accuracies are evidence about the model only when it is a trained vision-language "
        "checkpoint; on random weights (the tests' tiny models) they measure nothing.",
        "",
        harness.markdown_table(
            ["condition", "items", "correct", "tampered answer", "thinking tokens", "tokens encoded",
             "forward passes", "s after correction"],
            [[k, e["items"], e["accuracy"], e["tampered"], e["thinking_tokens"], e["tokens_encoded"],
              e["forward_passes"], e["seconds_after_correction"]] for k, e in results.summary.items()],
        ),
        "",
        "![sharded vqa](sharded_vqa.png)",
        "",
    ]
    return "\n".join(lines)


FOLDER = harness.ResultsFolder(VQAConfig, VQARow, summarize, lambda results, out: report(results), plot,
                               "sharded_vqa.png")
save = FOLDER.save
render = FOLDER.render


# ---------------------------------------------------------------------------------------------- CLI


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=None,
                   help="a ShardedVQA file (python -m cothink.experiments.sharded_vqa_data); default: a set "
                        "generated from --seed")
    p.add_argument("--count", type=int, default=50, help="items of a generated set (default 50)")
    p.add_argument("--px", type=int, default=VQA_PX,
                   help=f"picture size of a generated set (default {VQA_PX})")
    p.add_argument("--steps", type=int, nargs="+", default=list(DEFAULT_STEPS),
                   help="shard points k: thinking tokens before the correction (default 16 64)")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    p.add_argument("--answer-tokens", type=int, default=6, help="most tokens of the answer (default 6)")


def build_config(args: argparse.Namespace, data: VQASet) -> VQAConfig:
    quick = bool(args.quick)
    generated = f"seed:{data.seed} count:{len(data.items)} px:{data.px}"
    source = str(args.data) if args.data is not None else generated
    count = len(data.items) if args.limit is None else min(args.limit, len(data.items))
    return VQAConfig(
        experiment=NAME, model=args.model, dtype=args.dtype, seed=args.seed, limit=args.limit, quick=quick,
        max_tokens=min(args.max_tokens, 8) if quick else args.max_tokens, threads=args.threads, data=source,
        count=count, px=data.px, steps=[min(k, 4) for k in args.steps[:1]] if quick else args.steps,
        conditions=args.conditions, answer_tokens=min(args.answer_tokens, 3) if quick else args.answer_tokens,
    )


def load_data(args: argparse.Namespace) -> VQASet:
    if args.data is not None:
        return load_vqa(args.data)
    count = min(args.count, 5) if args.quick else args.count  # quick: one item of each kind
    return sharded_vqa(args.seed, count, px=args.px)


def check_model(handle: Any, model: str) -> None:
    from cothink.errors import InvalidParameterError

    if handle.runner.vision is None:
        raise InvalidParameterError(
            f"sharded-vqa needs a vision model (a multimodal checkpoint with its vision tower); {model} "
            "has none",
            param="model")


def run_experiment(config: VQAConfig, data: VQASet, out: Path, *, show_progress: bool | None = None,
                   ) -> Results[VQAConfig, VQARow]:
    t0 = harness.begin(config)
    handle = harness.load_model(config.model, config.dtype)
    check_model(handle, config.model)
    config.model_description = handle.description
    items = data.items[: config.count]
    jobs = [(item, condition, k) for item in items for condition, k in cases(config)]
    rows: list[VQARow] = []
    results = None
    with harness.progress(len(jobs), "cases", enabled=show_progress) as advance:
        for item, condition, k in jobs:
            row = asyncio.run(run_item(handle, item, condition, k, config))
            rows.append(row)
            log.info("%s %s: %r -> %s", item.id, _key(row), row.said, "right" if row.correct else "wrong")
            config.wall_s = time.perf_counter() - t0
            results = save(out, config, rows, final=False)
            advance(1)
    config.wall_s = time.perf_counter() - t0
    return save(out, config, rows, final=True) if jobs else results  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data = load_data(args)
    config = build_config(args, data)
    results = run_experiment(config, data, args.out, show_progress=args.progress)
    print(report(results))
    print(f"results: {args.out / 'results.json'}")
    return 0


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="ShardedVQA: a corrected picture swapped in under a running thinker (swap vs restart vs never)",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
    default_max_tokens=128,
)
