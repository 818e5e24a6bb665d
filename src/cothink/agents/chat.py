"""Chat formatting through the tokenizer's own chat template, in pieces that can go into separate blocks.

Agents keep a conversation in blocks that grow: the system and user turns in a context block, the
assistant's turn in the coroutine's own block, and later user turns appended to the context block while
the assistant is still writing. The template renders whole conversations, so each piece is the *textual
difference* between two renderings (the conversation with and without the new part); nothing here
knows a particular format. Tokenizers without a chat template (tiny test tokenizers) get a plain
"Role: text" format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Message = dict[str, str]


@dataclass
class ChatFormat:
    """Renders chat pieces for one tokenizer."""

    tokenizer: Any

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: list[Message], *, generation_prompt: bool = False) -> str:
        if not self.has_template:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
            return text + ("Assistant:" if generation_prompt else "")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def conversation(self, messages: list[Message]) -> str:
        """The turns themselves, without the assistant's opener (goes into a context block)."""
        return self.render(messages)

    def turn(self, before: list[Message], message: Message) -> str:
        """The text that appending `message` after `before` adds (a user turn appended to a live context)."""
        full = self.render([*before, message])
        head = self.render(before)
        if not full.startswith(head):  # a template that rewrites earlier turns: fall back to the suffix
            return self.render([message])
        return full[len(head) :]

    def assistant_opener(self, before: list[Message]) -> str:
        """The text that opens the assistant's turn after `before` (goes at the start of its own block)."""
        full = self.render(before, generation_prompt=True)
        head = self.render(before)
        return full[len(head) :] if full.startswith(head) else ""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def question(self, text: str) -> str:
        """Text that ends the assistant's current turn, asks `text` as the user, and opens the assistant's
        answer: what a probe or a narrator appends after a view whose last block is an open turn."""
        if not self.has_template:
            return f"\nUser: {text}\nAssistant:"
        mark = "\x00"
        msgs = [
            {"role": "user", "content": "."},
            {"role": "assistant", "content": mark},
            {"role": "user", "content": text},
        ]
        rendered = self.render(msgs, generation_prompt=True)
        return rendered.split(mark, 1)[1] if mark in rendered else self.turn(msgs[:2], msgs[2])

    def user_turn(self, text: str) -> str:
        """A complete user turn, as appended to a context block that already holds earlier turns."""
        before = [{"role": "system", "content": "."}]
        return self.turn(before, {"role": "user", "content": text})

    def reopen(self) -> str:
        """Text that opens a new assistant turn right after the assistant ended its turn (its end-of-turn
        token is already written), e.g. to answer a user input that arrived after it finished."""
        if not self.has_template:
            return "\nAssistant:"
        mark = "\x00"
        msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": mark}]
        rendered = self.render(msgs, generation_prompt=True)
        tail = rendered.split(mark, 1)[1] if mark in rendered else ""
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and tail.startswith(eos):
            tail = tail[len(eos) :]
        return tail or "\n"
