"""Model resolution and the embedded SmolLM2 conversion (cothink.models.hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cothink.errors import CothinkError, ModelNotFoundError
from cothink.models import hub


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelNotFoundError) as info:
        hub.resolve_model_path("no-such-model-xyz")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CothinkError)
    assert "smollm2" in str(info.value) and "no-such-model-xyz" in str(info.value)
    with pytest.raises(ModelNotFoundError):
        hub.prepare_model("no-such-model-xyz")


def test_local_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        hub.resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_model_path(tmp_path) == tmp_path
    assert hub.resolve_model_path(str(tmp_path)) == tmp_path
    assert hub.prepare_model(tmp_path) == tmp_path
    afile = tmp_path / "config.json"
    with pytest.raises(ModelNotFoundError, match="not a folder"):
        hub.resolve_model_path(afile)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COTHINK_CACHE", str(tmp_path))
    assert hub.cache_dir() == tmp_path
    monkeypatch.delenv("COTHINK_CACHE")
    assert hub.cache_dir() == Path.home() / ".cache" / "cothink"


def test_embedded_gguf_is_shipped():
    path = hub.find_embedded_gguf("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return hub.resolve_model_path("smollm2")  # converted by scripts/bootstrap; converts here otherwise


def test_names_resolve_to_same_folder(smollm2_dir):
    assert smollm2_dir == hub.cache_dir() / "models" / "smollm2-135m-instruct"
    for name in ("SmolLM2-135M-Instruct", "SMOLLM2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert hub.resolve_model_path(name) == smollm2_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "cothink_source.json"):
        assert (smollm2_dir / name).is_file()
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)


def test_transformers_loads_and_answers(smollm2_dir):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_converted_from_the_shipped_gguf(smollm2_dir):
    source = json.loads((smollm2_dir / "cothink_source.json").read_text())
    assert source["gguf_file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
