"""The pure-torch path on an accelerator gives the CPU path's logits (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from reference import max_err, random_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def exact_cuda():
    """fp32 on CUDA without TF32 (cuDNN convolutions use TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("name", ["llama_yarn", "qwen35", "qwen35_moe", "kimi"])
def test_cuda_matches_cpu(tiny_model, exact_cuda, name):
    tm = tiny_model(name)
    results = []
    for device in ("cpu", "cuda"):
        # dense summaries from 8 tokens, so the GDN summary path runs on the device as well
        runner = tm.runner(device=device, dense_summary_min_tokens=8)
        blocks, outs = [], []
        for i, n in enumerate([1, 3, 30, 5]):
            block = runner.new_block()
            blocks.append(block)
            outs.append(runner.extend(block, random_ids(n, seed=50 + i), view=list(blocks)))
        reader = runner.new_block()
        outs.append(runner.extend(reader, random_ids(4, seed=60), view=blocks[::-1] + [reader]))
        results.append(torch.cat(outs).cpu())
    assert max_err(results[0], results[1]) < 1e-4
