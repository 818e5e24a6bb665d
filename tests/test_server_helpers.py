"""Shared helpers for the server and observability tests (test_server_*.py, test_observability_*.py).

- `tiny_chat_model_dir()`: a random-weight tiny Llama saved with the real SmolLM2 tokenizer (chat template
  included), built once per process: fast enough for concurrency and fuzz tests.
- `running_server(engine, settings)`: a real uvicorn server on 127.0.0.1 with a free port, in a thread.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx

_CACHE: dict[str, Path] = {}
_LOCK = threading.Lock()


def smollm2_dir() -> Path:
    from cothink.models.hub import prepare_model

    return Path(prepare_model("smollm2"))


def tiny_chat_model_dir() -> Path:
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer (vocab 49152), saved once per process."""
    with _LOCK:
        if "tiny" in _CACHE:
            return _CACHE["tiny"]
        import torch
        import transformers as tf

        tok = tf.AutoTokenizer.from_pretrained(str(smollm2_dir()))
        cfg = tf.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=None,
        )
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
        folder = Path(tempfile.mkdtemp(prefix="cothink-tiny-chat-"))
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        _CACHE["tiny"] = folder
        return folder


def tiny_engine(**limits: Any):
    import cothink

    return cothink.Engine.from_pretrained(tiny_chat_model_dir(), **limits)


@contextlib.contextmanager
def running_server(engine, settings=None, **kwargs: Any) -> Iterator[Any]:
    """Yield a started BackgroundServer for create_app(engine, settings); stop it gracefully after."""
    from cothink.server import BackgroundServer, ServerSettings, create_app

    app = create_app(engine, settings or ServerSettings(model_name="tiny"), **kwargs)
    server = BackgroundServer(app).start()
    try:
        yield server
    finally:
        assert server.stop(30), "the server did not shut down within 30 s"


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE response body into JSON objects ('[DONE]' kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_helpers_build_a_tiny_chat_model() -> None:
    folder = tiny_chat_model_dir()
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
