"""cothink against the CPU engines users pick: llama.cpp (llama-cpp-python), ONNX Runtime GenAI,
OpenVINO GenAI and CTranslate2, on one model made from the same weights, one process per engine.

    python bench/peers.py                                  # SmolLM2, every engine, int4, best of 3
    python bench/peers.py --engines cothink ctranslate2 --precision int8
    python bench/peers.py --quick                          # a smoke run: tiny settings, one round

Workloads, the same token ids for every engine, greedy, --threads threads (2) everywhere:
  decode     batch 1: a fixed chat prompt, then --decode-tokens new tokens; tokens/s of the decode
             phase (from the prompt in memory to the last token)
  prefill    prompts of --prefill tokens (512, 2048; a fixed English text repeated, each prompt from
             a token of its own: none is a prefix of another, so no prefix cache helps): prompt tokens/s
  batch      --batch-seqs sequences (32) continuing one --batch-context-token context (256) by
             --batch-new tokens each (64): generated tokens/s from the request to the last token
             (cothink writes the context once and forks it; the peers take --batch-seqs copies of it
             in one batched call; llama-cpp-python's high-level API runs one sequence: reported n/a)
Each engine's decode tokens are compared with cothink's (greedy: equal until the first difference).

Rounds: --repeats rounds, each starting one process per engine (in an order that rotates every
round, so no engine always runs first); each figure is the best over the rounds. An engine whose
package is not installed is reported as missing, one whose model files cannot be made as an error
with its reason; neither gets a number.

Model files, made once into --models-dir from the checkpoint cothink loads (the embedded SmolLM2 is
the float32 dequantization of its shipped Q4_1 GGUF):
  cothink          the checkpoint, bfloat16 activations; --precision int4: `quantize="int4"` (for
                   SmolLM2 the layers are its GGUF's Q4_1 tensors as they are, models/quant4.py;
                   the lm_head int8); int8: `quantize="int8"`; bfloat16: dense; float32: dense, float32
  llama.cpp        the embedded model's shipped GGUF (Q4_1 layers, Q8_0 output) for int4; for int8,
                   bfloat16 and float32 its weight tensors re-encoded as Q8_0, BF16 or F32 from their float32
                   dequantization (the weights the checkpoint holds: the same model at that
                   precision); or --gguf FILE, as it is
  ctranslate2      ctranslate2's TransformersConverter of the checkpoint (int4: int8, CTranslate2 has
                   no 4-bit CPU type; int8: int8; bfloat16: bfloat16; float32: float32)
  onnxruntime-genai  onnxruntime_genai.models.builder of the checkpoint (int4: its int4, block 32;
                   otherwise fp32), intra-op threads set in its genai_config.json
  openvino-genai   optimum-intel's `optimum-cli export openvino` of the checkpoint (int4: asymmetric,
                   group 32, every layer; int8; bfloat16: fp16; float32: fp32, run in float32: by
                   default a CPU with bfloat16 arithmetic runs it in bfloat16), with its tokenizer
                   (openvino-tokenizers)
What each engine ran is recorded with its figures ("weights").

The weight-streaming limit (bfloat16 and float32, where a decode token reads every weight once): the
cothink worker measures, on its threads, how fast this machine reads a weight larger than the caches
(`_common.stream_gb_s`: the fastest of torch's sum over 256 MiB of float32 and of bfloat16 and
cothink's one-row product over 256 MiB of bfloat16 weights) and the bytes of weights a decode token
reads (every linear, lm_head included); limit = GB/s / bytes, and cothink's best decode as a share of
the limit measured in that decode's process (a VM's read rate moves with its neighbours).

Writes peers.json (machine: CPU, commit, torch; settings; per engine its best figures, every
round's, and its agreement with cothink; per workload cothink / the best peer) and peers.png to --out,
and prints the tables: the best figures, then cothink / the best peer of each workload, as the ratio
of the two bests and round by round (each round's two processes minutes apart: this VM's speed moves
by 10-30% between rounds, so the two bests may come from spells of different speed).
Install the peers with `pip install -e .[peers]` (llama-cpp-python builds llama.cpp from source:
~20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

ENGINES = ("cothink", "llama.cpp", "onnxruntime-genai", "openvino-genai", "ctranslate2")
# the module each engine needs (and, for converting its model files, what else)
MODULES = {
    "cothink": ("cothink",), "llama.cpp": ("llama_cpp",), "onnxruntime-genai": ("onnxruntime_genai",),
    "openvino-genai": ("openvino_genai", "openvino_tokenizers"), "ctranslate2": ("ctranslate2",),
}
PRECISIONS = ("int4", "int8", "bfloat16", "float32")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
RESULT_MARK = "PEERS-RESULT "  # a worker's result line on stdout


@dataclass(frozen=True)
class Workload:
    """The token ids every engine runs (built once by the parent, from the model's tokenizer)."""

    decode_prompt: list[int]
    decode_tokens: int
    prefill: dict[int, list[int]]  # prompt length -> its ids
    batch_context: list[int]
    batch_seqs: int
    batch_new: int
    warmup: list[int]  # the warm-up's prefill, as long as the longest prompt


@dataclass
class Figures:
    """One engine's figures from one process (tokens/s; None: not run or not supported)."""

    weights: str = ""  # what the engine ran (file, precision)
    decode_tok_s: float | None = None
    prefill_tok_s: dict[int, float] = field(default_factory=dict)
    batch_tok_s: float | None = None
    decode_ids: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stream_gb_s: float | None = None  # cothink, dense precisions: this machine's weight-streaming rate
    token_bytes: int | None = None  # and the bytes of weights a decode token reads

    @property
    def stream_limit_tok_s(self) -> float | None:
        """Decode tokens/s if a token cost only reading its weights at the streaming rate."""
        if self.stream_gb_s is None or not self.token_bytes:
            return None
        return self.stream_gb_s * 1e9 / self.token_bytes


@dataclass
class EngineResult:
    """An engine over all rounds: "ok", "missing" (not installed) or "error" (with the reason)."""

    engine: str
    status: str
    reason: str = ""
    rounds: list[Figures] = field(default_factory=list)
    best: Figures | None = None
    agreement: int | None = None  # decode tokens equal to cothink's before the first difference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="embedded model name or a local HF folder")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--precision", choices=PRECISIONS, default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="rounds; each figure is the best (default 3)")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 128")
    p.add_argument("--prefill", type=int, nargs="+", default=None, help="prompt lengths (default 512 2048)")
    p.add_argument("--batch-seqs", type=int, default=None, help="default 32")
    p.add_argument("--batch-context", type=int, default=None, help="default 256")
    p.add_argument("--batch-new", type=int, default=None, help="default 64")
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF for llama.cpp, run as it is (default: the shipped one, re-encoded for int8 "
                        "and bfloat16)")
    p.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "cothink" / "peers")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one engine process may take")
    p.add_argument("--quick", action="store_true", help="smoke run: one round, tiny workloads")
    p.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.repeats = args.repeats or (1 if q else 3)
    args.decode_tokens = args.decode_tokens or (8 if q else 128)
    args.prefill = args.prefill or ([64] if q else [512, 2048])
    args.batch_seqs = args.batch_seqs or (4 if q else 32)
    args.batch_context = args.batch_context or (32 if q else 256)
    args.batch_new = args.batch_new or (4 if q else 64)
    return args


# ------------------------------------------------------------------------------------------ parent


def build_workload(args: argparse.Namespace, folder: Path) -> Workload:
    from transformers import AutoTokenizer

    from int8_quality import TEXT

    from cothink.models.text import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = tok(TEXT)["input_ids"]
    prefill = {n: _passage(text, start, n) for start, n in enumerate(args.prefill, 1)}
    return Workload(chat_prompt_ids(tok, PROMPT), args.decode_tokens, prefill,
                    _passage(text, len(prefill) + 1, args.batch_context), args.batch_seqs, args.batch_new,
                    _passage(text, 0, max(args.prefill)))


def _passage(text: list[int], start: int, n: int) -> list[int]:
    """n ids of `text` repeated, from its token `start`. Every prompt starts at a token of its own, so
    no prompt is a prefix of another and no engine's prefix cache carries one measurement's work into
    the next (OpenVINO GenAI reuses a recent prompt's KV for a prompt that starts with it: a 2048-token
    prompt that began with the 512 one measured before it took only its last 1536 tokens)."""
    return (text * ((start + n) // len(text) + 1))[start:start + n]


def missing(engine: str) -> str | None:
    """The modules an engine needs that are not installed (None: all are)."""
    absent = [m for m in MODULES[engine] if importlib.util.find_spec(m) is None]
    return ", ".join(absent) or None


def run_worker(args: argparse.Namespace, engine: str, spec: Path) -> Figures | str:
    """One engine's figures from a fresh process, or the reason it gave none."""
    cmd = [sys.executable, __file__, "--worker", engine, "--spec", str(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            data = json.loads(line[len(RESULT_MARK):])
            if "error" in data:
                return data["error"]
            data["prefill_tok_s"] = {int(k): v for k, v in data["prefill_tok_s"].items()}
            return Figures(**data)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return f"exit {proc.returncode}: " + " | ".join(tail)


def best_of(rounds: list[Figures]) -> Figures:
    """Per figure the best round (the decode ids and weights of the first round)."""
    def top(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    first = rounds[0]
    lengths = sorted({n for r in rounds for n in r.prefill_tok_s})
    return Figures(
        weights=first.weights, decode_tok_s=top([r.decode_tok_s for r in rounds]),
        prefill_tok_s={n: v for n in lengths
                       if (v := top([r.prefill_tok_s.get(n) for r in rounds])) is not None},
        batch_tok_s=top([r.batch_tok_s for r in rounds]), decode_ids=first.decode_ids,
        notes=sorted({n for r in rounds for n in r.notes}),
        # the streaming rate of the best decode's own process: this VM's read rate moves with its
        # neighbours (31-56 GB/s in one run's three processes), so a limit is read beside its decode
        stream_gb_s=max(rounds, key=lambda r: r.decode_tok_s or 0.0).stream_gb_s,
        token_bytes=first.token_bytes,
    )


def by_workload(f: Figures) -> dict[str, float | None]:
    """A process's tokens/s by workload name: "decode", "prefill N" (each length), "batch"."""
    return {"decode": f.decode_tok_s, **{f"prefill {n}": v for n, v in sorted(f.prefill_tok_s.items())},
            "batch": f.batch_tok_s}


@dataclass
class Ratio:
    """cothink against the peer with the best figure of one workload: the ratio of the two bests, and
    the ratio within each round (cothink's process and the peer's minutes apart, where the two bests may
    come from different rounds, and this VM's speed moves by 10-30% between them) with its median."""

    workload: str
    peer: str
    of_bests: float
    rounds: list[float]

    @property
    def median(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None


def ratios(results: dict[str, EngineResult]) -> list[Ratio]:
    """Per workload cothink has a figure for, its Ratio to the best peer (none where no peer has one)."""
    ref = results.get("cothink")
    if ref is None or ref.best is None:
        return []
    out = []
    for workload, mine in by_workload(ref.best).items():
        peers = [(v, r) for r in results.values() if r.engine != "cothink" and r.best is not None
                 and (v := by_workload(r.best).get(workload))]
        if not mine or not peers:
            continue
        best, peer = max(peers, key=lambda p: p[0])
        # rounds pair by index: a round's processes ran one after another (an engine's failed round
        # ends its list, so its rounds so far are still the first ones)
        rounds = [a / b for x, y in zip(ref.rounds, peer.rounds)
                  if (a := by_workload(x).get(workload)) and (b := by_workload(y).get(workload))]
        out.append(Ratio(workload, peer.engine, mine / best, rounds))
    return out


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    import _common as C

    from cothink.models.hub import resolve_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    info = C.machine()
    folder = Path(resolve_model_path(args.model))
    print(f"peers: {args.model} ({args.precision}) on {C.machine_line(info)}; "
          f"{args.threads} threads per engine")
    work = build_workload(args, folder)
    spec = args.out / "peers-spec.json"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    spec.write_text(json.dumps({"args": settings, "folder": str(folder), "workload": asdict(work)}))
    results = {e: EngineResult(e, "ok") for e in args.engines}
    for engine, result in results.items():
        absent = missing(engine)
        if absent:
            result.status, result.reason = "missing", f"not installed ({absent})"
    runnable = [e for e, r in results.items() if r.status == "ok"]
    for index in range(args.repeats):
        order = runnable[index % max(1, len(runnable)):] + runnable[: index % max(1, len(runnable))]
        for engine in order:
            result = results[engine]
            if result.status != "ok":
                continue
            got = run_worker(args, engine, spec)
            print(f"  round {index + 1}, {engine}: " + (got if isinstance(got, str) else "done"))
            if isinstance(got, str):
                result.status, result.reason = "error", got
            else:
                result.rounds.append(got)
    reference = results.get("cothink")
    for result in results.values():
        if result.rounds:
            result.best = best_of(result.rounds)
    ref_ids = reference.best.decode_ids if reference and reference.best else None
    for result in results.values():
        if result.best and ref_ids:
            result.agreement = agreement(result.best.decode_ids, ref_ids)
    against = ratios(results)
    print_table(args, results, against)
    limit = reference.best.stream_limit_tok_s if reference and reference.best else None
    data = {"benchmark": "peers", "machine": info, "model": args.model, "folder": str(folder),
            "settings": settings, "stream_limit_tok_s": limit,
            "engines": {e: asdict(r) for e, r in results.items()},
            "ratios": [{**asdict(r), "median": r.median} for r in against]}
    json_path = C.write_json(args.out / "peers.json", data)
    png = plot(args, results, args.out / "peers.png")
    print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return 0


def _cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def print_table(args: argparse.Namespace, results: dict[str, EngineResult], against: list[Ratio]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokens/s, best of {args.repeats} (greedy, {args.threads} threads)")
    for col in ("engine", "weights", "decode b=1", *(f"prefill {n}" for n in args.prefill),
                f"{args.batch_seqs} seqs x {args.batch_new}", f"agrees (of {args.decode_tokens})"):
        table.add_column(col)
    for r in results.values():
        if r.best is None:
            table.add_row(r.engine, f"{r.status}: {r.reason}", *[""] * (3 + len(args.prefill)))
            continue
        b = r.best
        prefill = [_cell(b.prefill_tok_s.get(n)) for n in args.prefill]
        table.add_row(r.engine, b.weights, _cell(b.decode_tok_s), *prefill, _cell(b.batch_tok_s),
                      "" if r.agreement is None else str(r.agreement))
    console = Console(width=200)
    console.print(table)
    if against:
        pairs = Table(title="cothink / the best peer: of the two bests, and within each round")
        for col in ("workload", "best peer", "of bests", "round by round", "median of rounds"):
            pairs.add_column(col)
        for r in against:
            pairs.add_row(r.workload, r.peer, f"{r.of_bests:.2f}", " / ".join(f"{x:.2f}" for x in r.rounds),
                          "n/a" if r.median is None else f"{r.median:.2f}")
        console.print(pairs)
    ref = results.get("cothink")
    limit = ref.best.stream_limit_tok_s if ref and ref.best else None
    if limit and ref.best.decode_tok_s:
        b = ref.best
        console.print(f"weight-streaming limit: {b.stream_gb_s:.1f} GB/s / {b.token_bytes / 1e6:.1f} MB a "
                      f"token = {limit:,.1f} tokens/s; cothink's decode {b.decode_tok_s / limit:.2f} of it")


def plot(args: argparse.Namespace, results: dict[str, EngineResult], path: Path) -> Path | None:
    """Grouped bars: per workload, each engine's tokens/s relative to cothink's (1.0: cothink)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ref = results.get("cothink")
    if ref is None or ref.best is None:
        return None
    base = by_workload(ref.best)
    names = {"decode": "decode b=1", "batch": f"{args.batch_seqs} seqs"}
    labels = [names.get(w, w) for w in base]
    shown = [r for r in results.values() if r.best is not None]
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(shown))
    for i, r in enumerate(shown):
        mine = by_workload(r.best)
        vals = [(v / b) if (v := mine.get(w)) and b else 0.0 for w, b in base.items()]
        ax.bar([x + i * width for x in range(len(labels))], vals, width, label=r.engine)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("tokens/s relative to cothink")
    ax.set_title(f"{args.model}, {args.precision}, {args.threads} threads, best of {args.repeats}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------------------ worker


def worker_main(args: argparse.Namespace) -> int:
    """One engine in this process: make its model files if needed, run the workloads, print the result."""
    spec = json.loads(args.spec.read_text())
    prefill = {int(k): v for k, v in spec["workload"]["prefill"].items()}
    work = Workload(**{**spec["workload"], "prefill": prefill})
    options = argparse.Namespace(**spec["args"])
    runner: Runner | None = None
    try:
        runner = RUNNERS[args.worker](options, Path(spec["folder"]))
        figures = measure(runner, work)
        out: dict[str, Any] = asdict(figures)
    except Exception as exc:  # reported as the engine's error, never as a figure
        out = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if runner is not None:
            runner.close()
    print(RESULT_MARK + json.dumps(out), flush=True)
    return 0


class Runner:
    """An engine's three workloads over token ids. `weights` says what it runs."""

    weights = ""
    notes: list[str]

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        """n greedy tokens after `prompt`: (tokens, seconds from the prompt in memory to the last)."""
        raise NotImplementedError

    def prefill(self, ids: list[int]) -> float:
        """Seconds to take `ids` as a fresh prompt (to the first token's logits)."""
        raise NotImplementedError

    def batch(self, context: list[int], seqs: int, new: int) -> float | None:
        """Seconds for `seqs` greedy continuations of `context` by `new` tokens each (None: unsupported)."""
        raise NotImplementedError

    def stream_limit(self, figures: Figures) -> None:
        """Add this machine's weight-streaming limit to `figures` (cothink's dense precisions only)."""

    def close(self) -> None:
        """Release what the engine holds (threads, loops)."""


def measure(runner: Runner, work: Workload) -> Figures:
    # warm-ups: a short generation, the longest prefill (its chunks also take cothink's one-thread
    # trial of their step width, execution/threads.py: once per width in an engine's life, a
    # 512-token chunk on one thread, which would otherwise land in the first measured 2048 prefill)
    runner.decode(work.decode_prompt, 2)
    runner.prefill(work.warmup)
    ids, seconds = runner.decode(work.decode_prompt, work.decode_tokens)
    figures = Figures(weights=runner.weights, decode_ids=ids, decode_tok_s=len(ids) / seconds,
                      notes=list(getattr(runner, "notes", [])))
    for n, prompt in work.prefill.items():
        figures.prefill_tok_s[n] = n / runner.prefill(prompt)
    took = runner.batch(work.batch_context, work.batch_seqs, work.batch_new)
    figures.batch_tok_s = None if took is None else work.batch_seqs * work.batch_new / took
    runner.stream_limit(figures)
    return figures


class CothinkRunner(Runner):
    def __init__(self, args: argparse.Namespace, folder: Path):
        import asyncio

        import cothink  # noqa: F401  (the OpenMP wait policy before torch)
        import torch

        from cothink.models.quant4 import checkpoint_gguf
        from cothink.ops import native
        from cothink.runtime.engine import Engine

        torch.set_num_threads(int(args.threads))
        quantize = args.precision if args.precision in ("int4", "int8") else None
        dtype = torch.float32 if args.precision == "float32" else torch.bfloat16
        self.engine = Engine.from_pretrained(args.model, dtype=dtype, quantize=quantize, kv_tokens=16384)
        self.weights = {"int4": "4-bit layers (quantized at load), int8 lm_head", "int8": "int8",
                        "bfloat16": "bfloat16", "float32": "float32"}[args.precision]
        self.dense = quantize is None
        self.precision, self.folder, self.threads = args.precision, folder, int(args.threads)
        source = checkpoint_gguf(folder) if args.precision == "int4" else None
        if source is not None:
            self.weights = f"{source.name}'s 4-bit layers as they are, int8 lm_head"
        if quantize is not None and native.bf16_pairs():  # the products' activations (models/quantize.py)
            self.weights += "; 8-bit activations"
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def stream_limit(self, figures: Figures) -> None:
        """Dense precisions: this machine's weight-streaming rate and the bytes a decode token reads."""
        if not self.dense:
            return
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        import _common as C

        with torch.device("meta"):  # shapes only
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.folder))
        figures.token_bytes = C.streamed_weight_bytes(model, self.precision)
        figures.stream_gb_s = C.on_compute(C.stream_gb_s, self.threads)

    def close(self) -> None:
        self._run(self.engine.stop())
        self.loop.close()

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        async def go() -> tuple[list[int], float]:
            block = self.engine.block()
            await self.engine.extend(block, token_ids=prompt)
            t = time.perf_counter()
            result = await self.engine.generate(block, max_tokens=n, stop_at_eos=False).collect()
            seconds = time.perf_counter() - t
            self.engine.release(block)
            return list(result.token_ids), seconds
        return self._run(go())

    def prefill(self, ids: list[int]) -> float:
        async def go() -> float:
            block = self.engine.block()
            t = time.perf_counter()
            await self.engine.extend(block, token_ids=ids)
            seconds = time.perf_counter() - t
            self.engine.release(block)
            return seconds
        return self._run(go())

    def batch(self, context: list[int], seqs: int, new: int) -> float:
        import asyncio

        async def go() -> float:
            t = time.perf_counter()
            ctx = self.engine.block()
            await self.engine.extend(ctx, token_ids=context)
            own = [self.engine.block() for _ in range(seqs)]
            await asyncio.gather(*(self.engine.generate([ctx, b], max_tokens=new, stop_at_eos=False).collect()
                                   for b in own))
            seconds = time.perf_counter() - t
            for b in [*own, ctx]:
                self.engine.release(b)
            return seconds
        return self._run(go())


def _embedded_gguf(model: str) -> Path | None:
    """The GGUF an embedded model ships whole (None: a folder, or a model shipped in parts)."""
    from cothink.models.hub import find_embedded_gguf

    try:
        return find_embedded_gguf(model)
    except Exception:
        return None


def _convert(cmd: list[str]) -> None:
    """Run a model conversion; its failure raised with the last lines it printed."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {tail}")


def _model_dir(args: argparse.Namespace, engine: str) -> Path:
    return Path(args.models_dir) / Path(str(args.model)).name / f"{engine}-{args.precision}"


# llama.cpp's type for the shipped GGUF's weights at each --precision but int4 (the file as shipped)
LLAMA_CPP_TYPES = {"int8": "Q8_0", "bfloat16": "BF16", "float32": "F32"}


def reencoded_gguf(src: Path, out: Path, qtype: str) -> Path:
    """`src` with each quantized tensor re-encoded as `qtype` (a gguf.GGMLQuantizationType name) from
    its float32 dequantization, the float32 ones (norms) as they are, and src's metadata but for
    general.file_type; written to `out` once (a file already there is taken as made)."""
    import gguf
    import numpy as np

    if out.exists():
        return out
    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    writer = gguf.GGUFWriter(str(part), arch)
    for key in reader.fields.values():
        if key.name.startswith("GGUF.") or key.name in ("general.architecture", "general.file_type"):
            continue
        kind = gguf.GGUFValueType(key.types[0])
        sub = gguf.GGUFValueType(key.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.name, key.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType["ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"])
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, gguf.quants.quantize(weights, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(out)
    return out


class LlamaCppRunner(Runner):
    def __init__(self, args: argparse.Namespace, folder: Path):
        from llama_cpp import Llama

        path = Path(args.gguf) if args.gguf else _embedded_gguf(args.model)
        if path is None:
            raise FileNotFoundError("no GGUF for this model: pass --gguf FILE")
        qtype = None if args.gguf else LLAMA_CPP_TYPES.get(args.precision)
        self.weights = f"{path.name} (as shipped)"
        if qtype is not None:
            path = reencoded_gguf(path, _model_dir(args, "llama.cpp") / f"{path.stem}.{qtype}.gguf", qtype)
            self.weights = f"{path.name} (the shipped GGUF's tensors re-encoded)"
        self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=int(args.threads),
                         n_threads_batch=int(args.threads), verbose=False)

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        t = time.perf_counter()
        for _ in range(n):
            token = int(self.llm.sample(temp=0.0, repeat_penalty=1.0))
            out.append(token)
            self.llm.eval([token])
        return out, time.perf_counter() - t

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t

    def batch(self, context: list[int], seqs: int, new: int) -> None:
        return None  # the high-level API runs one sequence at a time


class CTranslate2Runner(Runner):
    def __init__(self, args: argparse.Namespace, folder: Path):
        import ctranslate2
        from transformers import AutoTokenizer

        quantization = "int8" if args.precision == "int4" else args.precision
        out = _model_dir(args, "ctranslate2")
        if not (out / "model.bin").exists():
            ctranslate2.converters.TransformersConverter(str(folder)).convert(
                str(out), quantization=quantization, force=True)
        self.gen = ctranslate2.Generator(str(out), device="cpu", compute_type=quantization,
                                         intra_threads=int(args.threads), inter_threads=1)
        self.weights = f"ctranslate2 {self.gen.compute_type}"
        self.notes = ["no 4-bit CPU type: int8"] if args.precision == "int4" else []
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def _tokens(self, ids: list[int]) -> list[str]:
        return self.tok.convert_ids_to_tokens(ids)

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        tokens = self._tokens(prompt)
        t0 = time.perf_counter()
        self.gen.generate_batch([tokens], max_length=1, sampling_topk=1, include_prompt_in_result=False)
        t1 = time.perf_counter()
        result = self.gen.generate_batch([tokens], max_length=n, min_length=n, sampling_topk=1,
                                         include_prompt_in_result=False)[0]
        t2 = time.perf_counter()
        # decode phase: the whole call less the prompt's own pass (timed just before)
        return [int(i) for i in result.sequences_ids[0]], max(1e-9, (t2 - t1) - (t1 - t0))

    def prefill(self, ids: list[int]) -> float:
        t = time.perf_counter()
        self.gen.generate_batch([self._tokens(ids)], max_length=1, sampling_topk=1,
                                include_prompt_in_result=False)
        return time.perf_counter() - t

    def batch(self, context: list[int], seqs: int, new: int) -> float:
        tokens = self._tokens(context)
        t = time.perf_counter()
        self.gen.generate_batch([tokens] * seqs, max_batch_size=seqs, max_length=new, min_length=new,
                                sampling_topk=1, include_prompt_in_result=False)
        return time.perf_counter() - t


class OrtGenAIRunner(Runner):
    def __init__(self, args: argparse.Namespace, folder: Path):
        import numpy as np
        import onnxruntime_genai as og

        precision = "int4" if args.precision == "int4" else "fp32"
        out = _model_dir(args, "onnxruntime-genai")
        config = out / "genai_config.json"
        if not config.exists():
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder),
                   "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(out / "cache")]
            _convert(cmd)
        data = json.loads(config.read_text())
        options = data["model"]["decoder"].setdefault("session_options", {})
        options.update(intra_op_num_threads=int(args.threads), inter_op_num_threads=1)
        config.write_text(json.dumps(data, indent=2))
        self.og, self.np = og, np
        self.model = og.Model(str(out))
        self.weights = f"onnxruntime-genai builder {precision}"
        exported = args.precision in ("int4", "float32")
        self.notes = [] if exported else [f"no {args.precision} CPU export: fp32"]

    def _generator(self, batch: int, max_length: int) -> Any:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, min_length=max_length, do_sample=False,
                                  batch_size=batch)
        return self.og.Generator(self.model, params)

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        gen = self._generator(1, len(prompt) + n)
        gen.append_tokens(self.np.array([prompt], dtype=self.np.int32))
        out = []
        t = time.perf_counter()
        while len(out) < n and not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out, time.perf_counter() - t

    def prefill(self, ids: list[int]) -> float:
        gen = self._generator(1, len(ids) + 1)
        t = time.perf_counter()
        gen.append_tokens(self.np.array([ids], dtype=self.np.int32))
        return time.perf_counter() - t

    def batch(self, context: list[int], seqs: int, new: int) -> float:
        t = time.perf_counter()
        gen = self._generator(seqs, len(context) + new)
        gen.append_tokens(self.np.array([context] * seqs, dtype=self.np.int32))
        steps = 0
        while steps < new and not gen.is_done():
            gen.generate_next_token()
            steps += 1
        return time.perf_counter() - t


class OpenVinoGenAIRunner(Runner):
    def __init__(self, args: argparse.Namespace, folder: Path):
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        fmt = {"int4": "int4", "int8": "int8", "bfloat16": "fp16", "float32": "fp32"}[args.precision]
        out = _model_dir(args, "openvino-genai")
        if not (out / "openvino_model.xml").exists():
            if importlib.util.find_spec("optimum") is None:
                raise FileNotFoundError(f"no OpenVINO model in {out}: export it there with optimum-intel's "
                                        "optimum-cli (docs/benchmarks.md)")
            cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
                   str(folder), "--task", "text-generation-with-past", "--weight-format", fmt, str(out)]
            if fmt == "int4":
                cmd[-1:-1] = ["--group-size", "32", "--ratio", "1.0"]
            _convert(cmd)
        self.np, self.ov, self.genai = np, ov, ov_genai
        # a CPU with bfloat16 arithmetic runs an fp32 model in bfloat16 with a float16 KV cache unless told
        # otherwise (its INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION): the float32 row asks for float32
        exact = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"} if fmt == "fp32" else {}
        self.pipe = ov_genai.LLMPipeline(str(out), "CPU", INFERENCE_NUM_THREADS=int(args.threads), **exact)
        self.weights = f"optimum-intel export {fmt}" + (", float32 arithmetic and KV cache" if exact else "")

    def _run(self, rows: list[list[int]], n: int) -> tuple[Any, float]:
        ids = self.np.array(rows, dtype=self.np.int64)
        inputs = self.genai.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(self.np.ones_like(ids)))
        config = self.genai.GenerationConfig()
        config.max_new_tokens = n
        config.min_new_tokens = n
        config.do_sample = False
        t = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        return result, time.perf_counter() - t

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        result, _ = self._run([prompt], n)
        metrics = result.perf_metrics
        ttft_s = metrics.get_ttft().mean / 1000
        total_s = metrics.get_generate_duration().mean / 1000
        return [int(t) for t in result.tokens[0]][:n], max(1e-9, total_s - ttft_s)

    def prefill(self, ids: list[int]) -> float:
        result, _ = self._run([ids], 1)
        return result.perf_metrics.get_ttft().mean / 1000

    def batch(self, context: list[int], seqs: int, new: int) -> float:
        # its prefix cache is how OpenVINO GenAI shares a context: one pass over it first (timed), as
        # cothink writes it once, then the batch finds its KV there instead of prefilling every copy
        return self._run([context], 1)[1] + self._run([context] * seqs, new)[1]


RUNNERS = {
    "cothink": CothinkRunner, "llama.cpp": LlamaCppRunner, "ctranslate2": CTranslate2Runner,
    "onnxruntime-genai": OrtGenAIRunner, "openvino-genai": OpenVinoGenAIRunner,
}

if __name__ == "__main__":
    sys.exit(main())
