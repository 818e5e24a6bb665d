"""Text around the engine: chat prompts, the tokens that end a turn, and incremental detokenization."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

_TURN_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")


class IncrementalDecoder:
    """Turn a growing list of token ids into text pieces, holding back incomplete UTF-8 characters.

    Decodes a short window of recent tokens rather than the whole sequence, so the cost per token
    stays constant; text is released only once it no longer ends in a replacement character (a
    multi-byte character split across tokens) and it extends the previously released text.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._backend = _backend_decode(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens up to here have been released

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self._skip)
        return self._tok.decode(list(ids), skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (at the end of a generation)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's `decode` behind a transformers fast tokenizer whose class keeps the base
    class's decoding (with cleanup off it adds nothing to the Rust call: the same text without ~2 us
    of argument handling, twice a token per generation); None for any other tokenizer."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as it is
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
        getattr(cls, name) is not getattr(TokenizersBackend, name) for name in ("decode", "_decode")
    ):
        return None
    return tokenizer.backend_tokenizer.decode


def stop_token_ids(tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> set[int]:
    """Token ids that end a chat turn: the model's and tokenizer's eos plus the usual end markers."""
    ids = {int(i) for i in eos_token_ids}
    if tokenizer is None:
        return ids
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Iterable):
        ids.update(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[m]) for m in _TURN_END_MARKERS if m in vocab)
    return ids


def chat_prompt_ids(
    tokenizer: Any, prompt: str, *, system: str | None = None, raw: bool = False
) -> list[int]:
    """Token ids for `prompt`: through the tokenizer's chat template unless `raw`."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself; don't let the tokenizer add a BOS twice.
    return list(tokenizer.encode(text, add_special_tokens=False))
