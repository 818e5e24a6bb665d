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


class GrammarConstraint:
    """One generation's grammar state: `allowed()` masks the next token, `advance()` consumes one."""

    def __init__(self, matcher: Any, vocab_size: int, tokenizer_vocab: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tokenizer_vocab = min(tokenizer_vocab, vocab_size)
        self.ended = False

    def allowed(self) -> torch.Tensor | None:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        words = np.unpackbits(bits, bitorder="little")[: self.tokenizer_vocab].astype(bool)
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[: len(words)] = torch.from_numpy(words)
        if not bool(mask.any()):  # a dead end cannot happen with sampled-from-mask tokens; be safe
            return None
        return mask

    def advance(self, token_id: int) -> None:
        if self.matcher.is_stopped():
            self.ended = True  # the end-of-sequence token the grammar allows once it is complete
        else:
            self.matcher.consume_token(int(token_id))

    def done(self) -> bool:
        # The engine ends the generation after the token that completed the grammar (that token is
        # part of the text); an end-of-sequence token the grammar allows once complete also ends it.
        return self.ended or self.matcher.is_stopped()

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
            raise InvalidSchemaError(f"the grammar is invalid: {matcher.get_error()}", param=param)
        return GrammarConstraint(matcher, self.vocab_size, tok.vocab_size)

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
