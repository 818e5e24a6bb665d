"""The benchmark scripts run (tiny random model, tiny settings) and write their tables, JSON and plots."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (the engine decodes generated text)."""
    import torch
    import transformers as tf

    from cothink.models.hub import resolve_model_path

    folder = tmp_path_factory.mktemp("bench_tiny")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    src = Path(resolve_model_path("smollm2"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    return folder


def test_prefill_decode_quick(tiny_folder, tmp_path, capsys):
    bench = _load("prefill_decode")
    argv = [
        "--quick",
        "--model",
        str(tiny_folder),
        "--out",
        str(tmp_path),
        "--lengths",
        "16",
        "48",
        "--decode-tokens",
        "4",
        "--decode-prompt",
        "8",
        "--repeats",
        "1",
    ]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "cothink / transformers" in out
    data = json.loads((tmp_path / "prefill_decode.json").read_text())
    assert set(data["results"]) == {"float32", "bfloat16", "int8"}
    assert "limits measured in this run" in out and "of limit" in out
    for res in data["results"].values():
        assert res["limits"]["gemv_gb_s"] > 0 and res["limits"]["decode_tok_s"] > 0
        assert 0 < res["decode"]["of_limit"] and all(0 < r["of_limit"] for r in res["prefill"])
        assert [r["length"] for r in res["prefill"]] == [16, 48]
        assert all(r["cothink_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["ratio"] > 0 for r in res["prefill"])
        assert res["decode"]["tokens"] == 4 and res["decode"]["cothink_tok_s"] > 0
    assert (tmp_path / "prefill_decode.png").stat().st_size > 1000


def test_prefill_decode_contention_and_int8(tiny_folder, tmp_path, capsys):
    bench = _load("prefill_decode")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--dtypes", "bfloat16", "int8",
            "--lengths", "48", "--decode-tokens", "4", "--decode-prompt", "8", "--repeats", "1",
            "--contention"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "one core busy" in out and "vs cothink bf16" in out
    data = json.loads((tmp_path / "prefill_decode.json").read_text())
    for res in data["results"].values():
        c = res["contention"]
        assert c["decode_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["decode_of_quiet"] > 0


def test_coroutines_quick(tiny_folder, tmp_path, capsys):
    bench = _load("coroutines")
    argv = [
        "--quick",
        "--model",
        str(tiny_folder),
        "--out",
        str(tmp_path),
        "--coroutines",
        "1",
        "2",
        "3",
        "--context",
        "20",
        "--suffix",
        "3",
        "--new-tokens",
        "3",
        "--sequential-max",
        "2",
    ]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode tokens/s" in out and "KV memory" in out and "extrapolated" in out
    data = json.loads((tmp_path / "coroutines.json").read_text())
    rows = data["results"]["rows"]
    assert [r["n"] for r in rows] == [1, 2, 3]
    single = data["results"]["single_coroutine_kv_bytes"]
    for r in rows:
        assert r["cothink"]["generated"] == r["hf_batched"]["generated"] == 3 * r["n"]
        assert r["cothink_decode_tok_s"] > 0 and r["hf_batched_decode_tok_s"] > 0
        assert r["n_copies_kv_bytes"] == r["n"] * single
        assert 0 < r["cothink_kv_bytes"] <= r["n_copies_kv_bytes"]
        assert r["hf_cache_bytes"] > 0
    # sharing the context: N coroutines hold less KV than N copies once N > 1
    assert rows[-1]["cothink_kv_bytes"] < rows[-1]["n_copies_kv_bytes"]
    assert rows[-1]["hf_sequential"]["measured"] is False
    assert (tmp_path / "coroutines.png").stat().st_size > 1000
