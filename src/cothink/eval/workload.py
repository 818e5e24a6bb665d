"""Deterministic inputs for the suites: long documents, prompts, arithmetic problems, random input."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cothink.errors import InvalidParameterError

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
    def operands(self) -> tuple[int, ...]:
        """The numbers the problem states."""
        return self.a, self.b, self.c, self.d

    @property
    def label(self) -> str:
        return self.expression

    def is_correct(self, text: str) -> bool:
        """The last number of the text is the answer."""
        nums = _integers(text)
        return bool(nums) and nums[-1] == self.answer

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


def _integers(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"-?\d+", text.replace(",", ""))]


class _ProblemLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    question: str = Field(min_length=1)
    answer: str | int | float


@dataclass(frozen=True)
class UserProblem:
    """A problem from a user's problem set (`--problems FILE`): a question and its expected answer.

    The question is the thinker's whole prompt. An answer that is a number is matched against the last
    number of the thinker's text; any other answer against the text itself (case-insensitive,
    whitespace-normalised substring)."""

    question: str
    answer: str

    @property
    def prompt(self) -> str:
        return self.question

    @property
    def label(self) -> str:
        return self.question if len(self.question) <= 60 else self.question[:57] + "..."

    @property
    def operands(self) -> tuple[int, ...]:
        return tuple(_integers(self.question))

    @property
    def steps(self) -> tuple[int, ...]:
        return ()  # intermediate results are unknown for a user problem

    def is_correct(self, text: str) -> bool:
        answer = self.answer.strip()
        if re.fullmatch(r"-?\d[\d,]*", answer):
            nums = _integers(text)
            return bool(nums) and nums[-1] == int(answer.replace(",", ""))
        norm = " ".join(text.lower().split())
        return " ".join(answer.lower().split()) in norm


def load_problems(path: str | Path) -> list[UserProblem]:
    """A problem set: JSON Lines, one {"question": ..., "answer": ...} object a line (blank lines and
    lines starting with # skipped); InvalidParameterError names the first bad line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidParameterError(f"--problems {path}: {exc.strerror or exc}", param="problems") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = _ProblemLine.model_validate(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(
                f"--problems {path}, line {no}: not JSON: {exc.msg}", param="problems"
            ) from None
        except ValidationError as exc:
            errs = "; ".join(
                f"{'.'.join(str(x) for x in e['loc']) or 'line'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidParameterError(f"--problems {path}, line {no}: {errs}", param="problems") from None
        out.append(UserProblem(item.question, str(item.answer)))
    if not out:
        raise InvalidParameterError(f"--problems {path}: no problems in the file", param="problems")
    return out
