"""Block snapshots: blocks (tokens, KV, Gated DeltaNet records, names) in one safetensors file.

The file holds, per block i, its keys and values `i.k`, `i.v` ([attention layers, tokens, kv heads,
head dim], keys rotated at block-local positions as stored; `i.k` only where the pool stores one
tensor for both, MLA's latent) and, per linear layer j, either its
records (`i.j.rows`, `i.j.g`, `i.j.beta`, optional `i.j.summary`) or its sealed form (`i.j.head_rows`,
... see SealedRecords). The safetensors metadata key "cothink" holds a JSON header: format version,
the model identity (family, config and weight fingerprints, dtype) and each block's name, length,
tokens and flags. Loading into a model with a different identity raises SnapshotMismatchError.
Spilled blocks use the same format (one block per file).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cothink.errors import PoolExhaustedError, SnapshotError, SnapshotMismatchError
from cothink.memory.block import Block, GrowingTensor, LinearRecords, SealedRecords, VisionSpan
from cothink.memory.store import BlockStore

FORMAT = "cothink-snapshot"
VERSION = 1
_SEALED_FIELDS = ("head_rows", "head_g", "head_beta", "summary", "window_rows", "window_g", "window_beta")


@dataclass(frozen=True)
class ModelIdentity:
    """What a snapshot must match: the model's family, config and weights, and the memory dtype."""

    family: str
    config_sha256: str
    weights_sha256: str
    dtype: str


@dataclass(frozen=True)
class BlockHeader:
    name: str
    length: int
    tokens: list[int]
    sealed: bool
    pinned: bool
    linear: list[str]  # per linear layer: "records" or "sealed"
    summary_covers: list[int]
    # the block's image and frame-group runs: [first placeholder, merged rows, merged columns]
    vision: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class SnapshotHeader:
    format: str
    version: int
    model: ModelIdentity
    blocks: list[BlockHeader]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> SnapshotHeader:
        raw = json.loads(text)
        return SnapshotHeader(
            raw["format"], raw["version"], ModelIdentity(**raw["model"]),
            [BlockHeader(**b) for b in raw["blocks"]],
        )


Tensors = dict[str, torch.Tensor]


def block_tensors(store: BlockStore, block: Block, prefix: str) -> tuple[Tensors, BlockHeader]:
    """A block's memory as named CPU tensors (copies) and its header entry."""
    n = block.length
    tensors: dict[str, torch.Tensor] = {}
    if store.attn_slot:
        slots = store.slots(block, 0, n)
        tensors[f"{prefix}.k"] = store.pool.k[:, slots].to("cpu", copy=True)
        if not store.pool.shared_kv:  # (MLA: the latent is both, stored once)
            tensors[f"{prefix}.v"] = store.pool.v[:, slots].to("cpu", copy=True)
    kinds, covers = [], []
    for j, rec in enumerate(block.linear):
        if isinstance(rec, SealedRecords):
            kinds.append("sealed")
            covers.append(rec.length)
            for name in _SEALED_FIELDS:
                tensors[f"{prefix}.{j}.{name}"] = getattr(rec, name).to("cpu", copy=True)
            continue
        kinds.append("records")
        for name, part in (("rows", rec.rows), ("g", rec.g), ("beta", rec.beta)):
            tensors[f"{prefix}.{j}.{name}"] = part.data[:n].to("cpu", copy=True)
        covered = rec.summary is not None and rec.summary_covers <= n
        covers.append(rec.summary_covers if covered else 0)
        if covered:
            tensors[f"{prefix}.{j}.summary"] = rec.summary.to("cpu", copy=True)
    runs = [[r.start, r.rows, r.cols] for r in block.vision if r.start < n]
    header = BlockHeader(
        block.name, n, list(block.tokens[:n]), block.sealed, block.pinned, kinds, covers, runs
    )
    return tensors, header


def restore_block(
    store: BlockStore,
    block: Block,
    header: BlockHeader,
    tensors: dict[str, torch.Tensor],
    prefix: str,
    *,
    same_content: bool = False,
) -> None:
    """Fill a block without resident memory (new, or spilled) from a snapshot entry (pages reserved
    here; PoolExhaustedError if the pool cannot hold them, leaving the block as it was).
    `same_content`: the block already had this content (a spilled block coming back), so its
    version stays and caches keyed on it stay valid."""
    n = header.length
    had = len(block.pages)
    store.reserve([(block, n)])
    try:
        device = store.device
        if store.attn_slot:
            slots = store.slots(block, 0, n)
            store.pool.k[:, slots] = tensors[f"{prefix}.k"].to(device)
            if not store.pool.shared_kv:
                store.pool.v[:, slots] = tensors[f"{prefix}.v"].to(device)
        linear: list[LinearRecords | SealedRecords] = []
        for j, (kind, covers) in enumerate(zip(header.linear, header.summary_covers)):
            get = lambda name: tensors[f"{prefix}.{j}.{name}"].to(device)  # noqa: E731
            if kind == "sealed":
                linear.append(SealedRecords(n, *(get(name) for name in _SEALED_FIELDS)))
                continue
            rec = LinearRecords(*(_growing(get(name)) for name in ("rows", "g", "beta")))
            if covers:
                rec.summary, rec.summary_covers = get("summary"), covers
            linear.append(rec)
    except KeyError as exc:
        for page in block.pages[had:]:
            store.pool.release(page)
        del block.pages[had:]
        raise SnapshotError(f"snapshot is missing tensor {exc.args[0]!r}") from None
    for old in block.linear:
        old.release()
    block.linear = linear
    block.tokens = list(header.tokens)
    block.vision = [VisionSpan(*run) for run in header.vision]
    block.length = n
    if not same_content:
        block.version += 1
        block.sealed, block.pinned = header.sealed, header.pinned


def _growing(rows: torch.Tensor) -> GrowingTensor:
    t = GrowingTensor(tuple(rows.shape[1:]), rows.dtype, rows.device)
    t.append(rows)
    return t


def write_snapshot(path: str | Path, header: SnapshotHeader, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"cothink": header.to_json()})
    tmp.replace(path)  # a reader never sees a half-written file


def read_snapshot(path: str | Path, expected: ModelIdentity) -> tuple[SnapshotHeader, Tensors]:
    """The header and tensors of a snapshot file; SnapshotMismatchError unless it was saved from
    the model (and dtype) `expected` describes."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"no snapshot at {path}", param="path")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        header = SnapshotHeader.from_json(meta["cothink"])
    except Exception as exc:  # not safetensors, or no cothink header
        raise SnapshotError(f"{path} is not a cothink snapshot: {exc}", param="path") from None
    if header.format != FORMAT or header.version != VERSION:
        raise SnapshotError(f"{path}: unsupported snapshot format {header.format} v{header.version}")
    if header.model != expected:
        diff = [f for f in ("family", "config_sha256", "weights_sha256", "dtype")
                if getattr(header.model, f) != getattr(expected, f)]
        raise SnapshotMismatchError(
            f"snapshot {path} was saved from a different model ({', '.join(diff)} differ: snapshot "
            f"{header.model.family}/{header.model.dtype}, engine {expected.family}/{expected.dtype})",
            param="path",
        )
    return header, load_file(str(path))


def snapshot_bytes(store: BlockStore, header: BlockHeader, tensors: Tensors, prefix: str) -> int:
    """Block memory restoring one entry takes: its KV pages and its GDN tensors."""
    pages = -(-header.length // store.page_size) if store.attn_slot else 0
    linear = sum(
        t.numel() * t.element_size()
        for name, t in tensors.items()
        if name.startswith(f"{prefix}.") and name not in (f"{prefix}.k", f"{prefix}.v")
    )
    return pages * store.pool.bytes_per_page + linear


def check_fits(store: BlockStore, need_bytes: int, need_pages: int) -> None:
    if need_pages > store.pool.free_pages:
        raise PoolExhaustedError(
            f"the KV pool cannot hold the snapshot: {need_pages} pages needed, {store.pool.free_pages} free"
        )
    budget = store.budget_bytes
    if budget is not None and store.total_bytes() + need_bytes > budget:
        raise PoolExhaustedError(
            f"the memory budget of {budget} bytes cannot hold the snapshot: {need_bytes} bytes needed, "
            f"{max(0, budget - store.total_bytes())} left"
        )


def spill_block(store: BlockStore, block: Block, path: Path, identity: ModelIdentity) -> None:
    """Write a block's memory (KV and GDN records) to `path` and free it; its tokens, name, length
    and version stay, so views and caches that name it stay valid. `reload_block` brings it back."""
    tensors, header = block_tensors(store, block, "0")
    write_snapshot(path, SnapshotHeader(FORMAT, VERSION, identity, [header]), tensors)
    for page in block.pages:
        store.pool.release(page)  # a fork sharing the page keeps it
    for rec in block.linear:
        rec.release()
    block.pages, block.linear = [], []
    block.spilled = path
    block.spilled_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    store.spilled_bytes += block.spilled_bytes


def reload_bytes(store: BlockStore, block: Block) -> tuple[int, int]:
    """(bytes, pages) reloading a spilled block takes."""
    pages = -(-block.length // store.page_size)
    linear = block.spilled_bytes - block.length * store.kv_bytes_per_token
    return pages * store.pool.bytes_per_page + linear, pages


def reload_block(store: BlockStore, block: Block, identity: ModelIdentity) -> None:
    """Bring a spilled block back exactly as it was (bit for bit) and delete its file."""
    assert block.spilled is not None
    header, tensors = read_snapshot(block.spilled, identity)
    restore_block(store, block, header.blocks[0], tensors, "0", same_content=True)
    store.spilled_bytes -= block.spilled_bytes
    block.spilled.unlink(missing_ok=True)
    block.spilled, block.spilled_bytes = None, 0
