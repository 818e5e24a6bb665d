"""A decoding token's Gated DeltaNet step in one C call (execution/linear_state.py `run_tokens` ->
`native.gdn_token`) against the torch path it replaces, on a layer of the tiny Qwen3.5 model."""

from __future__ import annotations

import pytest
import torch

from cothink.execution.linear_state import run_tokens
from cothink.execution.native_modules import NativeDeltaRecurrence
from cothink.models.transformer import DeltaRecurrence
from cothink.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")


def _token(mixer, dtype: torch.dtype, seed: int):
    c, gen = mixer.cfg, torch.Generator().manual_seed(seed)
    history = torch.randn(c.conv_kernel - 1, c.conv_dim, generator=gen).to(dtype)
    row = torch.randn(1, c.conv_dim, generator=gen).to(dtype)
    decay = -torch.rand(1, c.num_v_heads, generator=gen)  # log decay
    beta = torch.rand(1, c.num_v_heads, generator=gen)
    state = torch.randn(c.num_v_heads, c.k_dim, c.v_dim, generator=gen)
    return history, row, decay, beta, state


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_decoding_token_takes_one_c_call_with_the_torch_paths_result(
    tiny_model, record_error, monkeypatch, dtype, tol
):
    """float32 to float rounding; bfloat16 to a rounding of the conv output (both paths round the
    conv's products, sum and SiLU to bfloat16, in other summation orders). The state it starts from
    is left as it was (a cached writer state may be read again)."""
    runner = tiny_model("qwen35").runner(dtype=dtype)
    mixer = next(layer.linear_attn for layer in runner.model.model.layers if hasattr(layer, "linear_attn"))
    calls, kernel = [], native.gdn_token
    monkeypatch.setattr(native, "gdn_token", lambda *a: calls.append(1) or kernel(*a))
    for seed in range(3):
        history, row, decay, beta, state = _token(mixer, dtype, seed)
        kept = state.clone()
        assert isinstance(mixer.recurrence, NativeDeltaRecurrence)
        out, new = run_tokens(mixer, history, row, decay, beta, state)
        assert len(calls) == seed + 1 and torch.equal(state, kept)
        swapped, mixer.recurrence = mixer.recurrence, DeltaRecurrence(mixer.cfg)  # the torch path
        want_out, want_state = run_tokens(mixer, history, row, decay, beta, state)
        mixer.recurrence = swapped
        assert out.shape == want_out.shape and new.shape == want_state.shape
        err = max((out - want_out).abs().max() / want_out.abs().max(),
                  (new - want_state).abs().max() / want_state.abs().max()).item()
        assert record_error("gdn token C vs torch (relative)", f"qwen35 {dtype}", err) < tol
    assert len(calls) == 3  # the torch-path calls did not reach the kernel


def test_prefill_rows_and_the_eager_model_keep_the_torch_path(tiny_model, monkeypatch):
    calls: list[int] = []
    kernel = native.gdn_token
    monkeypatch.setattr(native, "gdn_token", lambda *a: calls.append(1) or kernel(*a))
    eager, fast = tiny_model("qwen35").runner(fast=False), tiny_model("qwen35").runner()
    fast.fused_decode = None  # the per-module path (the fused step makes the same call inside its C call)
    for runner in (eager, fast):
        block = runner.new_block()
        runner.extend(block, [5, 6, 7, 8], logits="last")  # four rows: the chunk of torch ops
        assert calls == []
        runner.extend(block, [9], logits="last")  # one row: the kernel, on the fast path only
    assert len(calls) == len(fast.config.linear_layers)
