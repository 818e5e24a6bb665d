"""Shipped layouts, and layouts the model designs from an environment description.

The model reads the environment description, a summary of the format and one full example, and writes
a layout as JSON. The proposal is parsed and validated; a rejected proposal gets its validation errors
back once; a second failure falls back to a named default layout. A layout is data, never code: nothing
the model writes is executed, only validated and interpreted by the generic runner.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from cothink.layouts.model import Layout
from cothink.layouts.validate import LayoutIssue, check_text

SHIPPED = ("think-narrate", "stream-agent", "strategist-actor", "monitor")

Proposer = Callable[[str], Awaitable[str]]  # prompt -> the model's text


def shipped_text(name: str) -> str:
    if name not in SHIPPED:
        raise KeyError(f"no shipped layout {name!r}; shipped: {', '.join(SHIPPED)}")
    return resources.files("cothink.layouts").joinpath("shipped", f"{name}.json").read_text()


def shipped_layout(name: str) -> Layout:
    """One of the four patterns as a layout: think-narrate, stream-agent, strategist-actor, monitor."""
    return Layout.model_validate_json(shipped_text(name))


FORMAT_SUMMARY = """\
A layout is JSON: {"name", "description", "system", "task", "blocks": [...], "coroutines": [...]}.
blocks: {"name", "kind": "context" | "stream" | "scratch", "max_tokens"?}. context starts with [system, task];
stream receives input events; scratch is a coroutine's own block.
coroutines: {"name", "role": "generate" | "probe" | "rule", "reads": [block...], "writes": block | null,
"prompt", "choices": [...] (probe), "triggers": [...], "priority": {"class": "interactive" | "background",
"weight"}, "stop": {"max_tokens", "stop": [...], "max_runs", "min_gap_s"}, "output": bool, "repeat": bool}.
triggers: {"kind": "start"} | {"kind": "event"} | {"kind": "every_tokens", "coroutine", "tokens"} |
{"kind": "probe", "probe", "choice", "threshold"} | {"kind": "timer", "seconds"} |
{"kind": "done", "coroutine"}.
Rules: every block named must be declared; a block has at most one writer; a generate coroutine's reads
must end with the block it writes; a rule writes the block events go to and has an event trigger; a cycle
of triggers needs a start, event or timer trigger somewhere."""


def design_prompt(environment: str, example: str = "monitor") -> str:
    return (
        "Design a coroutine layout for this environment.\n\nEnvironment:\n"
        f"{environment}\n\nFormat:\n{FORMAT_SUMMARY}\n\nExample:\n{shipped_text(example)}\n"
        "Answer with the JSON layout only."
    )


def retry_prompt(issues: list[LayoutIssue]) -> str:
    lines = "\n".join(f"- {i}" for i in issues)
    return f"The layout is invalid:\n{lines}\nWrite the corrected JSON layout only."


def extract_json(text: str) -> str:
    """The first balanced {...} object in the text (models wrap JSON in prose or code fences)."""
    start = text.find("{")
    if start < 0:
        return text
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            esc = (c == "\\") and not esc
            if c == '"' and not esc:
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return text[start:]


@dataclass
class Attempt:
    text: str
    issues: list[LayoutIssue]


@dataclass
class DesignOutcome:
    layout: Layout
    source: str  # "proposal" (first), "retry" (after the errors were sent back), "fallback"
    attempts: list[Attempt] = field(default_factory=list)
    fallback: str | None = None


async def design_layout(
    environment: str, propose: Proposer, *, fallback: str = "think-narrate"
) -> DesignOutcome:
    """Ask `propose` for a layout, send the validation errors back once, else fall back to `fallback`."""
    attempts: list[Attempt] = []
    prompt = design_prompt(environment)
    for source in ("proposal", "retry"):
        text = await propose(prompt)
        issues, layout = check_text(extract_json(text))
        attempts.append(Attempt(text, issues))
        if layout is not None:
            return DesignOutcome(layout, source, attempts)
        prompt = prompt + "\n\nYour answer:\n" + text + "\n\n" + retry_prompt(issues)
    return DesignOutcome(shipped_layout(fallback), "fallback", attempts, fallback)


def engine_proposer(engine: Any, *, max_tokens: int = 512, name: str = "designer") -> Proposer:
    """A proposer that asks the engine's model (chat template; a fresh block per proposal)."""
    from cothink.agents.chat import ChatFormat

    chat = ChatFormat(engine.tokenizer)

    async def propose(prompt: str) -> str:
        msgs = [
            {"role": "system", "content": "You design coroutine layouts as JSON."},
            {"role": "user", "content": prompt},
        ]
        block = engine.block(name)
        try:
            await engine.extend(block, chat.render(msgs, generation_prompt=True), name=name)
            res = await engine.generate([block], max_tokens=max_tokens, name=name).collect()
            return res.text
        finally:
            engine.release(block)

    return propose


def layout_json(layout: Layout) -> str:
    return json.dumps(layout.model_dump(by_alias=True, exclude_defaults=True), indent=2)
