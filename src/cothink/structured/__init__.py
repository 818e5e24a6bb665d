"""Grammar-constrained decoding: JSON schemas and tool calls as `TokenConstraint`s for `engine.generate`.

    from cothink.structured import GrammarCompiler
    grammars = GrammarCompiler(engine.tokenizer, vocab_size)
    gen = engine.generate(view, constraint=grammars.json_schema({"type": "object"}), max_tokens=256)

Built on llguidance (lazy, per-token masks in tens of microseconds on CPU; no dependencies). Every
token a constrained generation samples is allowed by the grammar, so an output that finishes
(finish_reason "stop") parses against its schema, whatever the model's weights. An output cut by
`max_tokens` (finish_reason "length") is a prefix, as with OpenAI. A schema beyond the matcher's
limits (an `anyOf` of thousands of options, a `$ref` to itself) fails the generation with
GrammarError, naming the problem, at the first token the matcher cannot follow.
"""

from cothink.structured.grammar import (
    GrammarCompiler,
    GrammarConstraint,
    GrammarError,
    InvalidSchemaError,
    tool_call_schema,
)

__all__ = ["GrammarCompiler", "GrammarConstraint", "GrammarError", "InvalidSchemaError", "tool_call_schema"]
