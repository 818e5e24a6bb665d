"""llguidance matchers behind cothink's TokenConstraint protocol (see cothink.execution.sampling)."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from cothink.errors import InvalidParameterError

# Compact JSON: no free whitespace between tokens. Models write compact JSON well, and flexible
# whitespace lets a weak model spend its whole budget on newlines inside a valid prefix.
JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidSchemaError(InvalidParameterError):
    """A JSON schema or grammar that the constraint compiler rejects (`param` names the field)."""


class GrammarError(InvalidSchemaError):
    """A grammar that compiled but cannot go on during generation: the schema is beyond the matcher's
    limits (an `anyOf` of thousands of options, a `$ref` that refers only to itself). The
    generation fails with this error; it never ends as "stop" with output the grammar did not accept."""


# The matcher's message ends with a dump of its internal state after a "<state>" line: not for clients.
_STATE_DUMP = "<state>"


def grammar_problem(message: str) -> str:
    """The first lines of a matcher error, without the state dump that follows them."""
    head = message.split(_STATE_DUMP, 1)[0].strip()
    return head.splitlines()[0][:300] if head else "the grammar cannot continue"


class GrammarConstraint:
    """One generation's grammar state: `allowed()` masks the next token, `advance()` consumes one."""

    def __init__(self, matcher: Any, vocab_size: int, tokenizer_vocab: int, param: str = "response_format"):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tokenizer_vocab = min(tokenizer_vocab, vocab_size)
        self.param = param
        self.ended = False
        self.dead_end = False  # the last mask allowed no token: the next `advance` fails

    def allowed(self) -> torch.Tensor | None:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        words = np.unpackbits(bits, bitorder="little")[: self.tokenizer_vocab].astype(bool)
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[: len(words)] = torch.from_numpy(words)
        # A matcher in error allows nothing. The batched sampler still needs a row, so any token
        # is drawn, and `advance` then fails the generation before that token is written.
        self.dead_end = self.matcher.is_error() or not bool(mask.any())
        return None if self.dead_end else mask

    def advance(self, token_id: int) -> None:
        """Consume a sampled token; GrammarError when the matcher cannot go on (its limits, a
        grammar with no way forward)."""
        if not self.dead_end and self.matcher.is_stopped() and not self.matcher.is_error():
            self.ended = True  # the end-of-sequence token the grammar allows once it is complete
            return
        if not self.dead_end:
            self.matcher.consume_token(int(token_id))
        if self.dead_end or self.matcher.is_error():
            problem = grammar_problem(self.matcher.get_error() or "no token can continue the output")
            raise GrammarError(f"the schema cannot be followed: {problem}", param=self.param)

    def done(self) -> bool:
        # The engine ends the generation after the token that completed the grammar (that token is
        # part of the text); an end-of-sequence token the grammar allows once complete also ends it.
        # A matcher in error is stopped too, but not complete: `advance` raised for it.
        return self.ended or (self.matcher.is_stopped() and not self.matcher.is_error())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None


class GrammarCompiler:
    """Compiles JSON schemas (and Lark grammars) for one tokenizer; the tokenizer table is built once."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def _tok(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
            return self._ll_tokenizer

    def warm(self) -> None:
        """Build the tokenizer table now (a fraction of a second), e.g. in a thread at startup."""
        self._tok()

    def constraint(self, grammar: str, param: str) -> GrammarConstraint:
        import llguidance

        tok = self._tok()
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidSchemaError(
                f"the grammar is invalid: {grammar_problem(matcher.get_error())}", param=param
            )
        return GrammarConstraint(matcher, self.vocab_size, tok.vocab_size, param)

    def json_schema(self, schema: dict[str, Any] | bool, param: str = "response_format") -> GrammarConstraint:
        return self.constraint(self.json_grammar(schema, param), param)

    def json_grammar(self, schema: dict[str, Any] | bool, param: str = "response_format") -> str:
        import llguidance

        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed(schema)), defaults=dict(JSON_OPTIONS)
            )
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidSchemaError(f"the JSON schema is not supported: {exc}", param=param) from None

    def text_or_json(self, schema: dict[str, Any], param: str = "tools") -> GrammarConstraint:
        """Free text that does not start with '{', or a JSON value matching `schema` (tool_choice
        auto: the model decides whether to call a tool, and a call always parses)."""
        body = json.dumps({**closed(schema), "x-guidance": dict(JSON_OPTIONS)})
        lark = f"start: free | call\nfree: /[^{{\\s][\\s\\S]*/\ncall: %json {body}\n"
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidSchemaError(f"the tool schemas are not supported: {exc}", param=param) from None
        return self.constraint(grammar, param)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its properties and says
    nothing about others, as OpenAI's strict mode: a model should not invent fields (or arguments)."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON a tool call is written as: {"name": <one of the tools>, "arguments": <its schema>}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = closed(fn.get("parameters") or {"type": "object", "properties": {}})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}
