"""bfloat16: Kimi's KDA layers decode as transformers does (its conv rounds once, after fp32 sums)."""

from __future__ import annotations

import copy

import torch
from reference import max_err, random_ids

import cothink

BF16_TOL = 1e-2  # a few bfloat16 ulps of logits of about 3


def test_kda_token_by_token_matches_transformers_in_bfloat16(tiny_model, record_error):
    tm = tiny_model("kimi_1l_kda")
    ref = copy.deepcopy(tm.ref).to(torch.bfloat16)
    ids = random_ids(40, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor([ids]), use_cache=False).logits[0].float()
    runner = cothink.load_model(tm.folder, dtype=torch.bfloat16)
    whole = runner.extend(runner.new_block(), ids)
    block = runner.new_block()
    steps = torch.cat([runner.extend(block, [t]) for t in ids])
    assert record_error("bf16 whole prefill", tm.name, max_err(whole, want)) < BF16_TOL
    assert record_error("bf16 token by token", tm.name, max_err(steps, want)) < BF16_TOL
