"""Pydantic models of the HTTP API: OpenAI-compatible requests/responses and the session API."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenId = Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)]  # strict: no bools or floats
BlockId = Annotated[str, Field(min_length=1, max_length=64, description="A block id of this session")]
Label = Annotated[str, Field(max_length=64)]
Priority = Literal["interactive", "background"]
StopList = Union[
    Annotated[str, Field(max_length=256)],
    Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)],
    None,
]


_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidText(ValueError):
    """A string holding a lone surrogate (e.g. JSON "\\ud800"): not Unicode text; `param` is its field."""

    def __init__(self, param: str):
        super().__init__("the text is not valid Unicode (a lone surrogate, or bytes that are not UTF-8)")
        self.param = param


def _find_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            where = _find_surrogate(k, path) or _find_surrogate(v, f"{path}.{k}" if path else str(k))
            if where:
                return where
    elif isinstance(value, list):
        for i, v in enumerate(value):
            where = _find_surrogate(v, f"{path}.{i}" if path else str(i))
            if where:
                return where
    return None


class Request(BaseModel):
    """Request bodies: types are strict as in the OpenAI API ("10" is not an integer, "yes" not a
    boolean), and text must be valid Unicode (a lone surrogate is a 400 naming the field, not a 500)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _find_surrogate(data, "")
        if where is not None:
            raise InvalidText(where)
        return data


class Strict(Request):
    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(Request):
    """OpenAI requests: unknown fields are ignored, as OpenAI clients send many optional ones."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ================================================================================ OpenAI-compatible


class StreamOptions(Lenient):
    include_usage: bool = Field(False, description="Send usage in a final chunk with empty choices")


class CompletionRequest(Lenient):
    model: str = Field(description="Model id, as listed by GET /v1/models")
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]] = Field(
        description="Text, token ids, or a list of either (one choice set per prompt)"
    )
    max_tokens: int | None = Field(None, ge=1, description="Most new tokens per choice (default 16)")
    temperature: float | None = Field(
        None, ge=0, le=2, description="Sampling temperature (default 1; 0 = greedy)"
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass (default 1)")
    n: int | None = Field(None, ge=1, le=16, description="Choices per prompt")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopList = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    echo: bool | None = False
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Log-probabilities of each token and this many alternatives"
    )
    best_of: int | None = Field(None, description="Not supported above 1")
    suffix: str | None = Field(None, description="Not supported (must be null)")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="Only -100 (ban the token) is supported")
    user: str | None = None


class ContentPart(Lenient):
    type: str = Field(description="'text', or 'image_url' (multimodal models)")
    text: str | None = None
    image_url: dict[str, Any] | None = Field(
        None, description="{'url': 'data:image/...;base64,...'}: data: URLs only (nothing is fetched)"
    )


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant turn's tool calls")
    tool_call_id: str | None = Field(None, description="A tool result's call id")


class ChatCompletionRequest(Lenient):
    model: str = Field(description="Model id, as listed by GET /v1/models")
    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, rendered with the model's chat template"
    )
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopList = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = Field(None, description="Return each output token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token (with logprobs)")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call")
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = Field(None, description="Accepted; one call per choice is made")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {...}}"
    )
    user: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = Field(description="stop, length or cancelled")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = Field(description="stop, length or cancelled")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cothink"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ================================================================================ session API


class Limits(BaseModel):
    max_blocks: int = Field(description="Live blocks a session may hold")
    max_tokens: int = Field(
        description="Tokens in the session's blocks plus the max_tokens its running generations may still add"
    )
    max_running: int = Field(description="Coroutines a session may run at once")
    key_max_pages: int | None = Field(None, description="KV pages the session's API key may hold in all")


class SessionUsage(BaseModel):
    blocks: int = Field(description="Live blocks")
    tokens: int = Field(description="Tokens in live blocks plus reserved by running generations")
    pages: int = Field(0, description="KV pages charged: at least one per block, plus reservations")
    running: int = Field(description="Running coroutines")


class SessionCreate(Strict):
    name: Label | None = Field(None, description="Optional label, for you")


class SessionInfo(BaseModel):
    id: str = Field(description="Unguessable session id; only the API key that created it can use it")
    object: Literal["session"] = "session"
    name: str | None = None
    created: int = Field(description="Unix time")
    usage: SessionUsage
    limits: Limits


class BlockCreate(Strict):
    name: Label | None = Field(None, description="Optional label, for you")
    text: str | None = Field(None, description="Initial text to write (tokenized without special tokens)")
    token_ids: list[TokenId] | None = Field(None, description="Initial token ids to write")
    priority: Priority | None = Field(None, description="Priority of the initial write (default background)")

    @model_validator(mode="after")
    def _one_input(self) -> BlockCreate:
        if self.text is not None and self.token_ids is not None:
            raise ValueError("give at most one of text or token_ids")
        return self


class BlockInfo(BaseModel):
    id: str = Field(description="Unguessable block id, scoped to its session")
    object: Literal["block"] = "block"
    name: str | None = None
    length: int = Field(description="Tokens in the block")
    created: int
    writer: str | None = Field(None, description="Coroutine writing the block now, if any")
    text: str | None = Field(None, description="The block's tokens decoded (when asked for)")
    token_ids: list[int] | None = Field(None, description="The block's token ids (when asked for)")


class BlockList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BlockInfo]


class ExtendRequest(Strict):
    text: str | None = Field(None, description="Text to append (tokenized without special tokens)")
    token_ids: list[TokenId] | None = Field(None, description="Token ids to append")
    image: str | None = Field(None, description="An image to append, as a data: URL (multimodal models)")
    frames: list[str] | None = Field(
        None, description="One frame group of a live stream (1-2 frames as data: URLs), with `timestamp`"
    )
    timestamp: float | None = Field(None, ge=0, description="Seconds of the frame group in its stream")
    view: list[BlockId] | None = Field(
        None,
        min_length=1,
        description="Blocks the new tokens attend to, ending with this block (default: just this block)",
    )
    priority: Priority | None = Field(None, description="Scheduling class (default background)")
    name: Label | None = Field(None, description="Optional coroutine label")

    @model_validator(mode="after")
    def _one_input(self) -> ExtendRequest:
        given = [x for x in (self.text, self.token_ids, self.image, self.frames) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, token_ids, image or frames")
        if self.frames is not None and self.timestamp is None:
            raise ValueError("frames need a timestamp")
        return self


class TruncateRequest(Strict):
    length: int = Field(ge=0, description="Keep the block's first `length` tokens")


class ForkRequest(Strict):
    name: Label | None = Field(None, description="Label of the new block")


class GenerateRequest(Strict):
    view: list[BlockId] = Field(
        min_length=1, description="Blocks to read, in order; output goes into the last one"
    )
    max_tokens: int = Field(64, ge=1, description="Most new tokens")
    temperature: float = Field(0.0, ge=0, le=2, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=100_000, description="0 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopList = Field(None, description="Stop strings (cut from the output)")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    banned_token_ids: list[TokenId] | None = Field(None, max_length=4096)
    stop_at_eos: bool = Field(True, description="Stop at the model's end-of-sequence tokens")
    priority: Priority | None = Field(None, description="Scheduling class (default background)")
    name: Label | None = Field(None, description="Optional coroutine label")
    response_format: dict[str, Any] | None = Field(
        None,
        description="Constrain the output: {'type': 'json_object'} or {'type': 'json_schema', "
        "'json_schema': {'schema': {...}}} (grammar-constrained: a finished output parses)",
    )
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Token events carry log-probabilities with this many alternatives"
    )
    stream: bool = Field(True, description="Stream events over SSE (start, token..., end)")
    background: bool = Field(False, description="Return 202 at once; follow it with GET .../coroutines/{id}")


class GenerateResult(BaseModel):
    coroutine: str
    text: str
    token_ids: list[int]
    finish_reason: str = Field(description="stop, length, cancelled or error")
    usage: Usage


class ProbeRequest(Strict):
    view: list[BlockId] = Field(min_length=1, description="Blocks to read, in order")
    question: Union[Annotated[str, Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)]] = (
        Field(description="Text (or token ids) read after the view, e.g. 'Is the answer final? Answer:'")
    )
    choices: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=lambda: [" yes", " no"],
        min_length=1,
        description="Distinct continuations to score, tokenized exactly as given (mind the leading space)",
    )
    priority: Priority | None = Field(None, description="Scheduling class (default interactive)")
    name: Label | None = None


class ProbeResult(BaseModel):
    coroutine: str
    probabilities: dict[str, float] = Field(description="Choice -> probability (normalised over the choices)")
    answer: str = Field(description="The most likely choice")


class CoroutineInfo(BaseModel):
    id: str = Field(description="Unguessable coroutine id, scoped to its session")
    object: Literal["coroutine"] = "coroutine"
    name: str | None = None
    kind: Literal["extend", "generate", "probe"]
    status: Literal["running", "finished", "failed"]
    block: str | None = Field(None, description="The block it writes (generate, extend)")
    view: list[str]
    created: int
    finish_reason: str | None = None
    text: str | None = Field(None, description="Generated text so far (generate)")
    tokens: int = Field(0, description="Tokens generated so far (generate)")
    error: str | None = None


class CoroutineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CoroutineInfo]


class SnapshotCreate(Strict):
    blocks: list[BlockId] | None = Field(
        None, min_length=1, description="Blocks to save, in order (default: all the session's blocks)"
    )


class SnapshotBlockInfo(BaseModel):
    id: str = Field(description="The block's id; the restored block has the same id in its new session")
    name: str | None = None
    length: int


class SnapshotInfo(BaseModel):
    id: str = Field(description="Unguessable snapshot id; only the API key that saved it can restore it")
    object: Literal["session.snapshot"] = "session.snapshot"
    session: str = Field(description="The session it was saved from")
    created: int = Field(description="Unix time")
    model: str = Field(description="The model it was saved from (restoring needs the same model and dtype)")
    blocks: list[SnapshotBlockInfo]
    tokens: int = Field(description="Tokens in all its blocks")
    bytes: int = Field(description="Size of the snapshot on disk")


class SnapshotListed(BaseModel):
    id: str
    object: Literal["session.snapshot"] = "session.snapshot"
    status: Literal["complete", "writing", "unfinished"] = Field(
        description="`writing`: being saved now; `unfinished`: cut short (a crash): delete it"
    )
    created: int = Field(description="Unix time")
    bytes: int = Field(description="Size on disk (counts against the key's snapshot bytes)")
    session: str | None = Field(None, description="The session it was saved from (complete snapshots)")
    model: str | None = None
    blocks: list[SnapshotBlockInfo] | None = None
    tokens: int | None = None


class RestoreRequest(Strict):
    snapshot: str = Field(min_length=1, max_length=64, description="A snapshot id from POST .../snapshot")
    name: Label | None = Field(None, description="Label of the new session (default: the saved one's)")


class RestoredSession(SessionInfo):
    snapshot: str = Field(description="The snapshot it was restored from")
    blocks: list[BlockInfo] = Field(description="Its blocks, in the order they were saved")


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


class MemoryHealth(BaseModel):
    total_pages: int = Field(description="KV pages in the pool")
    used_pages: int = Field(description="Pages in use now")
    free_pages: int
    reserved_pages: int = Field(description="Pages charged to quotas: held by blocks plus reserved by works")
    page_size: int = Field(description="Tokens per page")
    bytes_per_page: int
    used_share: float = Field(description="used_pages / total_pages")
    pressure: bool = Field(description="used_share is at or above the server's memory_pressure threshold")


class KernelHealth(BaseModel):
    """cothink's C kernels in the server's process (cothink.ops.native.KernelStatus; `cothink info`)."""

    available: bool = Field(description="The C kernels run; false: the slower torch path runs on the CPU")
    reason: str | None = Field(
        description="Why not, when not: switched off, no C compiler, the compiler's message, an ABI mismatch"
    )
    library: str | None = Field(description="The loaded shared library's path")
    abi: int = Field(description="The kernels' interface version this cothink calls")
    required: bool = Field(description="COTHINK_REQUIRE_NATIVE=1: kernels that cannot build are an error")


class Health(BaseModel):
    status: Literal["ok", "memory_pressure", "draining", "engine_stopped"] = Field(
        description="ok; memory_pressure (200: serving, but the KV pool is nearly full); draining "
        "(shutting down: 503); engine_stopped (the step loop is not running: 503)"
    )
    engine_running: bool
    steps: int
    memory: MemoryHealth | None = None
    kernels: KernelHealth


# ---- WebSocket messages (client -> server) ------------------------------------------------------


class WsGenerate(GenerateRequest):
    type: Literal["generate"]
    id: str | None = Field(None, max_length=64, description="Echoed in replies")


class WsExtend(ExtendRequest):
    type: Literal["extend"]
    id: str | None = Field(None, max_length=64)
    block: BlockId


class WsProbe(ProbeRequest):
    type: Literal["probe"]
    id: str | None = Field(None, max_length=64)


class WsCancel(Strict):
    type: Literal["cancel"]
    id: str | None = Field(None, max_length=64)
    coroutine: str | None = Field(None, description="Default: every generation started on this socket")


WsMessage = Annotated[Union[WsGenerate, WsExtend, WsProbe, WsCancel], Field(discriminator="type")]
