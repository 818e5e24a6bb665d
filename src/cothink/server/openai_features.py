"""OpenAI features on top of the engine hooks: logprobs, structured output and tool calls.

- `logprobs` / `top_logprobs`: each token's log-probability under the raw model (before masks and
  temperature), in OpenAI's chat (`logprobs.content[]`) and legacy completion shapes.
- `response_format` json_object / json_schema and `tools`: grammar-constrained decoding
  (cothink.structured, llguidance), so a finished output always parses against its schema.
- Tool calls are written by the model as one JSON object `{"name": ..., "arguments": {...}}`; with
  `tool_choice` "required" or a named function the whole output is constrained to that, with "auto"
  the output is either text not starting with "{" or such a call. Conversations with tool calls are
  rendered with the model's chat template when it has a tool format, else in the fallback format of
  docs/server.md ("Tool calling").
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from cothink.server.errors import APIError

if TYPE_CHECKING:
    from cothink.execution.sampling import TokenConstraint, TokenLogprob
    from cothink.runtime.engine import GenerationResult
    from cothink.server.state import ServerState


@dataclass
class Structured:
    """What a chat request asks the decoder for: a constraint per choice and how to read the output."""

    make_constraint: Callable[[], TokenConstraint] | None = None
    tool_calls: str = "never"  # never | maybe (auto: text or a call) | always (required / named)
    param: str | None = None  # the field whose schema every "stop" output must parse as (None: free text)

    def check(self, result: GenerationResult) -> None:
        """A "stop" output of a schema-constrained choice is JSON; any other is a failed grammar
        (GrammarError), never a "stop" with output that does not parse."""
        if self.param is None or result.finish_reason != "stop":
            return
        from cothink.structured import GrammarError

        try:
            json.loads(result.text)
        except json.JSONDecodeError as exc:
            raise GrammarError(
                f"the output ended before the schema was complete ({exc.msg} at {exc.pos})", param=self.param
            ) from None


def _compiler(state: ServerState):
    compiler = getattr(state, "grammars", None)
    if compiler is None:
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", code="no_tokenizer", param="response_format")
        from cothink.structured import GrammarCompiler

        compiler = state.grammars = GrammarCompiler(state.tokenizer, state.vocab_size)
    return compiler


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | bool | None:
    """The JSON schema a response_format asks for (None: plain text)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise APIError(
                400,
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                code="invalid_value",
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise APIError(
                400, "the schema must be an object", code="invalid_value", param="response_format.json_schema"
            )
        return schema
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        code="unsupported",
        param="response_format.type",
    )


def validate_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise APIError(
                400,
                "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}",
                code="invalid_value",
                param=f"tools.{i}",
            )
        out.append(tool)
    return out


def chosen_tools(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], str]:
    """(tools the model may call, mode): mode 'none', 'auto' or 'required'."""
    if not tools or tool_choice == "none":
        return [], "none"
    if tool_choice in (None, "auto"):
        return tools, "auto"
    if tool_choice == "required":
        return tools, "required"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise APIError(
                400, f"tool_choice names no tool {name!r}", code="invalid_value", param="tool_choice"
            )
        return named, "required"
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
        code="invalid_value",
        param="tool_choice",
    )


def structured_for(state: ServerState, response_format, tools, tool_choice) -> Structured:
    """The constraint factory for a chat request (each choice gets its own grammar state)."""
    from cothink.structured import tool_call_schema

    callable_tools, mode = chosen_tools(tools, tool_choice)
    if callable_tools:
        if response_format_schema(response_format) is not None:
            raise APIError(
                400, "use response_format or tools, not both", code="unsupported", param="response_format"
            )
        compiler = _compiler(state)
        schema = tool_call_schema(callable_tools)
        if mode == "required":
            grammar = compiler.json_grammar(schema, "tools")
            return Structured(lambda: compiler.constraint(grammar, "tools"), "always", "tools")
        compiler.text_or_json(schema, "tools")  # compile once now, so a bad schema is a 400 up front
        return Structured(lambda: compiler.text_or_json(schema, "tools"), "maybe")
    schema = response_format_schema(response_format)
    if schema is None:
        return Structured()
    compiler = _compiler(state)
    grammar = compiler.json_grammar(schema, "response_format")
    return Structured(lambda: compiler.constraint(grammar, "response_format"), param="response_format")


def parse_tool_call(text: str, mode: str) -> dict[str, Any] | None:
    """An OpenAI tool_calls entry for an output written as a call, else None (plain content)."""
    if mode == "never" or not text.lstrip().startswith("{"):
        return None
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut by max_tokens: returned as content, finish_reason "length"
    if not isinstance(call, dict) or "name" not in call:
        return None
    return {
        "id": f"call_{secrets.token_urlsafe(12)}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))},
    }


# ---------------------------------------------------------------------------------------- chat history


def template_has_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template and "tool_calls" in template


def fallback_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool description for templates without a tool format (docs/server.md, "Tool calling")."""
    lines = [
        "You can call these tools. To call one, answer with only a JSON object "
        '{"name": <tool name>, "arguments": {...}} and nothing else.',
    ]
    for tool in tools:
        fn = tool["function"]
        lines.append(json.dumps({k: fn[k] for k in ("name", "description", "parameters") if k in fn}))
    return "\n".join(lines)


def render_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], native: bool
) -> list[dict[str, Any]]:
    """Messages for apply_chat_template. Natively, tool calls and results pass through in the
    template's format; otherwise a call becomes the assistant's JSON and a result a user turn."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m = {
                    **m,
                    "tool_calls": [
                        {
                            "type": "function",
                            "id": c.get("id"),
                            "function": {
                                "name": c["function"]["name"],
                                "arguments": _arguments(c["function"].get("arguments")),
                            },
                        }
                        for c in calls
                    ],
                }
            out.append(m)
            continue
        if m["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"Tool result ({m.get('tool_call_id') or 'call'}): {m['content']}",
                }
            )
        elif calls:
            text = "\n".join(
                json.dumps(
                    {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                )
                for c in calls
            )
            out.append({"role": "assistant", "content": ((m.get("content") or "") + text)})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools and not native:
        prompt = fallback_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments or {}


# ---------------------------------------------------------------------------------------- logprobs


def _token(state: ServerState, token_id: int) -> str:
    return state.decode([token_id])


def chat_logprobs(state: ServerState, items: list[TokenLogprob], top: int) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(state, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(state: ServerState, items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, at = [], [], offset
    for lp in items:
        text = _token(state, lp.token_id)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{_token(state, t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }
