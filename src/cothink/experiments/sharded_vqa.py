"""ShardedVQA: does a model that is already reasoning about a picture use a corrected picture swapped in?

Pairs come from `cothink.experiments.sharded_vqa_data`: a question with an exact answer, the corrected
picture, and a tampered twin that changes one fact so the answer changes; generated from a seed, or read
from a pairs file (``--pairs-file``). A thinker generates into its
own block ``thoughts``, reading the view ``[q, img, thoughts]``: ``q`` holds the system prompt and the
user's question, an image block holds the picture and the end of the user's turn (the question comes
first, then the picture). Conditions per pair:

- ``full``: the corrected picture from the start (upper reference);
- ``tampered``: the tampered picture, never corrected (lower reference);
- ``swap`` at k: after k thinking tokens over ``[q, img_bad, thoughts]`` the view becomes ``[q, img_good,
  thoughts]`` (the corrected picture was encoded in its own block under ``[q, img_good]``) and the thinker
  goes on: its block, and the memory of what it wrote while it saw the tampered picture, stay; nothing is
  re-encoded, and the model is not told that anything changed (docs/runtime.md, "Swapping an image");
- ``restart`` at k (the baseline): at k the thinker is stopped, its thoughts are dropped, and a fresh
  context [q, corrected picture] is encoded again; a new thinker starts from scratch.

Budget: every condition gets ``--max-tokens`` thinking tokens with the picture it ends with (swap and
restart: after the correction; the k tokens before it are extra). Then an answer cue is appended to the
thoughts and up to ``--answer-tokens`` tokens are generated greedily; the first number (when the correct
answer is a number) or colour word (otherwise) in them is the answer. Rows record whether it is the
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
from cothink.experiments.sharded_vqa_data import VQA_PX, Pair, load_pairs, pair_of, sharded_vqa
from cothink.experiments.streams import COLOURS

NAME = "sharded-vqa"
log = logging.getLogger("cothink.experiments.sharded_vqa")
CONDITIONS = ("full", "tampered", "swap", "restart")
SHARDED = ("swap", "restart")  # the conditions with a shard point k
DEFAULT_STEPS = (16, 64)
SYSTEM = "You answer questions about pictures. Look carefully, reason briefly, then answer."
ANSWER_CUE = "\n\nFinal answer (one word or number):"
MARK = "\x00PICTURE\x00"


class VQAConfig(ExperimentConfig):
    data: str  # a pairs file, or "seed:S pairs:N px:P" for a generated set
    count: int  # pairs run
    px: int | None  # picture size of a generated set (None: a pairs file's own sizes)
    steps: list[int]  # shard points k (thinking tokens before the correction)
    conditions: list[str]
    answer_tokens: int


class VQARow(Row):
    pair_id: str
    kind: str | None  # question kind of a generated pair (sharded_vqa_data.KINDS); None from a pairs file
    condition: str  # full | tampered | swap | restart
    k: int | None  # shard point (swap, restart)
    answer: str | None  # the model's answer, read from what it wrote after the answer cue (None: none found)
    answer_correct: str  # the corrected picture's answer
    answer_tampered: str  # the tampered picture's answer
    said: str  # what the model wrote after the answer cue
    correct: bool
    followed_tampered: bool  # answered the tampered picture's answer
    tokens_generated: int  # all thinking tokens generated (before the correction too)
    tokens_encoded: int  # tokens written into memory by prefill (pictures' placeholders included)
    forward_passes: int
    seconds: float  # from the correction (full, tampered: the start of thinking) to the answer
    thoughts: str  # the thinking text (the last thinker's)


# ------------------------------------------------------------------------------------------ answers


def parse_answer(text: str, kind: str) -> str | None:
    """The first colour word (colour questions) or number (the others) in `text`."""
    return _first_word(text, COLOURS) if kind == "colour" else _first_number(text)


def parse_pair_answer(text: str, pair: Pair) -> str | None:
    """The answer in `text` for `pair`: by its kind when generated; otherwise the first number when the
    correct answer is a number, else the first colour word (or either expected answer word)."""
    if pair.kind is not None:
        return parse_answer(text, pair.kind)
    if re.fullmatch(r"-?\d+", pair.answer_correct):
        return _first_number(text)
    words = (*COLOURS, pair.answer_correct.lower(), pair.answer_tampered.lower())
    return _first_word(text, words)


def _first_number(text: str) -> str | None:
    found = re.search(r"-?\d+", text)
    return found.group(0) if found else None


def _first_word(text: str, words: Sequence[str]) -> str | None:
    pattern = "|".join(re.escape(w) for w in sorted(set(words), key=len, reverse=True))
    found = re.search(r"\b(" + pattern + r")\b", text.lower())
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


def _turn(chat: Any, pair: Pair) -> tuple[str, str]:
    """The prompt around the picture: [system, user: question + "\\n"] and the user turn's end with the
    assistant's opener."""
    rendered = chat.render([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": pair.question + "\n" + MARK}],
                           generation_prompt=True)
    head, _, tail = rendered.partition(MARK)
    return head, tail


async def _picture(engine: Any, chat: Any, pair: Pair, q: Any, which: str) -> Any:
    """A picture block ("good": the corrected picture, "bad": the tampered one), written under [q, it]:
    the picture, then the user turn's end."""
    block = engine.block(which)
    pixels = pair.image_correct if which == "good" else pair.image_tampered
    await engine.extend(block, image=pixels, view=[q, block], name="context")
    await engine.extend(block, _turn(chat, pair)[1], view=[q, block], name="context")
    return block


async def _context(
    engine: Any, chat: Any, pair: Pair, pictures: Sequence[str]
) -> tuple[Any, dict[str, Any]]:
    """The question block q, and a picture block per name in `pictures`."""
    q = engine.block("q")
    await engine.extend(q, _turn(chat, pair)[0], name="context")
    return q, {which: await _picture(engine, chat, pair, q, which) for which in pictures}


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


async def run_case(engine: Any, pair: Pair, condition: str, k: int | None, config: VQAConfig) -> VQARow:
    """One pair under one condition on a fresh running engine. The corrected picture of swap and
    restart is encoded at the shard point (it arrives then), inside the timed part."""
    from cothink.agents.chat import ChatFormat

    chat = ChatFormat(engine.tokenizer)
    passes = [0]
    engine.step_listeners.append(lambda record: passes.__setitem__(0, passes[0] + 1))
    first = "good" if condition == "full" else "bad"
    q, blocks = await _context(engine, chat, pair, [first])
    thoughts = engine.block("thoughts")
    if condition in SHARDED:
        await _think(engine, [q, blocks["bad"], thoughts], k or 0, config.seed)
    before = len(thoughts)
    t0 = time.perf_counter()  # the correction (full and tampered: the start of thinking)
    if condition == "swap":  # the corrected picture, written under [q, good]; the thoughts stay
        good = await _picture(engine, chat, pair, q, "good")
        view = [q, good, thoughts]
    elif condition == "restart":  # from scratch: a fresh context, a new thinker
        for block in (q, blocks["bad"], thoughts):
            engine.release(block)
        q, fresh = await _context(engine, chat, pair, ["good"])
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
    parsed = parse_pair_answer(said, pair)
    correct, wrong = pair.answer_correct.lower(), pair.answer_tampered.lower()
    return VQARow(
        pair_id=pair.pair_id, kind=pair.kind, condition=condition, k=k, answer=parsed,
        answer_correct=pair.answer_correct, answer_tampered=pair.answer_tampered, said=said,
        correct=parsed == correct,
        followed_tampered=parsed == wrong, tokens_generated=generated,
        tokens_encoded=_encoded(engine), forward_passes=passes[0], seconds=round(elapsed, 4), thoughts=text,
    )


async def run_pair(handle: Any, pair: Pair, condition: str, k: int | None, config: VQAConfig) -> VQARow:
    async with handle.engine(kv_tokens=16384) as engine:
        return await run_case(engine, pair, condition, k, config)


# ------------------------------------------------------------------------------------------ summary


def _key(row: VQARow) -> str:
    return row.condition if row.k is None else f"{row.condition}@{row.k}"


def summarize(rows: Sequence[VQARow]) -> dict[str, Any]:
    """summary["full" | "tampered" | "swap@k" | "restart@k"] = accuracy, share answering the tampered
    picture, mean tokens generated, tokens encoded, forward passes and seconds after the correction."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(_key(r) for r in rows):
        rs = [r for r in rows if _key(r) == key]
        out[key] = {
            "pairs": len(rs),
            "accuracy": statistics.fmean(r.correct for r in rs),
            "tampered": statistics.fmean(r.followed_tampered for r in rs),
            "tokens_generated": statistics.fmean(r.tokens_generated for r in rs),
            "tokens_encoded": statistics.fmean(r.tokens_encoded for r in rs),
            "forward_passes": statistics.fmean(r.forward_passes for r in rs),
            "seconds": statistics.fmean(r.seconds for r in rs),
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
        right.set_title("tokens encoded per pair")
    return path


def report(results: Results[VQAConfig, VQARow]) -> str:
    c = results.config
    pictures = f"{c.px} px pictures" if c.px is not None else "the pairs file's pictures"
    lines = [
        "# ShardedVQA: a corrected picture swapped in mid-reasoning",
        "",
        f"Model: {c.model_description or c.model} ({c.dtype}); data {c.data}, {c.count} pairs, "
        f"{pictures}; shard points k = {', '.join(map(str, c.steps))} thinking tokens; "
        f"{c.max_tokens} thinking tokens after the correction, {c.answer_tokens} answer tokens. "
        f"Machine: {harness.machine_line(c.machine)}; wall {c.wall_s:.0f} s.",
        "",
        "These accuracies are evidence about the model only when it is a trained vision-language "
        "checkpoint; on random weights (the tests' tiny models) they measure nothing.",
        "",
        harness.markdown_table(
            ["condition", "pairs", "correct", "tampered answer", "tokens generated", "tokens encoded",
             "forward passes", "s after correction"],
            [[k, e["pairs"], e["accuracy"], e["tampered"], e["tokens_generated"], e["tokens_encoded"],
              e["forward_passes"], e["seconds"]] for k, e in results.summary.items()],
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
    p.add_argument("--pairs-file", type=Path, default=None,
                   help="a pairs file (JSONL: pair_id, question, answer_tampered, answer_correct, "
                        "image_tampered, image_correct; pictures relative to its folder); default: pairs "
                        "generated from --seed")
    p.add_argument("--pairs", type=int, default=50, help="pairs of a generated set (default 50)")
    p.add_argument("--px", type=int, default=VQA_PX,
                   help=f"picture size of a generated set (default {VQA_PX})")
    p.add_argument("--steps", type=int, nargs="+", default=list(DEFAULT_STEPS),
                   help="shard points k: thinking tokens before the correction (default 16 64)")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    p.add_argument("--answer-tokens", type=int, default=6, help="most tokens of the answer (default 6)")


def build_config(args: argparse.Namespace, pairs: Sequence[Pair]) -> VQAConfig:
    quick = bool(args.quick)
    from_file = args.pairs_file is not None
    source = str(args.pairs_file) if from_file else f"seed:{args.seed} pairs:{len(pairs)} px:{args.px}"
    count = len(pairs) if args.limit is None else min(args.limit, len(pairs))
    return VQAConfig(
        experiment=NAME, model=args.model, dtype=args.dtype, seed=args.seed, limit=args.limit, quick=quick,
        max_tokens=min(args.max_tokens, 8) if quick else args.max_tokens, threads=args.threads, data=source,
        count=count, px=None if from_file else args.px,
        steps=[min(k, 4) for k in args.steps[:1]] if quick else args.steps,
        conditions=args.conditions, answer_tokens=min(args.answer_tokens, 3) if quick else args.answer_tokens,
    )


def load_data(args: argparse.Namespace) -> list[Pair]:
    if args.pairs_file is not None:
        pairs = load_pairs(args.pairs_file)
        return pairs[:5] if args.quick else pairs
    count = min(args.pairs, 5) if args.quick else args.pairs  # quick: one pair of each kind
    return [pair_of(item) for item in sharded_vqa(args.seed, count, px=args.px).items]


def check_model(handle: Any, model: str) -> None:
    from cothink.errors import InvalidParameterError

    if handle.runner.vision is None:
        raise InvalidParameterError(
            f"sharded-vqa needs a vision model (a multimodal checkpoint with its vision tower); {model} "
            "has none",
            param="model")


def run_experiment(config: VQAConfig, pairs: Sequence[Pair], out: Path, *, show_progress: bool | None = None,
                   ) -> Results[VQAConfig, VQARow]:
    t0 = harness.begin(config)
    handle = harness.load_model(config.model, config.dtype)
    check_model(handle, config.model)
    config.model_description = handle.description
    jobs = [(pair, condition, k) for pair in pairs[: config.count] for condition, k in cases(config)]
    rows: list[VQARow] = []
    results = None
    with harness.progress(len(jobs), "cases", enabled=show_progress) as advance:
        for pair, condition, k in jobs:
            row = asyncio.run(run_pair(handle, pair, condition, k, config))
            rows.append(row)
            log.info("%s %s: %r -> %s", pair.pair_id, _key(row), row.said,
                     "right" if row.correct else "wrong")
            config.wall_s = time.perf_counter() - t0
            results = save(out, config, rows, final=False)
            advance(1)
    config.wall_s = time.perf_counter() - t0
    return save(out, config, rows, final=True) if jobs else results  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pairs = load_data(args)
    config = build_config(args, pairs)
    results = run_experiment(config, pairs, args.out, show_progress=args.progress)
    print(report(results))
    print(f"results: {args.out / 'results.json'}")
    return 0


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="ShardedVQA: a corrected picture swapped in under a running thinker (full, tampered, swap, restart)",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
    default_max_tokens=128,
)
