"""Layout validation: structure (pydantic) and meaning (blocks, writers, views, triggers).

Each problem is a :class:`LayoutIssue` naming the field (``coroutines[2].reads[1]``) and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from cothink.layouts.model import (
    DoneTrigger,
    EventTrigger,
    EveryTokensTrigger,
    Layout,
    ProbeTrigger,
    StartTrigger,
    TimerTrigger,
)


@dataclass(frozen=True)
class LayoutIssue:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def validate(layout: Layout) -> list[LayoutIssue]:
    """Every semantic problem of a parsed layout (empty: valid)."""
    issues: list[LayoutIssue] = []
    blocks = {b.name for b in layout.blocks}
    seen_blocks: set[str] = set()
    for i, b in enumerate(layout.blocks):
        if b.name in seen_blocks:
            issues.append(LayoutIssue(f"blocks[{i}].name", f"block {b.name!r} is declared twice"))
        seen_blocks.add(b.name)
    names: dict[str, int] = {}
    for i, c in enumerate(layout.coroutines):
        if c.name in names:
            issues.append(LayoutIssue(f"coroutines[{i}].name", f"coroutine {c.name!r} is declared twice"))
        names.setdefault(c.name, i)
    writer: dict[str, str] = {}
    for i, c in enumerate(layout.coroutines):
        at = f"coroutines[{i}]"
        for j, r in enumerate(c.reads):
            if r not in blocks:
                issues.append(LayoutIssue(f"{at}.reads[{j}]", f"unknown block {r!r}"))
        if len(set(c.reads)) != len(c.reads):
            issues.append(LayoutIssue(f"{at}.reads", "a view names a block twice"))
        if c.writes is not None:
            if c.writes not in blocks:
                issues.append(LayoutIssue(f"{at}.writes", f"unknown block {c.writes!r}"))
            elif c.writes in writer:
                issues.append(
                    LayoutIssue(
                        f"{at}.writes",
                        f"block {c.writes!r} is written by two coroutines "
                        f"({writer[c.writes]!r} and {c.name!r})",
                    )
                )
            else:
                writer[c.writes] = c.name
        if c.role == "generate":
            if c.writes is None:
                issues.append(LayoutIssue(f"{at}.writes", "a generate coroutine must write a block"))
            elif not c.reads or c.reads[-1] != c.writes:
                issues.append(
                    LayoutIssue(f"{at}.reads", f"the view must end with the written block {c.writes!r}")
                )
        elif c.role == "probe":
            if c.writes is not None:
                issues.append(LayoutIssue(f"{at}.writes", "a probe writes no block"))
            if len(c.choices) < 2 or len(set(c.choices)) != len(c.choices):
                issues.append(LayoutIssue(f"{at}.choices", "a probe needs at least two distinct choices"))
            if not c.prompt:
                issues.append(LayoutIssue(f"{at}.prompt", "a probe needs a question"))
            if not c.reads:
                issues.append(LayoutIssue(f"{at}.reads", "a probe must read at least one block"))
        else:  # rule
            if c.writes is None:
                issues.append(LayoutIssue(f"{at}.writes", "a rule appends events to a block: name it"))
            if not any(isinstance(t, EventTrigger) for t in c.triggers):
                issues.append(LayoutIssue(f"{at}.triggers", "a rule runs on events: add an 'event' trigger"))
        if not c.triggers:
            issues.append(LayoutIssue(f"{at}.triggers", "a coroutine needs at least one trigger"))
        for j, t in enumerate(c.triggers):
            ref = getattr(t, "coroutine", None) or getattr(t, "probe", None)
            if ref is not None and ref not in names:
                issues.append(LayoutIssue(f"{at}.triggers[{j}]", f"unknown coroutine {ref!r}"))
                continue
            if isinstance(t, ProbeTrigger):
                probe = layout.coroutines[names[t.probe]]
                if probe.role != "probe":
                    issues.append(LayoutIssue(f"{at}.triggers[{j}].probe", f"{t.probe!r} is not a probe"))
                elif t.choice not in probe.choices:
                    issues.append(
                        LayoutIssue(
                            f"{at}.triggers[{j}].choice", f"{t.choice!r} is not a choice of {t.probe!r}"
                        )
                    )
            if isinstance(t, EveryTokensTrigger) and layout.coroutines[names[t.coroutine]].role != "generate":
                issues.append(
                    LayoutIssue(f"{at}.triggers[{j}].coroutine", f"{t.coroutine!r} generates no tokens")
                )
    issues += _trigger_cycles(layout)
    return issues


def _trigger_cycles(layout: Layout) -> list[LayoutIssue]:
    """A cycle of triggers in which every coroutine waits for another one of the cycle and none has an
    independent source (start, event, timer) can never make progress."""
    by_name = {c.name: c for c in layout.coroutines}
    deps: dict[str, set[str]] = {c.name: set() for c in layout.coroutines}
    independent: set[str] = set()
    for c in layout.coroutines:
        for t in c.triggers:
            if isinstance(t, StartTrigger | EventTrigger | TimerTrigger):
                independent.add(c.name)
            elif isinstance(t, EveryTokensTrigger | DoneTrigger) and t.coroutine in by_name:
                deps[c.name].add(t.coroutine)
            elif isinstance(t, ProbeTrigger) and t.probe in by_name:
                deps[c.name].add(t.probe)
    issues, reported = [], set()
    for comp in _strongly_connected(deps):
        cyclic = len(comp) > 1 or next(iter(comp)) in deps[next(iter(comp))]
        if not cyclic or comp & independent:
            continue
        key = frozenset(comp)
        if key in reported:
            continue
        reported.add(key)
        order = [c.name for c in layout.coroutines if c.name in comp]
        first = next(i for i, c in enumerate(layout.coroutines) if c.name == order[0])
        issues.append(
            LayoutIssue(
                f"coroutines[{first}].triggers",
                "trigger cycle with no progress: "
                + " -> ".join([*order, order[0]])
                + " (each waits for another; give one of them a start, event or timer trigger)",
            )
        )
    return issues


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm (iterative enough for layouts of a few dozen coroutines)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "layout"


def parse(text: str) -> tuple[Layout | None, list[LayoutIssue]]:
    """Parse JSON text into a Layout: (layout, []) or (None, issues)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, [LayoutIssue("layout", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")]
    try:
        return Layout.model_validate(data), []
    except ValidationError as e:
        issues = []
        for err in e.errors():
            raw = err["loc"]
            # drop the union tag pydantic puts after a trigger's index (triggers[1].probe.threshold)
            loc = tuple(
                p
                for i, p in enumerate(raw)
                if not (
                    i >= 2 and raw[i - 2] == "triggers" and isinstance(raw[i - 1], int) and p in _TRIGGER_TAGS
                )
            )
            issues.append(LayoutIssue(_loc(loc), err["msg"]))
        return None, issues


_TRIGGER_TAGS = {"start", "event", "every_tokens", "probe", "timer", "done"}


def check_text(text: str) -> tuple[list[LayoutIssue], Layout | None]:
    """Parse and validate: (issues, layout when valid)."""
    layout, issues = parse(text)
    if layout is None:
        return issues, None
    issues = validate(layout)
    return issues, (layout if not issues else None)
