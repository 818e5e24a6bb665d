"""Block snapshots: blocks (tokens, KV, Gated DeltaNet records, names) in one safetensors file.

Every tensor is stored once, named by its content: ``sha256(dtype, shape, bytes)`` in hex. A block's
header entry lists the tensors it reads by that name, so memory several blocks share (the pages of
copy-on-write forks, their shared records, equal content anywhere) is written once, and reading a
file checks every tensor against its name (damage is a SnapshotError, never a silent restore).

KV is stored per page: one tensor ``[2 (k, v), attention layers, page_size, kv heads, head dim]``
(``[1, ...]`` where the pool keeps one tensor for both, MLA's latent) per distinct page of the pool
(keys rotated at block-local positions, as stored), rows past the longest block that reads them
zeroed. A block's entry lists its pages in order (`pages`) and its
Gated DeltaNet tensors by role (`tensors`: ``"<layer>.rows"``, ``"<layer>.g"``, ``"<layer>.beta"``,
``"<layer>.summary"``, or a sealed layer's ``"<layer>.head_rows"`` ... see SealedRecords).

The safetensors metadata key "cothink" holds a JSON header: format, version, the model identity
(family, config and weight fingerprints, dtype) and each block's name, length, tokens, flags and
tensor names. Loading into a model with a different identity raises SnapshotMismatchError. Files of
version 1 (one tensor per block, ``"<i>.k"`` ..., no checksums) are still read. A reader meets a
version it does not know with a SnapshotError naming both versions; fields are added by a new
version (`BlockHeader` fields with defaults keep older headers readable).
Spilled blocks use the same format (one block per file).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cothink.errors import PoolExhaustedError, SnapshotError, SnapshotMismatchError
from cothink.memory.block import Block, GrowingTensor, LinearRecords, SealedRecords, VisionSpan
from cothink.memory.store import BlockStore

FORMAT = "cothink-snapshot"
VERSION = 2
READABLE_VERSIONS = (1, 2)
_HEADER_SUM = "cothink_sha256"  # metadata key: sha256 of the JSON header (v2)
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
    pages: list[str] = field(default_factory=list)  # v2: its KV pages in order, by content name
    tensors: dict[str, str] = field(default_factory=dict)  # v2: "<layer>.<part>" -> content name
    # v2: the block's image and frame-group runs: [first placeholder, merged rows, merged columns]
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


# ---- saving ----------------------------------------------------------------------------------
@dataclass
class Capture:
    """What saving copies from memory between steps: each distinct pool page and each distinct
    record buffer once, whatever number of blocks read it. Turning it into a file (`write_snapshot`)
    needs no engine and runs in a worker thread."""

    identity: ModelIdentity
    page_size: int
    blocks: list[BlockHeader]  # without content names yet
    block_pages: list[list[int]]  # per block: its pool pages, in order
    # pool page -> (k, v or None where the pool keeps one tensor for both: MLA) [layers, rows, H, D]
    pages: dict[int, tuple[torch.Tensor, torch.Tensor | None]]
    block_tensors: list[dict[str, int]]  # per block: "<layer>.<part>" -> key in `parts`
    parts: dict[int, torch.Tensor]  # distinct record tensors (CPU copies)


def capture_blocks(store: BlockStore, blocks: list[Block], identity: ModelIdentity) -> Capture:
    """Copy the committed content of `blocks` to CPU, shared memory once (call between steps)."""
    size = store.page_size
    used: dict[int, int] = {}  # pool page -> rows some block reads
    block_pages: list[list[int]] = []
    for block in blocks:
        pages = block.pages[: -(-block.length // size)] if store.attn_slot else []
        for j, page in enumerate(pages):
            used[page] = max(used.get(page, 0), min(size, block.length - j * size))
        block_pages.append(list(pages))
    shared = store.attn_slot and store.pool.shared_kv  # MLA: one latent is both key and value
    kv = {
        page: (
            store.pool.k[:, page * size : page * size + rows].to("cpu", copy=True),
            None if shared else store.pool.v[:, page * size : page * size + rows].to("cpu", copy=True),
        )
        for page, rows in used.items()
    }
    parts: dict[int, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], int] = {}  # (buffer, offset, shape) -> key in parts

    def keep(t: torch.Tensor) -> int:
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident not in seen:
            seen[ident] = len(parts)
            parts[len(parts)] = t.to("cpu", copy=True)
        return seen[ident]

    headers, tensor_keys = [], []
    for block in blocks:
        n = block.length
        kinds, covers, named = [], [], {}
        for j, rec in enumerate(block.linear):
            if isinstance(rec, SealedRecords):
                kinds.append("sealed")
                covers.append(rec.length)
                for name in _SEALED_FIELDS:
                    named[f"{j}.{name}"] = keep(getattr(rec, name))
                continue
            kinds.append("records")
            for name, part in (("rows", rec.rows), ("g", rec.g), ("beta", rec.beta)):
                named[f"{j}.{name}"] = keep(part.data[:n])
            covered = rec.summary is not None and rec.summary_covers <= n
            covers.append(rec.summary_covers if covered else 0)
            if covered:
                named[f"{j}.summary"] = keep(rec.summary)
        headers.append(
            BlockHeader(
                block.name, n, list(block.tokens[:n]), block.sealed, block.pinned, kinds, covers,
                vision=[[r.start, r.rows, r.cols] for r in block.vision if r.start < n],
            )
        )
        tensor_keys.append(named)
    return Capture(identity, size, headers, block_pages, kv, tensor_keys, parts)


def content_name(t: torch.Tensor) -> str:
    """The name a tensor is stored under: sha256 of its dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _page_tensor(k: torch.Tensor, v: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """[2 (k, v), layers, page_size, heads, dim]; [1, ...] where keys and values are one tensor (MLA)."""
    layers, rows, heads, dim = k.shape
    page = torch.zeros((1 if v is None else 2, layers, page_size, heads, dim), dtype=k.dtype)
    page[0, :, :rows] = k
    if v is not None:
        page[1, :, :rows] = v
    return page


def write_snapshot(path: str | Path, capture: Capture) -> int:
    """Write `capture` to `path` (atomically: a reader never sees a half-written file); returns the
    file's size. Runs in a worker thread: hashing and writing never hold the event loop."""
    from safetensors.torch import save_file

    stored: Tensors = {}

    def put(t: torch.Tensor) -> str:
        name = content_name(t)
        stored.setdefault(name, t.contiguous())
        return name

    page_names = {p: put(_page_tensor(k, v, capture.page_size)) for p, (k, v) in capture.pages.items()}
    part_names = {key: put(t) for key, t in capture.parts.items()}
    blocks = [
        BlockHeader(
            **{**asdict(h), "pages": [page_names[p] for p in pages], "tensors": {
                role: part_names[key] for role, key in named.items()}}
        )
        for h, pages, named in zip(capture.blocks, capture.block_pages, capture.block_tensors)
    ]
    header = SnapshotHeader(FORMAT, VERSION, capture.identity, blocks)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = header.to_json()
    checksum = hashlib.sha256(text.encode()).hexdigest()
    save_file(stored, str(tmp), metadata={"cothink": text, _HEADER_SUM: checksum})
    tmp.replace(path)
    return path.stat().st_size


# ---- reading ---------------------------------------------------------------------------------
@dataclass
class LoadedSnapshot(os.PathLike):
    """A snapshot file read and checked (`read_snapshot`), ready to restore into an engine of the
    same model. It is a path-like of its file, so whatever records a load by path still can."""

    path: Path
    header: SnapshotHeader
    tensors: Tensors

    def __fspath__(self) -> str:
        return str(self.path)

    def part(self, i: int, role: str) -> torch.Tensor:
        """Block i's tensor `role` ("<layer>.<part>"); KeyError when the file lacks it."""
        if self.header.version == 1:
            return self.tensors[f"{i}.{role}"]
        return self.tensors[self.header.blocks[i].tensors[role]]

    def kv_chunks(self, i: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Block i's keys and values as (first token, k, v) chunks, k and v [layers, rows, H, D]."""
        entry = self.header.blocks[i]
        if self.header.version == 1:
            k = self.tensors[f"{i}.k"]
            yield 0, k, self.tensors.get(f"{i}.v", k)
            return
        for j, name in enumerate(entry.pages):
            page = self.tensors[name]
            size = page.shape[2]
            rows = min(size, entry.length - j * size)
            yield j * size, page[0, :, :rows], page[-1, :, :rows]  # one tensor for both: MLA

    def linear_bytes(self, i: int) -> int:
        entry = self.header.blocks[i]
        if self.header.version == 1:
            names = [n for n in self.tensors if n.startswith(f"{i}.") and n not in (f"{i}.k", f"{i}.v")]
        else:
            names = list(entry.tensors.values())
        return sum(self.tensors[n].numel() * self.tensors[n].element_size() for n in names)


def read_header(path: str | Path) -> SnapshotHeader:
    """The header alone (no tensor is read): what a snapshot holds, for checks before loading it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"no snapshot at {path}", param="path")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        text = meta["cothink"]
        raw = json.loads(text)
        kind, version = raw["format"], raw["version"]
    except Exception as exc:  # not safetensors, or no cothink header
        raise SnapshotError(f"{path} is not a cothink snapshot: {exc}", param="path") from None
    # the version first: a later version may add fields this reader does not know
    if kind != FORMAT or version not in READABLE_VERSIONS:
        raise SnapshotError(
            f"{path}: unsupported snapshot format {kind} v{version}; this version of "
            f"cothink reads {FORMAT} v{', v'.join(map(str, READABLE_VERSIONS))}",
            param="path",
        )
    if version >= 2 and meta.get(_HEADER_SUM) != hashlib.sha256(text.encode()).hexdigest():
        raise SnapshotError(f"{path}: the snapshot's header is damaged (it fails its checksum)", param="path")
    try:
        header = SnapshotHeader.from_json(text)
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path}: the snapshot's header is malformed: {exc}", param="path") from None
    return header


def check_identity(header: SnapshotHeader, expected: ModelIdentity, path: str | Path) -> None:
    """SnapshotMismatchError unless the snapshot was saved from the model (and dtype) `expected`."""
    if header.model != expected:
        diff = [f for f in ("family", "config_sha256", "weights_sha256", "dtype")
                if getattr(header.model, f) != getattr(expected, f)]
        raise SnapshotMismatchError(
            f"snapshot {path} was saved from a different model ({', '.join(diff)} differ: snapshot "
            f"{header.model.family}/{header.model.dtype}, engine {expected.family}/{expected.dtype})",
            param="path",
        )


def read_snapshot(path: str | Path, expected: ModelIdentity | None = None) -> LoadedSnapshot:
    """Read a snapshot file and check every tensor against its content name (SnapshotError on any
    damage); with `expected`, also that it was saved from that model (SnapshotMismatchError).
    Touches no engine state: safe in a worker thread."""
    from safetensors.torch import load_file

    path = Path(path)
    header = read_header(path)
    if expected is not None:
        check_identity(header, expected, path)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # a damaged tensor section
        raise SnapshotError(f"{path}: the snapshot's data is damaged: {exc}", param="path") from None
    if header.version >= 2:
        for name, t in tensors.items():
            if content_name(t) != name:
                raise SnapshotError(
                    f"{path}: the snapshot's data is damaged (tensor {name[:12]}... fails its checksum)",
                    param="path",
                )
        for i, entry in enumerate(header.blocks):
            if any(n not in tensors for n in (*entry.pages, *entry.tensors.values())):
                raise SnapshotError(f"{path}: block {i} names tensors the snapshot lacks", param="path")
    return LoadedSnapshot(path, header, tensors)


# ---- restoring -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shared:
    """How a restored block of `length` tokens starts: as a fork of an earlier block of the same
    snapshot (`source`), keeping its first `tokens` tokens (pages the two blocks stored as the same
    page), or empty (source -1, tokens 0)."""

    source: int = -1
    tokens: int = 0
    length: int = 0

    def pages(self, page_size: int) -> int:
        """Pool pages the restored block shares with its source (a partly filled last shared page is
        copied when the block holds more tokens than it shares)."""
        if self.length <= self.tokens:
            return -(-self.tokens // page_size)
        return self.tokens // page_size


def share_plan(header: SnapshotHeader, page_size: int) -> list[Shared]:
    """Per block, the earlier block it shares the longest run of leading pages with, so that a
    restore shares them again (copy-on-write) instead of holding a copy per fork: at most the source's
    length, never from a sealed source (sealed blocks cannot be forked), and only when the file's pages
    are the pool's pages (`page_size` rows)."""
    blocks = header.blocks
    plan = [Shared(length=b.length) for b in blocks]
    if header.version < 2:
        return plan
    for i, b in enumerate(blocks):
        for j in range(i):
            a = blocks[j]
            if a.sealed:
                continue
            limit, m = min(len(a.pages), len(b.pages)), 0
            while m < limit and a.pages[m] == b.pages[m]:
                m += 1
            tokens = min(b.length, a.length, m * page_size)
            if tokens > plan[i].tokens:
                plan[i] = Shared(j, tokens, b.length)
    return plan


def restore_plan(snapshot: LoadedSnapshot, page_size: int) -> list[Shared]:
    """`share_plan` for restoring into a pool of `page_size` tokens a page: no sharing when the
    file's pages have another size (each block then gets its own pages)."""
    rows = next(
        (int(snapshot.tensors[e.pages[0]].shape[2]) for e in snapshot.header.blocks if e.pages), None
    )
    if snapshot.header.version < 2 or rows != page_size:
        return [Shared(length=b.length) for b in snapshot.header.blocks]
    return share_plan(snapshot.header, page_size)


def restore_block(
    store: BlockStore,
    block: Block,
    snapshot: LoadedSnapshot,
    i: int,
    *,
    same_content: bool = False,
    kept: int = 0,
) -> None:
    """Fill a block without resident memory (new, or spilled) from entry i of a snapshot (pages
    reserved here; PoolExhaustedError if the pool cannot hold them, leaving the block as it was).
    `kept`: tokens the block already holds as they are saved (a fork of an earlier restored block,
    see share_plan); their KV is not written again. `same_content`: the block already had this
    content (a spilled block coming back), so its version stays and caches keyed on it stay valid."""
    header = snapshot.header.blocks[i]
    n = header.length
    had = len(block.pages)
    store.reserve([(block, n)])
    try:
        device = store.device
        if store.attn_slot:
            slots = store.slots(block, 0, n)
            written = 0
            for start, k, v in snapshot.kv_chunks(i):
                count = k.shape[1]
                written += count
                skip = min(count, max(0, kept - start))  # already there: shared with its source
                if skip == count:
                    continue
                rows = slots[start + skip : start + count]
                store.pool.k[:, rows] = k[:, skip:].to(device)
                if not store.pool.shared_kv:  # (MLA: the pool's v is its k)
                    store.pool.v[:, rows] = v[:, skip:].to(device)
            if written != n:
                raise KeyError(f"KV of block {i} ({written} of {n} tokens)")
        linear: list[LinearRecords | SealedRecords] = []
        for j, (kind, covers) in enumerate(zip(header.linear, header.summary_covers)):
            get = lambda name: snapshot.part(i, f"{j}.{name}").to(device)  # noqa: E731
            if kind == "sealed":
                linear.append(SealedRecords(n, *(get(name) for name in _SEALED_FIELDS)))
                continue
            rec = LinearRecords(*(_growing(get(name)) for name in ("rows", "g", "beta")))
            if covers:
                rec.summary, rec.summary_covers = get("summary"), covers
            linear.append(rec)
    except KeyError as exc:
        store.pool.release_pages(block.pages[had:])
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


def snapshot_pages(header: SnapshotHeader, page_size: int, plan: list[Shared]) -> int:
    """KV pages restoring every block of a snapshot takes, pages shared by `plan` once."""
    return sum(-(-b.length // page_size) - s.pages(page_size) for b, s in zip(header.blocks, plan))


def snapshot_bytes(store: BlockStore, snapshot: LoadedSnapshot, plan: list[Shared]) -> int:
    """Block memory restoring a snapshot takes: its KV pages and its GDN tensors."""
    pages = snapshot_pages(snapshot.header, store.page_size, plan) if store.attn_slot else 0
    linear = sum(snapshot.linear_bytes(i) for i in range(len(snapshot.header.blocks)))
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


# ---- spilling --------------------------------------------------------------------------------
def spill_block(store: BlockStore, block: Block, path: Path, identity: ModelIdentity) -> None:
    """Write a block's memory (KV and GDN records) to `path` and free it; its tokens, name, length
    and version stay, so views and caches that name it stay valid. `reload_block` brings it back."""
    capture = capture_blocks(store, [block], identity)
    write_snapshot(path, capture)
    store.pool.release_pages(block.pages)  # a fork sharing a page keeps it
    for rec in block.linear:
        rec.release()
    block.pages, block.linear = [], []
    block.spilled = path
    kv_bytes = block.length * store.kv_bytes_per_token
    block.spilled_bytes = kv_bytes + sum(t.numel() * t.element_size() for t in capture.parts.values())
    store.spilled_bytes += block.spilled_bytes


def reload_bytes(store: BlockStore, block: Block) -> tuple[int, int]:
    """(bytes, pages) reloading a spilled block takes."""
    pages = -(-block.length // store.page_size)
    linear = block.spilled_bytes - block.length * store.kv_bytes_per_token
    return pages * store.pool.bytes_per_page + linear, pages


def reload_block(store: BlockStore, block: Block, identity: ModelIdentity) -> None:
    """Bring a spilled block back exactly as it was (bit for bit) and delete its file."""
    assert block.spilled is not None
    snapshot = read_snapshot(block.spilled, identity)
    restore_block(store, block, snapshot, 0, same_content=True)
    store.spilled_bytes -= block.spilled_bytes
    block.spilled.unlink(missing_ok=True)
    block.spilled, block.spilled_bytes = None, 0
