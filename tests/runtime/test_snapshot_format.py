"""The snapshot file format: memory several blocks share is stored once and shared again on restore,
every tensor is checked against its content name, files of the previous version still load exactly,
and a version this reader does not know is refused with a typed error naming it."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import save_file
from support import ids, logits_after, make_engine

from cothink.errors import SnapshotError
from cothink.memory.snapshot import FORMAT, read_snapshot

PAGE = 16


async def _forks(engine):
    base = engine.block("base")
    await engine.extend(base, token_ids=ids(6 * PAGE + 5, 1))  # 7 pages, the last partly filled
    forks = [engine.fork(base, f"fork{i}") for i in range(6)]
    await engine.extend(forks[0], token_ids=ids(2 * PAGE, 2))  # copies the tail page, adds its own
    forks[1].truncate(3 * PAGE)
    return [base, *forks]


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
async def test_shared_memory_is_stored_once_and_shared_again_on_restore(tmp_path, kind):
    path = tmp_path / "snap.safetensors"
    engine = make_engine(kind, page_size=PAGE)
    async with engine:
        blocks = await _forks(engine)
        in_pool = engine.memory().used_pages
        size = await engine.save(path, blocks)
        assert size == path.stat().st_size
        before = [logits_after(engine, [b], 5) for b in blocks]
    snap = read_snapshot(path)
    kv_pages = {p for b in snap.header.blocks for p in b.pages}
    assert len(kv_pages) == in_pool  # each pool page once, however many blocks read it
    fresh = make_engine(kind, page_size=PAGE)
    async with fresh:
        restored = fresh.load(path)
        assert [b.name for b in restored] == [b.name for b in blocks]
        assert fresh.memory().used_pages == in_pool  # the forks share their pages again
        for b, old, want in zip(restored, blocks, before):
            assert b.tokens == old.tokens
            assert torch.equal(logits_after(fresh, [b], 5), want)  # bit for bit in fp32
        await fresh.extend(restored[2], token_ids=[3, 4])  # a shared page is copied, not overwritten
        assert torch.equal(logits_after(fresh, [restored[0]], 5), before[0])


async def test_damaged_files_are_refused_and_nothing_is_loaded(tmp_path):
    path = tmp_path / "snap.safetensors"
    engine = make_engine("llama", page_size=PAGE)
    async with engine:
        await engine.save(path, (await _forks(engine))[:2])
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 400, len(data) - 200):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    fresh = make_engine("llama", page_size=PAGE)
    async with fresh:
        with pytest.raises(SnapshotError, match="damaged"):
            fresh.load(path)
        assert fresh.memory().used_pages == 0


async def test_version_1_files_load_exactly_and_unknown_versions_are_refused(tmp_path):
    path, old, future = (tmp_path / n for n in ("v2.safetensors", "v1.safetensors", "v9.safetensors"))
    engine = make_engine("qwen35", page_size=PAGE)
    async with engine:
        blocks = await _forks(engine)
        await engine.save(path, blocks)
        before = [logits_after(engine, [b], 5) for b in blocks]
    snap = read_snapshot(path)
    # the previous layout: one k and one v per block, records by "<block>.<layer>.<part>", no checksums
    tensors = {}
    for i, entry in enumerate(snap.header.blocks):
        chunks = list(snap.kv_chunks(i))
        tensors[f"{i}.k"] = torch.cat([k for _, k, _ in chunks], dim=1).contiguous()
        tensors[f"{i}.v"] = torch.cat([v for _, _, v in chunks], dim=1).contiguous()
        for role in entry.tensors:
            tensors[f"{i}.{role}"] = snap.part(i, role).clone()
    header = asdict(snap.header)
    header["version"] = 1
    for b in header["blocks"]:
        del b["pages"], b["tensors"]
    save_file(tensors, str(old), metadata={"cothink": json.dumps(header)})
    header["version"] = 9
    for b in header["blocks"]:
        b["a_field_of_a_later_version"] = [0]
    save_file(tensors, str(future), metadata={"cothink": json.dumps(header)})

    fresh = make_engine("qwen35", page_size=PAGE)
    async with fresh:
        restored = fresh.load(old)
        for b, want in zip(restored, before):
            assert torch.equal(logits_after(fresh, [b], 5), want)
        with pytest.raises(SnapshotError, match=f"{FORMAT} v9.*reads {FORMAT} v1, v2"):
            fresh.load(future)
