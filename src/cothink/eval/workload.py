"""Deterministic inputs for the suites: long documents, prompts, arithmetic problems, random input."""

from __future__ import annotations

import random
from dataclasses import dataclass

_SENSORS = ("boiler", "pump", "fan", "valve", "compressor", "turbine", "chiller", "heater", "mixer", "press")
_UNITS = ("kPa", "rpm", "degrees", "litres per minute", "volts", "amperes")
_WORDS = (
    "the system reported a change in load while the operator watched the main panel and noted the "
    "values for later review because the shift supervisor asked for a summary at the end of the day"
).split()


def document_text(seed: int, records: int) -> str:
    """A plant log: numbered sensor readings (deterministic in seed)."""
    rng = random.Random(seed)
    lines = []
    for i in range(records):
        hh, mm = divmod(6 * 60 + 3 * i, 60)
        lines.append(
            f"Record {i + 1} at {hh % 24:02d}:{mm:02d}: the {rng.choice(_SENSORS)} sensor read "
            f"{rng.randint(10, 999)} {rng.choice(_UNITS)}."
        )
    return "Plant log.\n" + "\n".join(lines) + "\n"


def document_tokens(model, seed: int, n_tokens: int) -> list[int]:
    """At least the first n_tokens tokens of a plant log (grown until long enough)."""
    records = max(8, n_tokens // 12)
    while True:
        ids = model.encode(document_text(seed, records))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        records *= 2


def filler_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_token_ids(rng: random.Random, vocab: int, n: int, low: int = 100) -> list[int]:
    """Random input: uniformly drawn ids (avoiding the low special range)."""
    return [rng.randrange(low, vocab) for _ in range(n)]


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    c: int
    d: int

    @property
    def expression(self) -> str:
        return f"(({self.a}+{self.b})*{self.c})-{self.d}"

    @property
    def steps(self) -> tuple[int, int, int]:
        s1 = self.a + self.b
        s2 = s1 * self.c
        return s1, s2, s2 - self.d

    @property
    def answer(self) -> int:
        return self.steps[-1]

    @property
    def prompt(self) -> str:
        return (
            f"Compute {self.expression} step by step: first the sum, then the product, then the difference. "
            "Be brief. "
            f"End with 'Answer: <number>'."
        )


def problems(seed: int, n: int) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = Problem(rng.randint(2, 19), rng.randint(2, 19), rng.randint(2, 9), rng.randint(1, 30))
        if p not in out:
            out.append(p)
    return out
