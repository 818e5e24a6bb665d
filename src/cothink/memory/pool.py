"""A paged pool for attention KV: fixed-size pages, reference counted so forks can share them."""

from __future__ import annotations

import torch

from cothink.errors import PoolExhaustedError


class KVPool:
    """K and V for every attention layer, stored as flat token slots grouped in pages.

    `k[layer]` has shape [num_pages * page_size, kv_heads, head_dim] (`v` too; with `shared_kv` it is
    `k` itself: one latent row per token, MLA); a block's token i lives at slot
    page * page_size + i % page_size with page = block.pages[i // page_size].
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        shared_kv: bool = False,
    ):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        # empty, not zeros: untouched pages cost no resident memory until written
        self.k = torch.empty(shape, dtype=dtype, device=device)
        # shared_kv: v is k (MLA's latent is both key and value; it is stored once)
        self.shared_kv = shared_kv
        self.v = self.k if shared_kv else torch.empty(shape, dtype=dtype, device=device)
        self.refcount = [0] * num_pages
        # LIFO: recently freed pages are reused first, so memory stays warm and small in long runs
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def bytes_per_page(self) -> int:
        layers, _, kv_heads, head_dim = self.k.shape  # (a model without attention layers has none)
        tensors = 1 if self.shared_kv else 2
        return tensors * layers * self.page_size * kv_heads * head_dim * self.k.element_size()

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhaustedError(
                f"KV pool exhausted: need {count} pages, {len(self._free)} of {self.num_pages} free "
                f"(page size {self.page_size} tokens)"
            )
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def retain(self, page: int) -> None:
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def release_pages(self, pages: list[int]) -> None:
        """Release a block's pages, last first: the next allocation of as many pages takes them back in
        their order, so a run of consecutive pages stays one slot range (read as a view, not gathered)."""
        for page in reversed(pages):
            self.release(page)

    def copy_page(self, src: int, dst: int) -> None:
        s = slice(src * self.page_size, (src + 1) * self.page_size)
        d = slice(dst * self.page_size, (dst + 1) * self.page_size)
        self.k[:, d] = self.k[:, s]
        if not self.shared_kv:
            self.v[:, d] = self.v[:, s]
