"""The `cothink` command line: parsing, streaming decode, greedy generation against transformers."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest

from cothink import cli
from cothink.models.text import IncrementalDecoder, chat_prompt_ids, stop_token_ids

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--help"], ["prepare", "-h"], ["generate", "--help"], ["demo", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    assert "usage: cothink" in capsys.readouterr().out


def test_console_script_help():
    exe = Path(sys.executable).parent / "cothink"
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "prepare" in out.stdout and "generate" in out.stdout


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt", "x", "--dtype", "float16"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x", "--max-tokens", "0"])
    assert cli.main([]) == 2


def test_prepare_unknown_model_is_a_clean_error(capsys):
    assert cli.main(["prepare", "no-such-model-xyz"]) == 1
    err = capsys.readouterr().err
    assert "cothink: error:" in err and "smollm2" in err


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from cothink.models.hub import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2"), local_files_only=True)


def _qwen():
    from qwen_tokenizer import build_qwen_tokenizer

    return build_qwen_tokenizer("qwen3")


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
def test_incremental_decoder_multibyte(which, smollm2_tokenizer):
    tok = smollm2_tokenizer if which == "smollm2" else _qwen()
    text = "Hello 你好，世界! 🙂🚀 👩‍💻 naïve — ok.\n  indented  line"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_keeps_a_tokenizer_class_s_own_decoding(smollm2_tokenizer):
    """The decoder calls the Rust tokenizer directly only for a fast tokenizer whose class decodes as
    transformers' base class does; a class with its own decoding is decoded through it."""
    class Shouting(type(smollm2_tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    tok = copy.copy(smollm2_tokenizer)
    tok.__class__ = Shouting
    ids = tok.encode("quiet words", add_special_tokens=False)
    decoder = IncrementalDecoder(tok)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == "QUIET WORDS"
    plain = IncrementalDecoder(smollm2_tokenizer)
    assert "".join([plain.push(i) for i in ids] + [plain.flush()]) == "quiet words"


def test_stop_ids(smollm2_tokenizer):
    stops = stop_token_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    assert smollm2_tokenizer.convert_tokens_to_ids("<|endoftext|>") in stops


def _hf_greedy(runner, prompt, max_tokens):
    import torch

    ids = chat_prompt_ids(runner.tokenizer, prompt)
    stops = sorted(stop_token_ids(runner.tokenizer))
    prompt_ids = torch.tensor([ids])
    out = runner.model.generate(prompt_ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=stops)
    new = out[0, len(ids) :].tolist()
    if new and new[-1] in stops:
        new = new[:-1]
    return runner.tokenizer.decode(new, skip_special_tokens=True)


class _HFRunner:
    def __init__(self, folder):
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def hf_runner():
    from cothink.models.hub import resolve_model_path

    return _HFRunner(resolve_model_path("smollm2"))


def test_stream_generation_matches_transformers_greedy(hf_runner):
    prompt = "Name three colors."
    out, err = io.StringIO(), io.StringIO()
    count = cli.stream_generation("smollm2", prompt, max_tokens=16, dtype="float32", out=out, err=err)
    assert 0 < count <= 16
    assert out.getvalue() == _hf_greedy(hf_runner, prompt, 16) + "\n"
    assert "tokens" in err.getvalue()


def test_generate_with_cothink_runner(hf_runner, capsys):
    """End to end through the engine: same text as transformers' greedy decoding."""
    prompt = "What is the capital of France?"
    assert cli.main(["generate", "--prompt", prompt, "--max-tokens", "16"]) == 0
    got = capsys.readouterr().out
    expected = _hf_greedy(hf_runner, prompt, 16) + "\n"
    assert got == expected
    assert "Paris" in got
