"""Think while narrating: a background thinker and a probe-gated narrator reading the thinker's block live;
user input mid-reasoning goes into the context block the thinker reads.

Coroutines (engine names ``<name>.thinker`` etc., or bare ``thinker`` / ``narrator`` / ``user`` when
``name=""``):

- **thinker**: generates into its own block, reading ``[ctx, thinker]``; ctx holds the system prompt and
  the user's turns.
- **narrator**: every ``narrate_every`` thinker tokens, probes ``[ctx, thinker]`` ("has the thinker made
  progress worth reporting?"); when P(first choice) >= ``threshold`` (or after ``max_quiet`` quiet syncs)
  it says one short sentence generated in a scratch block after ``[ctx, thinker]``: it reads the
  thinker's live memory, only its short instruction is prefilled. When the thinker is done it gives a
  final narration.
- **user**: :meth:`ThinkNarrate.tell` appends a user turn to ctx (``engine.extend(ctx, ...)``) while the
  thinker runs; both coroutines read it from the next step on. With a :class:`Reaction`, the thinker pauses,
  writes the reaction note into its own block (the model completes the note by reading the new turn in
  ctx's memory), then the resume cue, and keeps generating: no restart, nothing re-encoded.

Chat formatting goes through the tokenizer's chat template (:class:`cothink.agents.chat.ChatFormat`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cothink.agents.base import Agent, AgentEvent


@dataclass(frozen=True)
class Reaction:
    """What the thinker writes into its own block when user input arrives while it reasons."""

    note: str = "\n\nUpdate: the user says"
    resume: str | None = None  # written after the model completed the note's line
    note_tokens: int = 16


@dataclass
class NarratorSync:
    """One narrator sync: what it read, what it cost, what a text-passing design would have cost."""

    index: int
    thinker_tokens: int  # tokens the thinker had generated when the sync began
    ctx_len: int  # ctx block length (tokens) at the sync
    thinker_len: int  # thinker block length (tokens) at the sync
    p_yes: float | None  # probe answer; None when the probe was skipped (final sync)
    spoke: bool
    text: str = ""
    prefilled: int = 0  # tokens the narrator prefilled for this sync (probe question + instruction)
    generated: int = 0
    final: bool = False

    @property
    def text_passing_reencode(self) -> int:
        """Tokens a text-passing narrator would have re-encoded: ctx + the thinker's text so far."""
        return self.ctx_len + self.thinker_len


@dataclass
class ThinkNarrateResult:
    thinker_text: str
    thinker_generated: int
    narrator_generated: int
    syncs: list[NarratorSync]
    inputs_at: list[int]  # thinker tokens generated when each user input arrived
    restart_reencode: int  # tokens a text-passing restart would have re-encoded at the inputs
    thinker_reaction_tokens: int  # note and resume tokens the thinker wrote after inputs
    ctx_tokens: list[int]
    thinker_block_len: int
    events: list[AgentEvent] = field(default_factory=list)

    @property
    def narrations(self) -> list[NarratorSync]:
        return [s for s in self.syncs if s.spoke]


class ThinkNarrate(Agent):
    """Constructor: ``engine`` (running), ``task`` (the user's problem), ``system`` (system prompt),
    ``max_tokens`` (thinker budget), ``narrate_every`` (thinker tokens between syncs), ``probe_question`` /
    ``probe_choices`` / ``threshold`` / ``max_quiet`` (the narrator's gate), ``instruction`` / ``prefix``
    (what the narrator is asked and how its sentence starts), ``final_instruction`` / ``final_prefix``,
    ``narration_tokens``, ``reaction`` (how the thinker takes user input; None: it only reads it in ctx),
    ``wait_for_input`` (when the thinker finishes early it waits for user input, or :meth:`end_input`),
    ``name``, ``on_event``, ``seed``."""

    def __init__(
        self,
        engine: Any,
        *,
        task: str,
        system: str = "You are a careful assistant. Think step by step.",
        max_tokens: int = 128,
        narrate_every: int = 16,
        probe_question: str = "Has the assistant made progress worth reporting? Answer yes or no.",
        probe_choices: tuple[str, str] = ("Yes", "No"),
        threshold: float = 0.5,
        max_quiet: int = 1,
        instruction: str = "In one sentence, what is the assistant doing right now?",
        prefix: str = "Right now, the assistant is",
        final_instruction: str = "In one sentence, what is the assistant's final answer?",
        final_prefix: str = "The assistant's final answer is",
        narration_tokens: int = 20,
        reaction: Reaction | None = Reaction(),
        wait_for_input: bool = False,
        name: str = "",
        on_event: Callable[[AgentEvent], None] | None = None,
        seed: int = 0,
    ):
        super().__init__(engine, name=name, on_event=on_event)
        self.task, self.system = task, system
        self.max_tokens, self.narrate_every = max_tokens, max(1, narrate_every)
        self.probe_question, self.probe_choices = probe_question, probe_choices
        self.threshold, self.max_quiet = threshold, max_quiet
        self.instruction, self.prefix = instruction, prefix
        self.final_instruction, self.final_prefix = final_instruction, final_prefix
        self.narration_tokens, self.reaction, self.wait_for_input = narration_tokens, reaction, wait_for_input
        self.seed = seed
        self.syncs: list[NarratorSync] = []
        self.generated = 0  # thinker tokens generated so far
        self.text = ""
        self.done = False
        self.waiting = False  # the thinker finished early and waits for input
        self._progress = asyncio.Condition()
        self._inputs: list[str] = []
        self._input_event = asyncio.Event()
        self._input_closed = False
        self._ctx: Any = None
        self._block: Any = None
        self._inputs_at: list[int] = []
        self._restart = 0
        self._reaction_tokens = 0
        self._ready = asyncio.Event()

    # ---- user side ------------------------------------------------------------------------------
    async def tell(self, text: str) -> None:
        """Append a user turn to the context the thinker reads (mid-reasoning input)."""
        await self._ready.wait()
        self.emit("input", "user", text)
        await self.engine.extend(
            self._ctx,
            self.chat.user_turn(text),
            view=[self._ctx],
            name=self.coroutine("user"),
            priority="interactive",
        )
        self._inputs_at.append(self.generated)
        self._restart += len(self._ctx) + len(self._block)
        self._inputs.append(text)
        self._input_event.set()
        await self._notify()

    def end_input(self) -> None:
        """No more input will come (a thinker waiting for input stops waiting)."""
        self._input_closed = True
        self._input_event.set()

    async def wait_progress(self, tokens: int) -> None:
        """Until the thinker generated `tokens` tokens, finished, or waits for input."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.generated >= tokens or self.done or self.waiting)

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    # ---- the thinker -----------------------------------------------------------------------------
    async def _stream(self, max_new: int, stop: list[str] | None = None, interruptible: bool = True) -> str:
        gen = self.engine.generate(
            [self._ctx, self._block],
            max_tokens=max_new,
            stop=stop,
            name=self.coroutine("thinker"),
            seed=self.seed,
        )
        async for piece in gen:  # every token arrives in a piece, the ending one included
            n = len(piece.token_ids)
            self.generated += n
            self.text += piece.text
            self.emit("thought", "thinker", piece.text, tokens=n)
            await self._notify()
            if interruptible and self._input_event.is_set() and self._inputs:
                gen.cancel()  # pause: the tokens already emitted stay in the block
                return "interrupted"
        assert gen.result is not None
        return gen.result.finish_reason

    async def _write(self, text: str, reaction: bool = True) -> None:
        ids = self.chat.encode(text)
        await self.engine.extend(
            self._block, token_ids=ids, view=[self._ctx, self._block], name=self.coroutine("thinker")
        )
        self._reaction_tokens += len(ids) if reaction else 0

    async def _thinker(self) -> None:
        try:
            await self._write(
                self.chat.assistant_opener(
                    [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
                ),
                False,
            )
            reason = await self._stream(self.max_tokens)
            while True:
                left = self.max_tokens - self.generated
                if left <= 0:
                    return
                if not self._inputs and reason == "stop" and self.wait_for_input and not self._input_closed:
                    self.waiting = True
                    await self._notify()
                    await self._input_event.wait()
                    self.waiting = False
                if not self._inputs:
                    return
                self._inputs.clear()
                self._input_event.clear()
                if self.reaction is None:
                    if reason == "stop":
                        await self._write(self.chat.reopen())
                    reason = await self._stream(left)
                    continue
                note = (
                    self.reaction.note
                    if reason != "stop"
                    else self.chat.reopen() + self.reaction.note.lstrip()
                )
                shown = self.reaction.note if reason != "stop" else "\n" + self.reaction.note.lstrip()
                self.emit("thought", "thinker", shown)
                self.text += self.reaction.note
                await self._write(note)
                reason = await self._stream(
                    min(self.reaction.note_tokens, left), stop=["\n"], interruptible=False
                )
                if self.reaction.resume:
                    resume = self.reaction.resume if reason == "stop" else "\n" + self.reaction.resume
                    self.emit("thought", "thinker", "\n" + self.reaction.resume)
                    self.text += "\n" + self.reaction.resume
                    await self._write(resume)
                left = self.max_tokens - self.generated
                if left <= 0:
                    return
                reason = await self._stream(left)
        finally:
            self.done = True
            await self._notify()

    # ---- the narrator ----------------------------------------------------------------------------
    async def _narrate(self, sync: NarratorSync) -> None:
        engine, name = self.engine, self.coroutine("narrator")
        block = engine.block(f"{name}-{sync.index}")
        instruction, prefix = (
            (self.final_instruction, self.final_prefix) if sync.final else (self.instruction, self.prefix)
        )
        prompt = self.chat.encode(self.chat.question(instruction) + prefix)
        view = [self._ctx, self._block, block]
        try:
            await engine.extend(block, token_ids=prompt, view=view, name=name, priority="interactive")
            sync.prefilled += len(prompt)
            res = await engine.generate(
                view,
                max_tokens=self.narration_tokens,
                stop=["\n", "."],
                name=name,
                priority="interactive",
                seed=self.seed,
            ).collect()
            sync.generated = len(res.token_ids)
            sync.text = (prefix + res.text).strip() + "."
        finally:
            engine.release(block)

    async def _narrator(self) -> None:
        quiet = 0
        next_at = self.narrate_every
        probe_q = self.chat.encode(self.chat.question(self.probe_question))
        while True:
            async with self._progress:
                await self._progress.wait_for(lambda: self.generated >= next_at or self.done)
            final = self.done
            sync = NarratorSync(
                len(self.syncs) + 1, self.generated, len(self._ctx), len(self._block), None, True, final=final
            )
            self.syncs.append(sync)
            if not final:
                answer = await self.engine.probe(
                    [self._ctx, self._block],
                    probe_q,
                    choices=self.probe_choices,
                    name=self.coroutine("narrator"),
                    priority="interactive",
                )
                sync.prefilled += len(probe_q)
                sync.p_yes = answer[self.probe_choices[0]]
                sync.spoke = sync.p_yes >= self.threshold or quiet >= self.max_quiet
                self.emit("probe", "narrator", self.probe_question, value=sync.p_yes)
            if sync.spoke:
                quiet = 0
                await self._narrate(sync)
                self.emit("said", "narrator", sync.text, tokens=sync.generated)
            else:
                quiet += 1
            if final:
                return
            next_at = self.generated + self.narrate_every

    # ---- run -------------------------------------------------------------------------------------
    async def run(self, inputs: Any = None) -> ThinkNarrateResult:
        """Think and narrate until the thinker is done. `inputs` (optional): an async iterator of user
        texts, each told as it comes (or call :meth:`tell` from another coroutine)."""
        engine = self.engine
        self._start_clock()
        self._ctx = engine.block(self.coroutine("ctx"))
        self._block = engine.block(self.coroutine("thinker"))
        await engine.extend(
            self._ctx,
            self.chat.conversation(
                [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
            ),
            name=self.coroutine("user"),
            priority="interactive",
        )
        self._ready.set()

        async def feed() -> None:
            if inputs is None:
                return
            async for text in inputs:
                if self.done:
                    break
                await self.tell(text)
            self.end_input()

        feeder = asyncio.create_task(feed(), name=self.coroutine("user"))
        try:
            await asyncio.gather(self._thinker(), self._narrator())
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        narrated = sum(s.generated for s in self.syncs)
        return ThinkNarrateResult(
            self.text,
            self.generated,
            narrated,
            list(self.syncs),
            list(self._inputs_at),
            self._restart,
            self._reaction_tokens,
            list(self._ctx.tokens),
            len(self._block),
            list(self.events),
        )

    def release(self) -> None:
        """Free the context and thinker blocks (after run)."""
        for b in (self._ctx, self._block):
            if b is not None:
                self.engine.release(b)
        self._ctx = self._block = None
