"""cothink.models.mla (Kimi's NoPE multi-head latent attention as latent MQA) against transformers'
KimiLinearAttention, and attention over key runs merged by log-sum-exp."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from support import tiny_kimi_config

from cothink.models.mla import MultiLatentAttention, causal_attend
from cothink.models.moe_config import MlaConfig, family_config_from_hf
from cothink.ops.attention import merge_partials, partial_attention

HIDDEN = 32


def _config(**kw):
    cfg = tiny_kimi_config(**(dict(pad_token_id=0, bos_token_id=2, eos_token_id=1) | kw))
    cfg._attn_implementation = "eager"
    return cfg


def _pair(seed: int, **kw):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    hf_cfg = _config(**kw)
    ref = KimiLinearAttention(hf_cfg, 1).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            base = 1.0 if "layernorm" in name else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
    ours = MultiLatentAttention(family_config_from_hf(hf_cfg).mla, HIDDEN, 1).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def _causal_mask(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": 12}, {"attention_bias": True}])
def test_latent_attention_equals_transformers(kw):
    ours, ref = _pair(seed=len(kw), **kw)
    t = 23
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = ref(x[None], attention_mask=_causal_mask(t))
        got = ours(x, causal_attend(ours.cfg.scale))
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-5)
    assert want.abs().max() > 0.1


def test_latent_attention_bf16_close_to_transformers():
    """bfloat16: the absorbed query changes the rounding, not the math (close, not bitwise)."""
    ours, ref = _pair(seed=7)
    ours, ref = ours.bfloat16(), ref.bfloat16()
    t = 17
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        want, _ = ref(x[None], attention_mask=_causal_mask(t))
        got = ours(x, causal_attend(ours.cfg.scale))
    torch.testing.assert_close(got.float(), want[0].float(), atol=3e-2, rtol=3e-2)


def test_key_runs_merged_by_lse_equal_the_whole():
    """The last rows' attention split over earlier key runs (wholly visible) plus their own causal run,
    merged by log-sum-exp, equals attention over the whole sequence; the latent cache is what it reads."""
    ours, _ = _pair(seed=3)
    t, own = 40, 6
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(4))
    scale = ours.cfg.scale
    with torch.no_grad():
        whole = ours(x, causal_attend(scale))
        lat = ours.latent(x)  # [T, r + dr]: one row per token, as a pool would store it
        assert lat.shape == (t, ours.cfg.latent_dim)
        q = ours.queries(x[-own:])
        outs, lses = [], []
        for a, b in ((0, 9), (9, 10), (10, t - own)):
            o, lse = partial_attention(q, lat[a:b, None], lat[a:b, None], scale)
            outs.append(o)
            lses.append(lse)
        o, lse = partial_attention(q, lat[-own:, None], lat[-own:, None], scale, causal=True)
        merged = merge_partials([*outs, o], [*lses, lse])
        torch.testing.assert_close(ours.output(merged, x[-own:]), whole[-own:], atol=1e-6, rtol=1e-5)


def test_logits_do_not_depend_on_positions():
    """Kimi Linear has no rotary embedding: the model's logits are the same under any position_ids."""
    hf_cfg = _config()
    torch.manual_seed(0)
    model = tf.KimiLinearForCausalLM(hf_cfg).eval()
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(12)[None] + 1000).logits
        shuffled = model(
            ids, position_ids=torch.randperm(12, generator=torch.Generator().manual_seed(6))[None]
        ).logits
    assert torch.equal(base, shifted) and torch.equal(base, shuffled)


def test_latent_bytes_per_token():
    """What one MLA layer stores per token: r + dr values (Kimi-Linear-48B: (512 + 64) * 2 bytes in bfloat16),
    not the expanded per-head keys and values (32 * (192 + 128) values)."""
    cfg = MlaConfig(
        num_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        bias=False,
    )
    assert cfg.latent_dim == 576 and cfg.latent_bytes(2) == 1152
    assert cfg.scale == pytest.approx(192**-0.5)
