"""Gated DeltaNet records: copy-on-write sharing between forks and byte accounting (counted once)."""

from __future__ import annotations

import pytest
import torch
from support import tiny_folder

from cothink.memory.block import GrowingTensor
from cothink.memory.store import BlockStore, parse_bytes
from cothink.models.config import load_config


def _rows(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).repeat(3, 1).t().contiguous()


def test_share_copies_nothing_until_a_divergent_append():
    parent = GrowingTensor((3,), torch.float32, "cpu")
    parent.append(_rows(0, 10))
    child = parent.share(6)
    assert child.storage_key() == parent.storage_key() and child.length == 6
    assert torch.equal(child.data, parent.data[:6])

    # the parent appends past everything the child reads: no copy, one buffer still
    parent.append(_rows(10, 2))
    assert child.storage_key() == parent.storage_key()
    assert torch.equal(child.data, _rows(0, 6))

    # the child's first append would overwrite rows 6.. the parent reads: it copies first
    assert child.diverges_on_append()
    child.append(_rows(100, 3))
    assert child.storage_key() != parent.storage_key() and not child.shared and not parent.shared
    assert torch.equal(parent.data, _rows(0, 12))
    assert torch.equal(child.data, torch.cat((_rows(0, 6), _rows(100, 3))))


def test_truncated_sharer_copies_before_overwriting_rows_another_reads():
    parent = GrowingTensor((3,), torch.float32, "cpu")
    parent.append(_rows(0, 8))
    child = parent.share()
    parent.truncate(4)
    parent.append(_rows(50, 1))  # row 4 is read by the child: the parent copies
    assert torch.equal(child.data, _rows(0, 8))
    assert torch.equal(parent.data, torch.cat((_rows(0, 4), _rows(50, 1))))


def test_release_leaves_the_buffer_to_the_other_sharer():
    parent = GrowingTensor((3,), torch.float32, "cpu")
    parent.append(_rows(0, 8))
    child = parent.share(8)
    parent.release()
    assert not child.shared and not child.diverges_on_append()
    child.append(_rows(8, 1))  # sole user now: appends in place
    assert torch.equal(child.data, _rows(0, 9))


@pytest.fixture
def store() -> BlockStore:
    return BlockStore(load_config(tiny_folder("qwen35")), kv_tokens=256, page_size=4, dtype=torch.float32,
                      device="cpu")


def _grow(store: BlockStore, block, n: int) -> None:
    """Append n tokens of records and KV slots, as a committed step would."""
    g = store.cfg.gdn
    store.reserve([(block, block.length + n)])
    for rec in block.linear:
        rec.rows.append(torch.randn(n, g.conv_dim))
        rec.g.append(torch.randn(n, g.num_v_heads))
        rec.beta.append(torch.rand(n, g.num_v_heads))
    block.tokens.extend([0] * n)
    block.length += n


def test_linear_bytes_per_token_matches_the_records(store):
    g = store.cfg.gdn
    # per linear layer: the pre-conv row (fp32 here) and g, beta (fp32, one per value head)
    assert store.linear_bytes_per_token == len(store.linear_slot) * (g.conv_dim * 4 + 2 * g.num_v_heads * 4)
    cfg = store.cfg
    assert store.kv_bytes_per_token == 2 * len(store.attn_slot) * cfg.num_kv_heads * cfg.head_dim * 4
    block = store.new_block()
    _grow(store, block, 10)
    stats = store.stats()
    assert stats.linear_bytes_used == stats.linear_bytes == 10 * store.linear_bytes_per_token
    assert stats.kv_bytes_used == 3 * stats.page_bytes  # 10 tokens in pages of 4
    assert stats.total_bytes_used == stats.kv_bytes_used + stats.linear_bytes_used


def test_fork_shares_gdn_records_and_copies_at_the_first_divergent_append(store):
    per = store.linear_bytes_per_token
    parent = store.new_block("parent")
    _grow(store, parent, 10)
    child = store.fork(parent)
    assert store.linear_bytes() == 10 * per  # counted once: nothing was copied
    _grow(store, parent, 2)  # past what the child reads: still shared
    assert store.linear_bytes() == 12 * per
    _grow(store, child, 1)  # divergent: the child copies its 10 rows and appends one
    assert store.linear_bytes() == 12 * per + 11 * per
    for p_rec, c_rec in zip(parent.linear, child.linear):
        assert torch.equal(p_rec.rows.data[:10], c_rec.rows.data[:10])
        assert not torch.equal(p_rec.rows.data[10:11], c_rec.rows.data[10:11])
    store.free(parent)
    assert store.linear_bytes() == 11 * per


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(4096) == 4096 and parse_bytes("4096") == 4096 and parse_bytes(None) is None
    for bad in ("lots", "-1GiB", 0, "2XB", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)
