"""The ``cothink`` command line.

Heavy modules (torch, transformers, the runtime) are imported inside the subcommands so that
``cothink --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO

DEFAULT_MODEL = "smollm2"
DEMO_PROMPT = "Explain in three short sentences why the sky is blue."
DTYPES = ("float32", "bfloat16")


class IncrementalDecoder:
    """Turn a growing list of token ids into text pieces, holding back incomplete UTF-8 characters.

    Decodes a short window of recent tokens rather than the whole sequence, so the cost per token
    stays constant; text is emitted only once it no longer ends in a replacement character (a
    multi-byte character split across tokens) and it extends the previously emitted text.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens up to here have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (at end of generation)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def stop_token_ids(tokenizer: Any) -> set[int]:
    """Token ids that end a chat turn: the tokenizer's eos plus the usual chat end markers."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Iterable):
        ids.update(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = vocab.get(marker)
        if token_id is not None:
            ids.add(int(token_id))
    return ids


def chat_prompt_ids(
    tokenizer: Any, prompt: str, *, system: str | None = None, raw: bool = False
) -> list[int]:
    """Token ids for ``prompt``: through the tokenizer's chat template unless ``raw``."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself; don't let the tokenizer add a BOS twice.
    return list(tokenizer.encode(text, add_special_tokens=False))


def greedy_stream(
    runner: Any, prompt_ids: Sequence[int], *, max_tokens: int, stop_ids: set[int]
) -> Iterator[int]:
    """Yield greedily chosen token ids from ``runner`` (extend/new_block API) until a stop id or the limit.

    Stop tokens are not yielded.
    """
    if max_tokens <= 0:
        return
    block = runner.new_block()
    logits = runner.extend(block, list(prompt_ids))
    for step in range(max_tokens):
        next_id = int(logits[-1].argmax())
        if next_id in stop_ids:
            return
        yield next_id
        if step + 1 < max_tokens:
            logits = runner.extend(block, [next_id])


def _write(out: TextIO, text: str) -> None:
    if text:
        out.write(text)
        out.flush()


def stream_generation(
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    dtype: str,
    system: str | None = None,
    raw: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    load: Callable[..., Any] | None = None,
) -> int:
    """Load ``model``, stream a greedy completion of ``prompt`` to ``out``; return the token count.

    ``out``/``err`` default to the current ``sys.stdout``/``sys.stderr``; ``load`` to ``cothink.load_model``.
    """
    import torch

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err

    if load is None:
        from cothink import load_model as load

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    runner = load(model, device="cpu", dtype=torch_dtype)
    tokenizer = runner.tokenizer
    ids = chat_prompt_ids(tokenizer, prompt, system=system, raw=raw)
    t_loaded = time.perf_counter()

    decoder = IncrementalDecoder(tokenizer)
    count = 0
    t_first: float | None = None
    for token_id in greedy_stream(runner, ids, max_tokens=max_tokens, stop_ids=stop_token_ids(tokenizer)):
        if t_first is None:
            t_first = time.perf_counter()
        count += 1
        _write(out, decoder.push(token_id))
    _write(out, decoder.flush())
    _write(out, "\n")
    t_end = time.perf_counter()

    first = (t_first or t_end) - t_loaded
    decode_s = t_end - (t_first or t_end)
    rate = (count - 1) / decode_s if count > 1 and decode_s > 0 else float("nan")
    print(
        f"[{count} tokens; load {t_loaded - t0:.2f}s, prompt {len(ids)} tokens + first token {first:.2f}s, "
        f"decode {rate:.1f} tok/s, {dtype}]",
        file=err,
    )
    return count


# ----------------------------------------------------------------------------------------- commands


def _cmd_prepare(args: argparse.Namespace) -> int:
    from cothink.models.hub import prepare_model

    print(prepare_model(args.model, force=args.force))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    stream_generation(
        args.model,
        args.prompt,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        system=args.system,
        raw=args.raw,
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    print(f"prompt: {args.prompt}", file=sys.stderr)
    stream_generation(args.model, args.prompt, max_tokens=args.max_tokens, dtype=args.dtype)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cothink",
        description="cothink: a PyTorch runtime for asynchronous LLM reasoning.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "prepare",
        help="make a model ready to load (converts the embedded model once) and print its folder",
        description="Resolve MODEL (an embedded name such as 'smollm2', or a local Hugging Face folder), "
        "converting the embedded GGUF into a cached safetensors folder if needed, and print the folder.",
    )
    p.add_argument("model", metavar="MODEL", help="embedded model name (smollm2) or a local model folder")
    p.add_argument("--force", action="store_true", help="convert again even if the cached folder exists")
    p.set_defaults(func=_cmd_prepare)

    def add_common(q: argparse.ArgumentParser, max_tokens: int) -> None:
        q.add_argument(
            "--model", default=DEFAULT_MODEL, help=f"model name or folder (default: {DEFAULT_MODEL})"
        )
        q.add_argument(
            "--max-tokens",
            type=_positive_int,
            default=max_tokens,
            help=f"most new tokens (default: {max_tokens})",
        )
        q.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default: float32)")

    p = sub.add_parser(
        "generate",
        help="stream a greedy chat completion to stdout",
        description="Stream a greedy completion of PROMPT (wrapped in the model's chat template) to stdout; "
        "timing goes to stderr.",
    )
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    add_common(p, 256)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "demo",
        help="run the demo on the embedded default model",
        description="Run the demo: a streamed greedy chat completion on the embedded model with a fixed "
        "prompt.",
    )
    p.add_argument("--prompt", default=DEMO_PROMPT, help="override the demo prompt")
    add_common(p, 128)
    p.set_defaults(func=_cmd_demo)

    from cothink.eval.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(version("cothink"))
        except PackageNotFoundError:
            print("unknown")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from cothink.errors import CothinkError

    try:
        return int(args.func(args) or 0)
    except CothinkError as exc:
        print(f"cothink: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
