"""bench/peers.py runs each engine in a process of its own and writes its table, JSON and plot; an
engine that is not installed is reported as missing, with no figures."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama (input widths multiples of 32, for 4-bit groups) with SmolLM2's tokenizer."""
    import torch
    import transformers as tf

    from cothink.models.hub import resolve_model_path

    folder = tmp_path_factory.mktemp("peers_tiny")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in Path(resolve_model_path("smollm2")).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    return folder


def test_peers_quick_reports_cothink_and_a_missing_engine(peers, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setitem(peers.MODULES, "llama.cpp", ("cothink_test_no_such_module",))
    argv = ["--quick", "--model", str(tiny_folder), "--engines", "cothink", "llama.cpp",
            "--out", str(tmp_path), "--models-dir", str(tmp_path / "models"), "--decode-tokens", "5",
            "--prefill", "16", "40"]
    assert peers.main(argv) == 0
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["machine"]["cpu"] and "commit" in data["machine"]
    cothink, llama = data["engines"]["cothink"], data["engines"]["llama.cpp"]
    assert cothink["status"] == "ok" and "4-bit" in cothink["best"]["weights"]
    best = cothink["best"]
    assert best["decode_tok_s"] > 0 and best["batch_tok_s"] > 0
    assert set(best["prefill_tok_s"]) == {"16", "40"} and all(v > 0 for v in best["prefill_tok_s"].values())
    assert len(best["decode_ids"]) == 5 and cothink["agreement"] == 5
    assert data["ratios"] == []  # no peer ran: nothing to hold cothink against
    assert llama["status"] == "missing" and llama["best"] is None and llama["rounds"] == []
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_peers_float32_states_the_weight_streaming_limit(peers, tiny_folder, tmp_path):
    """--precision float32 runs cothink dense in float32 and measures the streaming limit beside it:
    this machine's read rate over the bytes a decode token reads (every linear, 4 bytes a weight)."""
    argv = ["--quick", "--model", str(tiny_folder), "--engines", "cothink", "--precision", "float32",
            "--out", str(tmp_path), "--decode-tokens", "3", "--prefill", "16"]
    assert peers.main(argv) == 0
    data = json.loads((tmp_path / "peers.json").read_text())
    best = data["engines"]["cothink"]["best"]
    assert best["weights"] == "float32" and best["decode_tok_s"] > 0
    # 2 layers x (q, k, v, o: 64 x 64, 32 x 64 twice, 64 x 64; gate, up, down 64 x 64) + lm_head 49152 x 64
    linear = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 64) + 49152 * 64
    assert best["token_bytes"] == 4 * linear
    assert best["stream_gb_s"] > 0
    assert data["stream_limit_tok_s"] == pytest.approx(best["stream_gb_s"] * 1e9 / best["token_bytes"])


@pytest.mark.parametrize("qtype", ["Q8_0", "BF16", "F32"])
def test_reencoded_gguf_keeps_the_metadata_and_the_weights(peers, tmp_path, qtype):
    """llama.cpp's int8, bfloat16 and float32 files: every quantized tensor re-encoded from its float32
    dequantization (BF16: exactly the bfloat16 rounding of those values, which cothink loads; F32: those
    values), float32 tensors and the metadata as they were, general.file_type the new type's."""
    import gguf
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    src = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = peers.reencoded_gguf(src, tmp_path / "made" / f"tiny.{qtype}.gguf", qtype)
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"
    assert after.fields["general.file_type"].contents() == gguf.LlamaFileType[file_type]
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert after.fields["llama.block_count"].contents() == 1
    old, new = ({t.name: t for t in r.tensors} for r in (before, after))
    norm = "blk.0.attn_norm.weight"
    assert new[norm].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.asarray(new[norm].data), np.asarray(old[norm].data))
    up = new["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType[qtype] and tuple(up.shape) == (64, 8)
    dequantized = gguf.quants.dequantize(old["blk.0.ffn_up.weight"].data, gguf.GGMLQuantizationType.Q4_1)
    got = gguf.quants.dequantize(up.data, up.tensor_type)
    if qtype == "F32":
        assert np.array_equal(got, dequantized)
    elif qtype == "BF16":
        assert np.array_equal(got, torch.from_numpy(dequantized).bfloat16().float().numpy())
    else:
        assert np.abs(got - dequantized).max() <= np.abs(dequantized).max() / 127
    assert peers.reencoded_gguf(src, out, qtype) == out  # made once


def test_no_prompt_starts_another(peers, tiny_folder):
    """OpenVINO GenAI's prefix cache takes a recent prompt's KV for a later prompt that starts with it
    (measured: a 2048-token prompt that began with the 512 one run before it took only 1536 tokens), so
    the warm-up, each prefill prompt and the batch's context start at tokens of their own."""
    args = peers.parse_args(["--model", str(tiny_folder), "--prefill", "512", "2048"])
    work = peers.build_workload(args, tiny_folder)
    prompts = [work.warmup, *work.prefill.values(), work.batch_context]
    assert [len(p) for p in prompts] == [2048, 512, 2048, args.batch_context]
    assert len({p[0] for p in prompts}) == len(prompts)  # no two share even their first token


def test_best_of_reads_the_limit_beside_the_best_decode(peers):
    """Each figure is the best over rounds, but the streaming rate is the one measured in the best
    decode's own process (a VM's read rate moves between processes: a quiet one's does not apply)."""
    slow = peers.Figures(decode_tok_s=40.0, stream_gb_s=55.0, token_bytes=500, prefill_tok_s={512: 600.0})
    fast = peers.Figures(decode_tok_s=48.0, stream_gb_s=31.0, token_bytes=500, prefill_tok_s={512: 580.0})
    best = peers.best_of([slow, fast])
    assert best.decode_tok_s == 48.0 and best.prefill_tok_s == {512: 600.0}
    assert best.stream_gb_s == 31.0 and best.stream_limit_tok_s == pytest.approx(31e9 / 500)


def test_ratios_pair_each_round_with_the_best_peers(peers):
    """cothink / the best peer per workload: of the two bests, and round by round (cothink's round i
    against the peer's round i), with their median; a peer without the workload's figure is skipped."""
    def result(engine, rounds):
        r = peers.EngineResult(engine, "ok", rounds=rounds)
        r.best = peers.best_of(rounds)
        return r

    f = peers.Figures
    results = {
        "cothink": result("cothink", [f(decode_tok_s=100.0, prefill_tok_s={512: 900.0}, batch_tok_s=700.0),
                                      f(decode_tok_s=80.0, prefill_tok_s={512: 1000.0}, batch_tok_s=600.0),
                                      f(decode_tok_s=90.0, prefill_tok_s={512: 950.0}, batch_tok_s=650.0)]),
        "slow": result("slow", [f(decode_tok_s=50.0, prefill_tok_s={512: 2000.0}),
                                f(decode_tok_s=50.0, prefill_tok_s={512: 500.0}),
                                f(decode_tok_s=50.0, prefill_tok_s={512: 500.0})]),
        "fast": result("fast", [f(decode_tok_s=100.0, prefill_tok_s={512: 1000.0}, batch_tok_s=500.0),
                                f(decode_tok_s=40.0, prefill_tok_s={512: 1000.0}, batch_tok_s=400.0)]),
    }
    got = {r.workload: r for r in peers.ratios(results)}
    assert set(got) == {"decode", "prefill 512", "batch"}
    assert got["decode"].peer == "fast" and got["decode"].of_bests == 1.0
    assert got["decode"].rounds == [1.0, 2.0] and got["decode"].median == 1.5  # the peer's two rounds
    assert got["prefill 512"].peer == "slow" and got["prefill 512"].of_bests == 0.5
    assert got["prefill 512"].rounds == [0.45, 2.0, 1.9] and got["prefill 512"].median == 1.9
    assert got["batch"].peer == "fast" and got["batch"].rounds == [1.4, 1.5]
