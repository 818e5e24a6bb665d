"""Would planning the next step while the current forward runs pay here? Serial against overlapped.

    python bench/overlap_probe.py                       # SmolLM2 int4 and bfloat16, 1 and 32 coroutines
    python bench/overlap_probe.py --dtypes float32 --coroutines 8

The engine's step loop is serial: the event loop plans a step (`ModelRunner.prepare`: pages, key runs,
rotation tables), the compute thread runs its forward, the event loop publishes it. Planning step N+1
while step N's forward runs would hide the planning only if the forward does not slow down by as much
when Python runs beside it. This measures that on the real work, in one process: decode steps of N
items (each a coroutine reading a --prompt-token context, as bench/peers.py's batch workload), the
forward on the compute thread with --threads threads, and as the planning the next step's `prepare`
(of N other items of the same shape, then undone) on this thread with one torch thread, as the
scheduler runs it. Per round, alternating: the forward alone, the planning alone right after a
forward (as the engine plans: the forward's weights have streamed through every cache level, so the
planning's Python and torch state comes back from memory) and back to back ("planning_warm", for
comparison), both one after the other (serial) and both at once (overlapped: the forward submitted,
the planning run, the forward awaited). ms per step: the median of --steps steps, the best of
--repeats rounds. "hidden" is the share of the planning the overlap saves, (serial - overlapped) /
planning: near 1 where a core is free for the planning, near 0 where the forward's threads take
every core (its parallel regions wait for the thread that shares a core with the planning). A probe,
not an engine option: the engine does not overlap. Every overlapped forward's logits are checked
equal to the lone forward's. Writes overlap_probe.json to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import cothink  # noqa: F401,E402  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from cothink.execution.runner import ModelRunner, load_model  # noqa: E402
from cothink.execution.step import StepItem  # noqa: E402
from cothink.execution.threads import compute_executor, run_compute, threads_for, use_threads  # noqa: E402

MODES = ("forward", "planning", "planning_warm", "serial", "overlapped")


class Probe:
    """Two sets of N decode items over one context: the step that runs (`now`) and the next (`next`)."""

    def __init__(self, runner: ModelRunner, prompt: list[int], n: int, threads: int):
        self.runner, self.threads = runner, threads
        self.context = runner.new_block("context")
        run_compute(runner.extend, self.context, prompt)
        self.writers = [runner.new_block(f"w{i}") for i in range(2 * n)]
        for i, block in enumerate(self.writers):  # each writer holds one token: views [context, writer]
            run_compute(runner.extend, block, [prompt[i % len(prompt)]], [self.context, block])
        self.now = self._items(self.writers[:n])
        self.next = self._items(self.writers[n:])
        with threads_for(1):
            self.batch = runner.prepare(self.now, validate=False)
        self.logits = torch.cat(self._forward().logits)  # the lone forward's, to compare

    def _items(self, blocks: list[Any]) -> list[StepItem]:
        return [StepItem(b, [b.tokens[-1]], view=[self.context, b], logits="last") for b in blocks]

    def _forward(self) -> Any:
        return compute_executor().submit(self._on_compute).result()

    def _on_compute(self) -> Any:
        use_threads(self.threads)
        return self.runner.forward(self.batch)

    def _plan(self) -> None:
        with threads_for(1):
            self.runner.prepare(self.next, validate=False)
            self.runner.abort(self.next)

    def step(self, mode: str) -> float:
        """One step of `mode`: its wall seconds."""
        if mode == "planning":  # as the engine plans: after a forward (it leaves this thread's caches cold)
            self._forward()
        start = time.perf_counter()
        if mode == "forward":
            self._forward()
        elif mode in ("planning", "planning_warm"):
            self._plan()
        elif mode == "serial":
            self._forward()
            self._plan()
        else:
            job = compute_executor().submit(self._on_compute)
            self._plan()
            result = job.result()
            elapsed = time.perf_counter() - start
            if not torch.equal(torch.cat(result.logits), self.logits):
                raise AssertionError("an overlapped forward's logits differ from the lone forward's")
            return elapsed
        return time.perf_counter() - start

    def close(self) -> None:
        self.runner.abort(self.now)
        for block in [*self.writers, self.context]:
            self.runner.free(block)


def measure(probe: Probe, steps: int, repeats: int) -> dict[str, float]:
    """ms per step of each mode: the best of `repeats` rounds' medians, modes alternating in a round."""
    best = {mode: float("inf") for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            probe.step(mode)  # a warm-up step: the mode's first after another mode's
            ms = statistics.median(probe.step(mode) for _ in range(steps)) * 1e3
            best[mode] = min(best[mode], ms)
    best["hidden"] = (best["serial"] - best["overlapped"]) / best["planning"]
    return best


def run(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    prompt = C.random_tokens(args.prompt, C.vocab_size(folder), torch.Generator().manual_seed(args.seed))
    rows = []
    for name in args.dtypes:
        runner = run_compute(load_model, folder, "cpu", C.COMPUTE_DTYPES[name], quantize=C.quantize_of(name))
        for n in args.coroutines:
            probe = Probe(runner, prompt, n, args.threads or torch.get_num_threads())
            try:
                row = measure(probe, args.steps, args.repeats)
            finally:
                probe.close()
            rows.append({"dtype": name, "coroutines": n, "path": probe.batch.path, **row})
    return rows


def table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="decode step, ms (planning: the next step's prepare, on the event-loop thread)")
    for col in ("dtype", "coroutines", "path", *MODES, "hidden"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["dtype"], str(r["coroutines"]), r["path"], *(C.fmt(r[m], 2) for m in MODES),
                  C.fmt(r["hidden"], 2))
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", choices=list(C.COMPUTE_DTYPES), default=["int4", "bfloat16"])
    p.add_argument("--coroutines", type=int, nargs="+", default=[1, 32],
                   help="decode items per step, each over the shared context (default: 1 32)")
    p.add_argument("--prompt", type=int, default=256, help="context tokens (default: 256)")
    p.add_argument("--steps", type=int, default=None, help="steps per mode and round (default 40; quick 8)")
    p.add_argument("--repeats", type=int, default=None, help="rounds, best kept (default 3; quick 1)")
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 40)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, folder = C.begin(args, "overlap probe")
    rows = run(args, folder)
    C.console().print(table(rows))
    for r in rows:
        print(f"{r['dtype']} x{r['coroutines']}: overlapped / serial {r['overlapped'] / r['serial']:.2f}, "
              f"planning hidden {r['hidden']:.2f}")
    data = {"machine": info, "settings": vars(args), "rows": rows}
    path = C.write_json(args.out / "overlap_probe.json", data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
