"""The benchmark scripts run (tiny random model, tiny settings) and write their tables, JSON and plots."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from cothink.ops import native

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
        hidden_size=64,  # head size 16, as the fused decode attention reads it
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
    """Every dtype by default (float32, bfloat16, int8), with the limits and the one-core-busy rerun."""
    bench = _load("prefill_decode")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--lengths", "16", "48",
            "--decode-tokens", "4", "--decode-prompt", "8", "--repeats", "1", "--contention"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "cothink / transformers" in out
    data = json.loads((tmp_path / "prefill_decode.json").read_text())
    assert set(data["results"]) == {"float32", "bfloat16", "int8"}
    assert "limits measured in this run" in out and "of limit" in out
    assert "one core busy" in out and "vs cothink bf16" in out
    for res in data["results"].values():
        assert res["limits"]["gemv_gb_s"] > 0 and res["limits"]["decode_tok_s"] > 0
        assert 0 < res["decode"]["of_limit"] and all(0 < r["of_limit"] for r in res["prefill"])
        assert [r["length"] for r in res["prefill"]] == [16, 48]
        assert all(r["cothink_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["ratio"] > 0 for r in res["prefill"])
        assert res["decode"]["tokens"] == 4 and res["decode"]["cothink_tok_s"] > 0
        assert res["limits"]["linears_decode_tok_s"] > 0 and res["decode"]["of_linears"] > 0
        c = res["contention"]
        assert c["decode_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["decode_of_quiet"] > 0
    assert "linears alone" in out
    assert (tmp_path / "prefill_decode.png").stat().st_size > 1000


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
    lin = data["results"]["linears_alone"]
    assert lin["n"] == 3 and lin["tok_s"] > 0 and lin["of_it"] > 0 and "linears alone" in out
    assert (tmp_path / "coroutines.png").stat().st_size > 1000


@pytest.mark.parametrize("model", ["qwen35-moe-random", "qwen3-next-random", "kimi-random"])
def test_moe_family_models_run_in_both_benchmarks(model, tmp_path, capsys, monkeypatch):
    """The small random MoE / Kimi Linear checkpoints build (under $COTHINK_CACHE) and run through the
    prefill/decode and coroutine benchmarks."""
    monkeypatch.setenv("COTHINK_CACHE", str(tmp_path / "cache"))
    bench = _load("prefill_decode")
    argv = ["--quick", "--model", model, "--out", str(tmp_path), "--dtypes", "float32", "--lengths", "32",
            "--decode-tokens", "3", "--decode-prompt", "8", "--repeats", "1", "--no-contention"]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "prefill_decode.json").read_text())
    assert data["results"]["float32"]["decode"]["cothink_tok_s"] > 0
    assert (tmp_path / "cache" / "bench" / model / "config.json").exists()
    bench = _load("coroutines")
    argv = ["--quick", "--model", model, "--out", str(tmp_path), "--coroutines", "1", "2", "--context", "12",
            "--suffix", "3", "--new-tokens", "2", "--sequential-max", "1", "--no-contention"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "coroutines.json").read_text())["results"]["rows"]
    assert [r["cothink"]["generated"] for r in rows] == [2, 4]


def test_coroutines_always_measures_the_single_coroutine_baseline():
    """N=1 is what sequential runs and KV copies are extrapolated from: added when not asked for."""
    bench = _load("coroutines")
    assert bench.parse_args(["--coroutines", "8", "4"]).coroutines == [1, 4, 8]
    with pytest.raises(SystemExit):
        bench.parse_args(["--coroutines", "0", "4"])


def test_linear_calls_record_what_a_forward_calls(tiny_folder):
    """LinearCalls sees every linear a step runs, in order, with its rows, and nothing else."""
    import sys

    import torch

    from cothink.execution.runner import load_model

    sys.path.insert(0, str(ROOT / "bench"))
    import _common as C

    runner = load_model(tiny_folder)
    model = runner.model
    block = runner.new_block()
    runner.extend(block, [5, 6, 7], logits="last")
    fused = runner.fused_decode
    with C.LinearCalls(runner) as calls:
        assert runner.fused_decode is None  # the per-module path: its calls are what a hook sees
        runner.extend(block, [8], logits="last")
    assert runner.fused_decode is fused and "float_forward" not in vars(model.lm_head)  # restored
    runner.extend(block, [9], logits="last")  # after the block: hooks are gone
    assert len(calls.passes) == 1
    step = calls.last_with_rows(1)
    per_layer = [m for layer in model.model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert [m for m, _ in step] == per_layer + [model.lm_head]
    assert all(rows == 1 for _, rows in step)
    assert C.LinearCalls.seconds(step, torch.float32, 1) > 0


def test_linears_quick(tiny_folder, tmp_path, capsys):
    """Every linear of a pass, through the fast path's module and through nn.Linear, per row count."""
    bench = _load("linears")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--rows", "1", "9",
            "--repeats", "1"]
    assert bench.main(argv) == 0
    assert "fast-path linears vs F.linear" in capsys.readouterr().out
    runs = json.loads((tmp_path / "linears.json").read_text())["runs"]
    assert [r["dtype"] for r in runs] == ["float32", "bfloat16"]
    for run in runs:
        assert run["modules"] == 2 * 4 + 1  # four fused projections per layer, and the lm_head
        assert [r["rows"] for r in run["results"]] == [1, 9]
        assert all(r["fast_ms"] > 0 and r["plain_ms"] > 0 for r in run["results"])
    assert (tmp_path / "linears.png").stat().st_size > 0


def test_linears_quick_quantized(tiny_folder, tmp_path):
    """int8 and int4: the quantized modules against F.linear on the dequantized bfloat16 weight, their
    GB/s counting the bytes they read (codes and scales: fewer a weight than the dense bfloat16)."""
    bench = _load("linears")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--rows", "1", "9",
            "--repeats", "1", "--dtypes", "int8", "int4"]
    assert bench.main(argv) == 0
    runs = json.loads((tmp_path / "linears.json").read_text())["runs"]
    assert [r["dtype"] for r in runs] == ["int8", "int4"]
    kinds = [" ".join(r["module_kinds"]) for r in runs]
    assert "Int8" in kinds[0] and "Int4" in kinds[1]
    for run in runs:
        for r in run["results"]:
            assert r["fast_ms"] > 0 and r["plain_ms"] > 0
            # bytes per flop: the quantized weight's against the dense bfloat16 weight's
            assert r["fast_gb_s"] / r["fast_gflop_s"] < 0.75 * r["plain_gb_s"] / r["plain_gflop_s"]


def test_step_phases_quick(tiny_folder, tmp_path, capsys):
    """The engine's decode step split into phases that add up to the step, and timers removed after."""
    from cothink.execution.runner import ModelRunner

    bench = _load("step_phases")
    forward = ModelRunner.forward
    # float32: its linears take the C kernel on every CPU (bfloat16 ones are prepacked for oneDNN where
    # the CPU has bfloat16 arithmetic, and then the step has no fused layers to time)
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--dtypes", "float32"]
    assert bench.main(argv) == 0
    assert "engine decode step" in capsys.readouterr().out
    assert ModelRunner.forward is forward
    (res,) = json.loads((tmp_path / "step_phases.json").read_text())["results"]
    ms = res["ms_per_token"]
    assert all(ms[p] > 0 for p in ("schedule", "prepare", "forward", "commit", "postprocess"))
    if native.available():  # the tiny Llama takes the fused step: its layers and lm_head are one C call
        assert ms["layers"] > 0 and ms["linears"] == 0
    loop_side = ms["schedule"] + ms["prepare"] + ms["commit"] + ms["postprocess"]
    assert abs(loop_side + ms["forward"] + ms["unaccounted"] - ms["total"]) < 1e-6
    assert ms["forward"] >= ms["layers"] + ms["linears"] and ms["unaccounted"] > 0


def test_step_phases_coroutines(tiny_folder, tmp_path):
    """--coroutines N: N coroutines over the prompt as a shared context decode in the same steps; the
    phases are per step and tokens/s counts every coroutine's tokens."""
    bench = _load("step_phases")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--dtypes", "float32",
            "--coroutines", "4"]
    assert bench.main(argv) == 0
    (res,) = json.loads((tmp_path / "step_phases.json").read_text())["results"]
    ms = res["ms_per_token"]
    assert res["tok_s"] == pytest.approx(4 * 1e3 / ms["total"])
    assert ms["forward"] > 0 and ms["prepare"] > 0


def test_overlap_probe_quick(tiny_folder, tmp_path, capsys):
    """bench/overlap_probe.py: every mode measured per dtype and width, the overlapped forwards' logits
    checked against the lone forward's, and the probe's blocks freed."""
    from cothink.execution.runner import ModelRunner

    bench = _load("overlap_probe")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--dtypes", "float32",
            "--coroutines", "1", "3", "--prompt", "12", "--steps", "3"]
    freed = []
    free = ModelRunner.free
    ModelRunner.free = lambda self, block: (freed.append(block.name), free(self, block))[1]
    try:
        assert bench.main(argv) == 0
    finally:
        ModelRunner.free = free
    assert "planning hidden" in capsys.readouterr().out
    rows = json.loads((tmp_path / "overlap_probe.json").read_text())["rows"]
    assert [(r["dtype"], r["coroutines"]) for r in rows] == [("float32", 1), ("float32", 3)]
    for r in rows:
        assert all(r[m] > 0 for m in bench.MODES)
        assert r["hidden"] == pytest.approx((r["serial"] - r["overlapped"]) / r["planning"])
    assert freed.count("context") == 2 and len(freed) == 2 + 2 * 1 + 2 * 3  # two writer sets of N each


@pytest.mark.skipif(
    not native.prefill_attention_fits(*(torch.zeros(2, 2, 16, dtype=torch.bfloat16) for _ in range(3))),
    reason="the prefill attention kernel is built only where the CPU has AVX-512 BF16")
def test_prefill_attention_quick(tiny_folder, tmp_path, capsys):
    """The C prefill kernel and torch's flash kernel on the model's heads, each within its rounding of
    the float64 reference, with the table, JSON and plot."""
    bench = _load("prefill_attention")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--repeats", "1"]
    assert bench.main(argv) == 0
    assert "C kernel vs torch's flash kernel" in capsys.readouterr().out
    runs = json.loads((tmp_path / "prefill_attention.json").read_text())["runs"]
    assert [(r["dtype"], r["chunk"], r["heads"]) for r in runs] == [("bfloat16", 64, [4, 2, 16]),
                                                                    ("float32", 64, [4, 2, 16])]
    for run in runs:
        assert [r["keys"] for r in run["results"]] == [64, 128]
        bound = 2**-7 if run["dtype"] == "bfloat16" else 1e-5  # (bfloat16 inputs: P rounded for P V)
        for r in run["results"]:
            assert r["native_ms"] > 0 and r["flash_ms"] > 0 and r["native_gflop_s"] > 0
            assert r["native_out_err"] < bound and r["flash_out_err"] < bound and r["native_lse_err"] < 1e-4
    assert (tmp_path / "prefill_attention.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--chunk", "64", "--keys", "32"])


@pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")
def test_decode_attention_quick(tiny_folder, tmp_path, capsys, monkeypatch):
    """Whole decode steps through the fused kernel and through the torch kernels, alternating; the
    backend's key limit is restored afterwards."""
    from cothink.execution import attention_backends

    calls = []
    for name in ("decode_attention", "decode_layers"):  # alone, or inside the fused decode step
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, kernel=kernel: calls.append(1) or kernel(*a))
    limit = attention_backends.NATIVE_DECODE_MAX_KEYS
    bench = _load("decode_attention")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--contexts", "40",
            "--coroutines", "1", "3"]
    assert bench.main(argv) == 0
    assert "fused C attention vs torch kernels" in capsys.readouterr().out
    assert attention_backends.NATIVE_DECODE_MAX_KEYS == limit and calls  # the kernel ran
    runs = json.loads((tmp_path / "decode_attention.json").read_text())["runs"]
    assert [r["dtype"] for r in runs] == ["bfloat16", "float32"]
    for run in runs:
        assert [(r["context"], r["coroutines"], r["keys_per_step"]) for r in run["results"]] == [
            (40, 1, 44), (40, 3, 132)]
        assert all(r["native_ms"] > 0 and r["torch_ms"] > 0 for r in run["results"])
        assert [r["private"] for r in run["results"]] == [False, False]
    assert (tmp_path / "decode_attention.png").stat().st_size > 0
    # each coroutine on a context of its own
    assert bench.main([*argv[:-2], "3", "--private", "--dtypes", "float32"]) == 0
    (run,) = json.loads((tmp_path / "decode_attention.json").read_text())["runs"]
    assert [(r["coroutines"], r["private"], r["keys_per_step"]) for r in run["results"]] == [(3, True, 132)]


_NO_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None


@pytest.mark.skipif(_NO_COMPILER, reason="inductor needs a C++ compiler")
def test_compile_probe_quick(tiny_folder, tmp_path, capsys):
    """The probe compiles the decoder with view attention and prepacked linears as opaque ops and
    decodes the same greedy tokens as eager."""
    bench = _load("compile_probe")
    argv = ["--quick", "--model", str(tiny_folder), "--out", str(tmp_path), "--threads-list", "1",
            "--prompt", "8", "--steps", "4", "--repeats", "1"]
    enabled = native.ENABLED
    assert bench.main(argv) == 0
    assert native.ENABLED == enabled  # it measures the torch path without switching the kernels off for good
    assert "eager / compiled" in capsys.readouterr().out
    row = json.loads((tmp_path / "compile_probe.json").read_text())["results"]["rows"][0]
    assert row["threads"] == 1 and row["eager_ms"] > 0 and row["compiled_ms"] > 0
    assert row["same_tokens"] is True


def test_interactive_steps_smoke(tiny_folder, tmp_path, capsys):
    """bench/interactive_steps.py on a tiny model: both runs, the steps that carried the interactive
    token split by path, the gaps between steps and the p99 ratio line."""
    bench = _load("interactive_steps")
    argv = ["--model", str(tiny_folder), "--out", str(tmp_path), "--background", "2", "--tokens", "12"]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "interactive_steps.json").read_text())
    alone, loaded = data["runs"]
    assert alone["background"] == 0 and loaded["background"] == 2
    assert alone["gaps"]["n"] == 11 and alone["tokens_per_step"] == 1.0
    assert sum(d["n"] for d in loaded["by_path"].values()) == loaded["steps"]["n"] >= 12
    assert loaded["tokens_per_step"] > 1.0  # background tokens rode with the interactive ones
    assert 0 <= loaded["one_thread_steps"] <= loaded["steps"]["n"]
    assert loaded["collector_pauses_in_steps"]["n"] >= 0
    out = capsys.readouterr().out
    assert "inter-token p99 with 2 background / alone" in out and "collector pauses inside" in out


def test_vision_smoke(tmp_path, capsys):
    """bench/vision.py on its tiny random multimodal model: the tower table and the three decode runs."""
    bench = _load("vision")
    argv = ["--model", "tiny-vl-random", "--out", str(tmp_path), "--images", "1", "--size", "64x96",
            "--repeats", "1", "--decode-tokens", "6", "--fps", "8", "--frame-size", "64x64"]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "vision.json").read_text())
    assert data["tower"]["vision_tokens"] > 0 and data["tower"]["cothink_tokens_per_s"] > 0
    assert [row["load"] for row in data["decode"]] == ["alone", "text", "stream"]
    assert "interactive decode with a 8 fps stream" in capsys.readouterr().out
