"""Steps of the MoE and Kimi Linear families: one routing per layer over every item's rows, each backend's
attention over MLA latents, and results that do not depend on the batch beyond float tolerance."""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, max_err, random_ids, reference_logits
from support import count_native_rows

from cothink.execution.step import StepItem
from cothink.models.moe import Experts, Router
from cothink.ops import native


def _items(runner, ctx):
    """Three coroutines over one context, of 1, 5 and 2 new tokens."""
    blocks = [runner.new_block(f"c{i}") for i in range(3)]
    sizes = (1, 5, 2)
    return [StepItem(b, random_ids(n, seed=40 + i), [ctx, b]) for i, (b, n) in enumerate(zip(blocks, sizes))]


@pytest.mark.parametrize("name", ["qwen35_moe", "qwen3_next", "kimi"])
def test_one_step_routes_every_items_tokens_together(tiny_model, monkeypatch, name):
    runner = tiny_model(name).runner()
    ctx = runner.new_block("ctx")
    runner.extend(ctx, random_ids(12, seed=4))
    rows: list[int] = []
    real = Experts.forward

    def counting(self, x, routing):
        rows.append(x.shape[0])
        return real(self, x, routing)

    monkeypatch.setattr(Experts, "forward", counting)
    items = _items(runner, ctx)
    want = [reference_logits(runner, it.view, it.token_ids) for it in items]
    got = runner.step(items)
    sparse = sum(runner.config.family_config.sparse_layers)
    assert rows == [8] * sparse  # one expert pass per sparse layer, over all 1 + 5 + 2 rows
    for g, w in zip(got, want):
        assert max_err(g, w) < ATOL


@pytest.mark.parametrize("name", ["qwen35_moe", "kimi"])
def test_routing_of_a_token_does_not_depend_on_its_batch(tiny_model, monkeypatch, name):
    """The experts a token selects, alone or among other coroutines' tokens (the router caveat: its
    GEMM may round differently per batch size, so this holds where no two scores are that close,
    as on these weights)."""
    runner = tiny_model(name).runner()
    ctx = runner.new_block("ctx")
    runner.extend(ctx, random_ids(12, seed=4))
    seen: list[torch.Tensor] = []
    real = Router.forward

    def recording(self, x):
        routing = real(self, x)
        seen.append(routing.experts)
        return routing

    monkeypatch.setattr(Router, "forward", recording)
    items = _items(runner, ctx)
    together = runner.step(items)
    batched = list(seen)
    for it in items:
        runner.truncate(it.block, 0)
    alone_experts, alone = [], []
    for it in items:
        seen.clear()
        alone.append(runner.step([it])[0])
        alone_experts.append(list(seen))
    row = 0
    for i, it in enumerate(items):
        n = len(it.token_ids)
        for layer, experts in enumerate(alone_experts[i]):
            assert torch.equal(batched[layer][row : row + n], experts)
        row += n
        assert max_err(together[i], alone[i]) < 1e-5


def test_mla_decode_runs_in_the_native_kernel(tiny_model, monkeypatch):
    """A latent of 32 values is a head the native decode attention reads (one KV head, no rotation)."""
    if not native.available():
        pytest.skip("cothink's C kernels are not available")
    tm = tiny_model("kimi_latent32")
    calls = count_native_rows(monkeypatch, "decode_attention")
    context = random_ids(20, seed=1)
    for backend in ("native", "torch"):
        runner = tm.runner(attention_backend=backend)
        ctx = runner.new_block("ctx")
        runner.extend(ctx, context)
        blocks = [runner.new_block(f"d{i}") for i in range(3)]
        got = runner.step([StepItem(b, [5 + i], [ctx, b], "last") for i, b in enumerate(blocks)])
        for i, g in enumerate(got):
            assert max_err(g, tm.logits(context + [5 + i])[-1:]) < ATOL
        assert bool(calls) == (backend == "native")
        calls.clear()
