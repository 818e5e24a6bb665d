"""Shipped layouts, and layouts the model designs from an environment description.

The model reads the environment description, a summary of the format and one full example, and writes
a layout as JSON. The engine's proposer constrains that answer with the layout's JSON Schema (bounded by
:class:`ProposalBounds`: :func:`proposal_schema`) through grammar-constrained decoding, so a proposal is
always JSON of the layout's shape and always completes within its token budget (:func:`max_chars`). The
proposal is then validated for meaning (declared blocks, one writer per block, views, triggers); a
rejected proposal gets its validation errors back once; a second failure falls back to a named default
layout. A layout is data, never code: nothing the model writes is executed, only validated and
interpreted by the generic runner.
"""

from __future__ import annotations

import asyncio
import copy
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

    @property
    def designed(self) -> bool:
        """The layout is the model's own (not the fallback)."""
        return self.source != "fallback"


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


# ------------------------------------------------------------------------------ constrained proposals

# printable ASCII without '"' and '\\': each character is one byte of JSON, never an escape
_PLAIN = r"[ !#-\[\]-~]"
_NAMES = {"name", "writes", "reads", "coroutine", "probe", "choice", "choices"}  # short identifiers
_NUMBERS = (0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0)  # what a number field may take


@dataclass(frozen=True)
class ProposalBounds:
    """Bounds that make every proposal finite: strings, lists and integers of a designed layout.

    Names (blocks, coroutines, choices, the references to them) are plain ASCII of at most
    `name_chars`; other texts (system, task, description, prompts) of at most `text_chars`; stop strings
    of at most `stop_chars` (a newline allowed); every list holds at most `items` entries, a layout at
    most `blocks` blocks and `coroutines` coroutines; integers are at most `max_int`; numbers take one of
    a few round values (0.1 ... 30) inside their field's range."""

    name_chars: int = 24
    text_chars: int = 200
    stop_chars: int = 8
    items: int = 6
    blocks: int = 4
    coroutines: int = 5
    max_int: int = 512


def proposal_schema(bounds: ProposalBounds = ProposalBounds()) -> dict[str, Any]:
    """The layout's JSON Schema (:class:`Layout`), bounded for a constrained proposal: a text that
    matches it parses into a Layout (a trigger always names its `kind`, the tag of its type)."""
    schema = copy.deepcopy(Layout.model_json_schema())
    return _bound(schema, None, bounds)


def _bound(node: Any, prop: str | None, b: ProposalBounds) -> Any:
    if isinstance(node, list):
        return [_bound(x, prop, b) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "oneOf" in node:  # a discriminated union: its options exclude each other by their tag
        node["anyOf"] = node.pop("oneOf")
    node.pop("discriminator", None)
    props = node.get("properties")
    if isinstance(props, dict):
        node["properties"] = {k: _bound(v, k, b) for k, v in props.items()}
        tags = [k for k, v in props.items() if isinstance(v, dict) and "const" in v]
        if tags:
            node["required"] = sorted({*node.get("required", []), *tags})
    for key in ("$defs", "anyOf", "items"):
        if key in node:
            node[key] = (
                {k: _bound(v, k, b) for k, v in node[key].items()}
                if key == "$defs"
                else _bound(node[key], prop, b)
            )
    kind = node.get("type")
    if kind == "string" and "enum" not in node and "const" not in node:
        node.pop("minLength", None)
        node.pop("maxLength", None)
        if prop == "stop":
            node["pattern"] = rf"^(?:{_PLAIN}|\n){{1,{b.stop_chars}}}$"
        elif prop in _NAMES:
            node["pattern"] = rf"^{_PLAIN}{{1,{b.name_chars}}}$"
        else:
            node["pattern"] = rf"^{_PLAIN}{{0,{b.text_chars}}}$"
    elif kind == "array":
        node["maxItems"] = {"blocks": b.blocks, "coroutines": b.coroutines}.get(prop or "", b.items)
    elif kind == "integer":
        node["maximum"] = min(node.get("maximum", b.max_int), b.max_int)
    elif kind == "number":
        low, high = node.get("minimum"), node.get("maximum")
        above = node.get("exclusiveMinimum")
        node["enum"] = [
            v for v in _NUMBERS
            if (low is None or v >= low) and (high is None or v <= high) and (above is None or v > above)
        ]
        for key in ("type", "minimum", "maximum", "exclusiveMinimum", "default"):
            node.pop(key, None)
    return node


def max_chars(schema: dict[str, Any], node: Any = None) -> int:
    """The longest text (in bytes) a bounded schema from :func:`proposal_schema` admits, separators
    counted with a space after each: a constrained proposal given this many tokens always completes
    (every token is at least one byte)."""
    node = schema if node is None else node
    if isinstance(node, bool):
        return len("false")
    if "$ref" in node:
        return max_chars(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in node:
        return max(max_chars(schema, x) for x in node["anyOf"])
    if "const" in node:
        return len(json.dumps(node["const"]))
    if "enum" in node:
        return max(len(json.dumps(v)) for v in node["enum"])
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties", {})
        fields = sum(len(json.dumps(k)) + 2 + max_chars(schema, v) for k, v in props.items())
        return 2 + fields + 2 * max(0, len(props) - 1)
    if kind == "array":
        n = node["maxItems"]
        return 2 + n * max_chars(schema, node.get("items", {})) + 2 * max(0, n - 1)
    if kind == "string":
        pattern = node["pattern"]
        limit = int(pattern.rsplit("{", 1)[1].split("}")[0].split(",")[-1])
        return 2 + limit * (6 if r"\n" in pattern else 1)  # a newline may be written \u000a
    if kind == "integer":
        return len(str(node["maximum"])) + 1
    if kind == "boolean":
        return len("false")
    if kind == "null":
        return len("null")
    raise ValueError(f"unbounded schema node: {node}")


def engine_proposer(
    engine: Any,
    *,
    max_tokens: int | None = None,
    name: str = "designer",
    bounds: ProposalBounds = ProposalBounds(),
    temperature: float = 0.0,
    seed: int | None = None,
) -> Proposer:
    """A proposer that asks the engine's model (chat template; a fresh block per proposal), its answer
    constrained to :func:`proposal_schema` (`bounds`). `max_tokens` None: the schema's worst case
    (:func:`max_chars`), so every proposal completes; a smaller budget may cut one (then it is
    rejected as invalid JSON and its errors go back). `temperature` 0: greedy; otherwise sampled with
    `seed`."""
    from cothink.agents.chat import ChatFormat
    from cothink.structured import GrammarCompiler

    chat = ChatFormat(engine.tokenizer)
    schema = proposal_schema(bounds)
    vocab = getattr(getattr(engine.runner, "config", None), "vocab_size", None)
    compiler = GrammarCompiler(engine.tokenizer, vocab)
    grammar = compiler.json_grammar(schema, param="layout")
    budget = max_tokens if max_tokens is not None else max_chars(schema)

    async def propose(prompt: str) -> str:
        msgs = [
            {"role": "system", "content": "You design coroutine layouts as JSON."},
            {"role": "user", "content": prompt},
        ]
        await asyncio.to_thread(compiler.warm)  # the tokenizer table, built once, off the event loop
        block = engine.block(name)
        try:
            await engine.extend(block, chat.render(msgs, generation_prompt=True), name=name)
            constraint = compiler.constraint(grammar, "layout")
            res = await engine.generate(
                [block], max_tokens=budget, name=name, constraint=constraint, temperature=temperature,
                seed=seed,
            ).collect()
            return res.text
        finally:
            engine.release(block)

    return propose


def layout_json(layout: Layout) -> str:
    """The layout as JSON that `parse` reads back: unset optional fields are left out, but defaults are
    kept (a trigger's `kind` is a default, and without it the trigger cannot be read)."""
    return json.dumps(layout.model_dump(by_alias=True, exclude_none=True), indent=2)
