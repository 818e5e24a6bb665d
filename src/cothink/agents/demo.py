"""The cothink demo: a thinker and a narrator share one model's memory while the user interjects.

Three coroutines run on one engine:

- the **thinker** solves a small word problem, generating into its own block and reading the view
  ``[ctx, thinker]`` (ctx holds the system prompt and the user's messages);
- the **narrator**, every few thinker tokens, probes ``[ctx, thinker]`` ("has the thinker made progress
  worth reporting?") and, if so, says in one short sentence where the thinker stands. It reads the
  thinker's *live* memory through the view ``[ctx, thinker, narration]``: only its short instruction is
  prefilled, nothing the thinker wrote is re-encoded;
- the **user**, halfway through, appends a correction to ctx with ``engine.extend(ctx, ...)``. Both
  coroutines read ctx in their views, so they see it from the next step on. The thinker is not
  restarted and nothing it wrote is re-encoded: it pauses, appends a short note to its own block
  ("Update: the user says to use"), which the model completes by reading the correction in ctx's
  memory, then a resume cue ("So now Tom starts with"), and keeps generating.

At the end a summary compares what the engine did with what a text-passing design would have
re-encoded (each narrator sync re-reading ctx + the thinker's text so far, and a thinker restart after
the interjection).

Run it with ``cothink demo`` (or ``python -m cothink.agents.demo``); ``cothink demo --console`` runs it
behind the live console (docs/console.md) and keeps serving that page until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TypeVar

from cothink.agents.base import AgentEvent
from cothink.cli import QUANTIZE_MODES
from cothink.agents.think_narrate import NarratorSync, Reaction, ThinkNarrate

DEFAULT_MODEL = "smollm2"
SYSTEM = "You are a careful math tutor. Solve the problem step by step and end with 'Answer: <number>'."
PROBLEM = (
    "Tom has 12 apples. He gives 4 apples to his friend, then buys 3 bags with 5 apples in each bag. "
    "How many apples does Tom have now?"
)
INTERJECTION = "Actually, use 15 apples instead of 12."
# What the thinker writes into its own block when it notices new user input in ctx (then it keeps going).
THINKER_NOTE = "\n\nUpdate: the user says to use"
THINKER_RESUME = "So now Tom starts with"
NARRATOR_INSTRUCTION = "In one sentence, what is the assistant calculating right now?"
NARRATOR_PREFIX = "Right now, the assistant is calculating"
FINAL_INSTRUCTION = "In one sentence, what is the assistant's final answer?"
FINAL_PREFIX = "The assistant's final answer is"
PROBE_QUESTION = "Has the assistant made progress worth reporting? Answer yes or no."
PROBE_CHOICES = ("Yes", "No")


# ------------------------------------------------------------------------------------------ records


# One narrator sync (what it read, what it cost, what text passing would have cost).
Sync = NarratorSync


@dataclass
class DemoResult:
    thinker_text: str
    thinker_generated: int
    narrator_generated: int
    syncs: list[Sync]
    interjected_at: int | None  # thinker tokens generated when the user interjected
    restart_reencode: int  # tokens a text-passing thinker restart would re-encode at the interjection
    thinker_reaction_tokens: int  # cue tokens the thinker wrote after the interjection (note, resume)
    steps: int
    wall_s: float
    stats: dict[str, Any]  # coroutine name -> CoroutineStats
    kv_bytes_used: int
    live_blocks: int
    ctx_tokens: list[int] = field(default_factory=list)  # the shared context at the end
    thinker_block_len: int = 0  # tokens in the thinker's block at the end (prompt, cue, generated)
    engine: Any = field(repr=False, default=None)

    @property
    def narrations(self) -> list[Sync]:
        return [s for s in self.syncs if s.spoke]

    @property
    def text_passing_total(self) -> int:
        return sum(s.text_passing_reencode for s in self.syncs) + self.restart_reencode

    @property
    def narrator_prefilled(self) -> int:
        return sum(s.prefilled for s in self.syncs)


# ----------------------------------------------------------------------------------------- displays


class PlainDisplay:
    """Interleaved, labelled lines (colored on a terminal): for pipes, logs and tests."""

    def __init__(self, console: Any):
        self.console = console
        self._buf = ""

    def __enter__(self) -> PlainDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self._flush()

    def _flush(self, partial: bool = True) -> None:
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip():
                self._line("thinker", line, "cyan")
        if partial and self._buf.strip():
            self._line("thinker", self._buf + " …", "cyan")
            self._buf = ""

    def _line(self, who: str, text: str, style: str) -> None:
        from rich.text import Text

        self.console.print(Text.assemble((f"[{who}] ", f"bold {style}"), (text, style)), soft_wrap=True)

    def thinker(self, text: str) -> None:
        self._buf += text
        self._flush(partial=False)

    def narrator(self, text: str) -> None:
        self._flush()
        self._line("narrator", text, "green")

    def probe(self, sync: Sync) -> None:
        self._flush()
        verdict = "speaks" if sync.spoke else "stays quiet"
        self._line(
            "probe",
            f"p(progress)={sync.p_yes:.2f} after {sync.thinker_tokens} thinker tokens: narrator {verdict}",
            "magenta",
        )

    def user(self, text: str) -> None:
        self._flush()
        self._line("user", text, "yellow")

    def status(self, text: str) -> None:
        pass


class LiveDisplay:
    """Two live panels (thinker | narrator) and a status line, redrawn with rich.live.Live."""

    def __init__(self, console: Any):
        from rich.live import Live

        self.console = console
        self._thinker = ""
        self._events: list[tuple[str, str]] = []  # (style, text)
        self._status = ""
        self._live = Live(
            self._render(),
            console=console,
            refresh_per_second=8,
            transient=False,
            get_renderable=self._render,
        )

    def __enter__(self) -> LiveDisplay:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(*exc)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        height = max(10, min(self.console.height - 4, 24))
        width = self.console.width
        left_w = max(20, width * 3 // 5)
        inner = height - 2
        body = Text(self._thinker, style="cyan")
        lines = body.wrap(self.console, left_w - 4)
        shown = Text("\n").join(lines[-inner:]) if len(lines) > inner else body
        events = Text()
        for style, text in self._events:
            events.append(text + "\n", style=style)
        elines = events.wrap(self.console, width - left_w - 4)
        eshown = Text("\n").join(elines[-inner:]) if len(elines) > inner else events
        grid = Table.grid(expand=True)
        grid.add_column(ratio=3)
        grid.add_column(ratio=2)
        grid.add_row(
            Panel(shown, title="thinker  [ctx, thinker]", border_style="cyan", height=height),
            Panel(eshown, title="narrator  [ctx, thinker, narration]", border_style="green", height=height),
        )
        return Group(grid, Text(self._status, style="dim"))

    def thinker(self, text: str) -> None:
        self._thinker += text

    def narrator(self, text: str) -> None:
        self._events.append(("green", f"▸ {text}"))

    def probe(self, sync: Sync) -> None:
        verdict = "speak" if sync.spoke else "stay quiet"
        self._events.append(("magenta", f"  probe p={sync.p_yes:.2f} @ {sync.thinker_tokens} tok: {verdict}"))

    def user(self, text: str) -> None:
        self._events.append(("bold yellow", f"user: {text}"))
        self._thinker += "\n⟵ [user interjects into ctx]\n"

    def status(self, text: str) -> None:
        self._status = text


# --------------------------------------------------------------------------------------------- demo


async def run_demo(
    engine: Any,
    display: Any,
    *,
    max_tokens: int = 128,
    narrate_every: int = 16,
    interject_at: int | None = None,
    narration_tokens: int = 20,
    probe_threshold: float = 0.5,
    max_quiet: int = 1,
    seed: int = 0,
) -> DemoResult:
    """Run the thinker, the narrator and the scripted user on `engine` (already started): a thin use of
    the think-while-narrating pattern (:class:`cothink.agents.ThinkNarrate`) with a scripted interjection."""
    if engine.tokenizer is None:
        raise ValueError("the demo needs a model with a tokenizer and chat template")
    if interject_at is None:
        interject_at = max(1, min(max_tokens // 2, 48))
    relay = _EventRelay(display)
    agent = ThinkNarrate(
        engine,
        task=PROBLEM,
        system=SYSTEM,
        max_tokens=max_tokens,
        narrate_every=narrate_every,
        probe_question=PROBE_QUESTION,
        probe_choices=PROBE_CHOICES,
        threshold=probe_threshold,
        max_quiet=max_quiet,
        instruction=NARRATOR_INSTRUCTION,
        prefix=NARRATOR_PREFIX,
        final_instruction=FINAL_INSTRUCTION,
        final_prefix=FINAL_PREFIX,
        narration_tokens=narration_tokens,
        reaction=Reaction(note=THINKER_NOTE, resume=THINKER_RESUME),
        wait_for_input=True,
        on_event=relay.show,
        seed=seed,
    )
    relay.agent = agent
    status = _StepStatus(display, agent, time.perf_counter())
    engine.step_listeners.append(status)
    try:
        out, _ = await asyncio.gather(agent.run(), _scripted_user(agent, interject_at))
    finally:
        engine.step_listeners.remove(status)
    return _demo_result(engine, out, wall_s=time.perf_counter() - status.t0)


@dataclass
class _EventRelay:
    """Shows the agent's events on the display (a probe event shows the sync it just recorded)."""

    display: Any
    agent: ThinkNarrate | None = None  # set once the agent exists: it is built with `show` as callback

    def show(self, event: AgentEvent) -> None:
        if event.kind == "thought":
            self.display.thinker(event.text)
        elif event.kind == "said":
            self.display.narrator(event.text)
        elif event.kind == "probe":
            self.display.probe(self.agent.syncs[-1])
        elif event.kind == "input":
            self.display.user(event.text)


@dataclass(eq=False)  # an engine step listener: removed by identity
class _StepStatus:
    """An engine step listener: the status line (step, who was in it, thinker progress, time)."""

    display: Any
    agent: ThinkNarrate
    t0: float

    def __call__(self, record: Any) -> None:
        elapsed = time.perf_counter() - self.t0
        who = ", ".join(sorted({i.coroutine for i in record.items}))
        self.display.status(
            f"step {record.index}  [{who}]  thinker tokens {self.agent.generated}  {elapsed:.1f}s"
        )


async def _scripted_user(agent: ThinkNarrate, interject_at: int) -> None:
    """The user: once the thinker has written `interject_at` tokens, the correction (unless it is done)."""
    await agent.wait_progress(interject_at)
    if agent.done:
        agent.end_input()
        return
    await agent.tell(INTERJECTION)
    agent.end_input()


def _demo_result(engine: Any, out: Any, wall_s: float) -> DemoResult:
    mem = engine.memory()
    return DemoResult(
        thinker_text=out.thinker_text,
        thinker_generated=out.thinker_generated,
        narrator_generated=out.narrator_generated,
        syncs=out.syncs,
        interjected_at=out.inputs_at[0] if out.inputs_at else None,
        restart_reencode=out.restart_reencode,
        thinker_reaction_tokens=out.thinker_reaction_tokens,
        steps=engine.steps,
        wall_s=wall_s,
        stats=dict(engine.stats),
        kv_bytes_used=mem.kv_bytes_used,
        live_blocks=mem.live_blocks,
        ctx_tokens=out.ctx_tokens,
        thinker_block_len=out.thinker_block_len,
        engine=engine,
    )


def summary_tables(result: DemoResult) -> list[Any]:
    """Rich tables: per-coroutine cost, and shared memory vs text passing."""
    from rich.table import Table

    per = Table(title=f"engine: {result.steps} forward passes in {result.wall_s:.1f}s", title_justify="left")
    for col in ("coroutine", "works", "passes", "generated", "written", "read"):
        per.add_column(col, justify="left" if col == "coroutine" else "right")
    generated = {"thinker": result.thinker_generated, "narrator": result.narrator_generated, "user": 0}
    for name in ("user", "thinker", "narrator"):
        s = result.stats.get(name)
        if s is None:
            continue
        per.add_row(
            name,
            str(s.works),
            str(s.forward_passes),
            str(generated.get(name, 0)),
            str(s.tokens_written),
            str(s.tokens_read),
        )
    per.caption = (
        "passes: forward passes the coroutine took part in; generated: sampled tokens; "
        "written: tokens written (prompts + generated); read: view positions read"
    )
    per.caption_justify = "left"

    sync = Table(title="encoded tokens: cothink (shared memory) vs text passing", title_justify="left")
    for col in ("what", "count", "cothink", "text passing"):
        sync.add_column(col, justify="left" if col == "what" else "right")
    sync.add_row(
        "narrator re-reads ctx + thinker",
        str(len(result.syncs)),
        "0",
        str(sum(s.text_passing_reencode for s in result.syncs)),
    )
    sync.add_row(
        "narrator prompts (probe, instruction)",
        str(len(result.syncs)),
        str(result.narrator_prefilled),
        str(result.narrator_prefilled),
    )
    reaction = result.thinker_reaction_tokens
    if result.interjected_at is not None:
        sync.add_row(
            "thinker takes the interjection", "1", str(reaction), str(result.restart_reencode + reaction)
        )
    sync.add_row(
        "total",
        "",
        str(result.narrator_prefilled + reaction),
        str(result.text_passing_total + result.narrator_prefilled + reaction),
    )
    return [per, sync]


# ---------------------------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or folder (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=128,
        help="most tokens the thinker generates (default: 128)",
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype (default: float32)"
    )
    p.add_argument(
        "--quantize", choices=QUANTIZE_MODES, default=None,
        help="weight-only int8 or 4-bit linears (Llama, Qwen2, Qwen3)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0; decoding is greedy)")
    p.add_argument(
        "--narrate-every",
        type=_positive_int,
        default=16,
        help="thinker tokens between narrator syncs (default: 16)",
    )
    p.add_argument(
        "--interject-at",
        type=_positive_int,
        default=None,
        help="thinker tokens before the user interjects (default: min(max_tokens/2, 48))",
    )
    p.add_argument("--no-live", action="store_true", help="plain interleaved lines instead of live panels")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="write the step timeline as a Chrome trace JSON to FILE (and a PNG next to it)",
    )
    p.add_argument(
        "--console",
        action="store_true",
        help="serve the live console (docs/console.md): print its URL, run the demo once a page has "
        "connected, then keep serving until Ctrl-C",
    )
    p.add_argument("--host", default="127.0.0.1", help="with --console: address to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8000, help="with --console: port (default: 8000; 0 = any free port)"
    )
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `demo` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "demo",
        help="a thinker and a narrator sharing one model's memory, with a user interjection",
        description="Run the demo: a thinker solves a word problem while a narrator reports on its progress "
        "by reading the thinker's memory directly; halfway through, the user corrects the problem and both "
        "take it into account without restarting. Ends with a cost summary.",
    )
    configure_parser(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, console: Any = None) -> int:
    """Run the demo for parsed `args`; returns the exit code."""
    result = run_with_result(args, console)
    return 0 if result is not None or args.console else 1


def run_with_result(args: argparse.Namespace, console: Any = None) -> DemoResult | None:
    """Run the demo; None when it was stopped (Ctrl-C) before it ended (with --console)."""
    import torch
    from rich.console import Console

    import cothink

    console = console or Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    live = not args.no_live and console.is_terminal

    t0 = time.perf_counter()
    with console.status(f"loading {args.model} ({args.dtype})…", spinner="dots") if live else _nullcontext():
        engine = cothink.Engine.from_pretrained(args.model, dtype=dtype, quantize=args.quantize)
    console.print(
        f"[dim]loaded {args.model} ({args.dtype}, {torch.get_num_threads()} threads) "
        f"in {time.perf_counter() - t0:.1f}s[/dim]"
    )
    console.print(f"[bold]problem:[/bold] {PROBLEM}")
    if args.console:
        return _run_with_console(engine, args, console)
    result = asyncio.run(_run_displayed(engine, args, console, live))
    _print_summary(result, console)
    if args.trace:
        _write_trace(engine, args.trace, console)
    return result


async def _run_displayed(engine: Any, args: argparse.Namespace, console: Any, live: bool) -> DemoResult:
    async with engine:
        display = LiveDisplay(console) if live else PlainDisplay(console)
        with display:
            return await run_demo(
                engine,
                display,
                max_tokens=args.max_tokens,
                narrate_every=args.narrate_every,
                interject_at=args.interject_at,
                seed=args.seed,
            )


T = TypeVar("T")

# The main thread never blocks for long: the kernel may deliver Ctrl-C's SIGINT to any thread (the
# server's, the compute thread, the C kernels' helpers), and Python raises KeyboardInterrupt only when
# the main thread next runs; one indefinite wait would leave Ctrl-C unanswered.
WAKE_S = 0.25


def _wait_interruptibly(future: concurrent.futures.Future[T]) -> T:
    """future.result(), waking every WAKE_S so that a Ctrl-C is answered at once."""
    while True:
        try:
            return future.result(timeout=WAKE_S)
        except TimeoutError:
            continue


def _run_with_console(engine: Any, args: argparse.Namespace, console: Any) -> DemoResult | None:
    """Serve the engine with its live console; run the demo on the server's loop once a page is
    connected, then keep serving until Ctrl-C."""
    from cothink.server import BackgroundServer, ServerSettings, create_app

    name = Path(str(args.model).rstrip("/")).name or str(args.model)
    # no keys: the console shows every coroutine only where sessions may be listed without a key
    settings = ServerSettings(model_name=name, bind_host=args.host, list_sessions_without_key=True)
    app = create_app(engine, settings)
    server = BackgroundServer(app, host=args.host, port=args.port).start()
    result = None
    try:
        print(f"console: {server.url}/console", flush=True)
        console.print("[dim]the demo starts when the console page is open (Ctrl-C stops)[/dim]")
        hub = app.state.events
        while not hub.subscribers:
            time.sleep(0.1)
        demo = run_demo(
            engine,
            PlainDisplay(console),
            max_tokens=args.max_tokens,
            narrate_every=args.narrate_every,
            interject_at=args.interject_at,
            seed=args.seed,
        )
        assert server.loop is not None
        result = _wait_interruptibly(asyncio.run_coroutine_threadsafe(demo, server.loop))
        _print_summary(result, console)
        if args.trace:
            _write_trace(engine, args.trace, console)
        console.print(f"[dim]still serving {server.url}/console until Ctrl-C[/dim]")
        while True:
            time.sleep(WAKE_S)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return result


def _print_summary(result: DemoResult, console: Any) -> None:
    """The summary tables, then what was generated and what text passing would have re-encoded."""
    console.print()
    for table in summary_tables(result):
        console.print(table)
    saved = result.text_passing_total
    console.print(
        f"[bold]tokens generated[/bold]: thinker {result.thinker_generated}, "
        f"narrator {result.narrator_generated}; "
        f"[bold]narrations[/bold]: {len(result.narrations)} of {len(result.syncs)} syncs; "
        f"[bold]KV in use[/bold]: {result.kv_bytes_used / 2**20:.1f} MiB in {result.live_blocks} blocks"
    )
    console.print(
        f"A text-passing design would have re-encoded [bold]{saved}[/bold] tokens of ctx and thinker text "
        f"({len(result.syncs)} narrator syncs"
        + (" + 1 thinker restart" if result.interjected_at is not None else "")
        + "); cothink re-encoded none of it."
    )


def _write_trace(engine: Any, path: str, console: Any) -> None:
    try:
        from cothink.observability.timeline import render_timeline_png, write_chrome_trace
    except ImportError:  # pragma: no cover - the observability package is optional here
        console.print("[yellow]trace: cothink.observability.timeline is not available[/yellow]")
        return
    records = list(engine.timeline)
    trace = write_chrome_trace(records, path)
    png = render_timeline_png(
        records,
        Path(trace).with_suffix(".png"),
        title=f"cothink demo: {len(records)} steps (thinker, narrator, user)",
    )
    console.print(f"trace: {trace} (open in https://ui.perfetto.dev), timeline: {png}")


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser(
        argparse.ArgumentParser(prog="cothink demo", description=__doc__.split("\n")[0])
    )
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
