"""ModelRunner: the synchronous, exact core. Blocks in, logits out.

`load_model` returns one. The engine (cothink.runtime) drives `step` with many items per forward;
`extend` is the single-item convenience the issue's public API names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cothink.errors import EmptyInputError, InputTooLongError, InvalidViewError
from cothink.execution.step import StepItem, ViewBatch
from cothink.memory.block import Block
from cothink.memory.store import BlockStore
from cothink.models.config import ModelConfig, load_config
from cothink.models.rope import Rotary
from cothink.models.transformer import CausalLM
from cothink.models.weights import load_weights

_LOGITS_MODES = ("all", "last", "none")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any,
        *,
        kv_tokens: int = 32768,
        page_size: int = 16,
        max_context: int | None = None,
        dense_summary_min_tokens: int | None = None,
    ):
        cfg = model.config
        self.model, self.config, self.tokenizer = model, cfg, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.rotary = Rotary(cfg.hf_text_config, cfg.head_dim, self.device)
        self.store = BlockStore(cfg, kv_tokens, page_size, self.dtype, self.device)
        self.max_context = (
            max_context or getattr(cfg.hf_text_config, "max_position_embeddings", None) or 1 << 20
        )
        # A dense [B|A] summary pays off once replaying the body costs more than applying a K x K map.
        if dense_summary_min_tokens is None:
            dense_summary_min_tokens = 4 * cfg.gdn.k_dim if cfg.gdn else 0
        self.dense_summary_min_tokens = dense_summary_min_tokens

    # ---- blocks -------------------------------------------------------------------------------
    def new_block(self, name: str | None = None) -> Block:
        block = self.store.new_block(name)
        block.owner = self
        return block

    def free(self, block: Block) -> None:
        self.store.free(block)

    def fork(self, block: Block, name: str | None = None) -> Block:
        child = self.store.fork(block, name)
        child.owner = self
        return child

    def truncate(self, block: Block, n: int) -> None:
        self.store.truncate(block, n)

    # ---- forward ------------------------------------------------------------------------------
    def extend(
        self, block: Block, token_ids: list[int], view: list[Block] | None = None, *, logits: str = "all"
    ) -> torch.Tensor:
        """Append tokens to `block`, attending causally to `view` (which must end with `block`).

        Returns float32 logits [len(token_ids), vocab] ('all'), [1, vocab] ('last') or [0, vocab] ('none').
        """
        return self.step([StepItem(block, list(token_ids), view, logits)])[0]

    def check_token_ids(self, ids: list[int], what: str = "token ids") -> None:
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"{what} must be ints in [0, {vocab})")

    def _check_view(self, view: list[Block], new_tokens: int, read_lengths: list[int] | None = None) -> None:
        """Blocks live and distinct, and the view (read up to `read_lengths` before its last block)
        plus the new tokens within the context."""
        for b in view:
            self.store.check(b)
        if len({b.id for b in view}) != len(view):
            raise InvalidViewError("a block appears twice in the view")
        spans = [b.position_span for b in view]
        if read_lengths is not None:
            if len(read_lengths) != len(spans) - 1 or any(
                not 0 <= n <= s for n, s in zip(read_lengths, spans)
            ):
                raise InvalidViewError(
                    "read_lengths must give, for each block before the writer, 0..len(block)"
                )
            spans[:-1] = read_lengths
        total = sum(spans) + new_tokens
        if total > self.max_context:
            raise InputTooLongError(f"view would span {total} positions; the model allows {self.max_context}")

    def validate_input(self, view: list[Block], token_ids: list[int]) -> None:
        """Check that `token_ids` can be appended after `view` (blocks live, distinct, within context)."""
        self._check_view(view, len(token_ids))

    def validate(self, item: StepItem) -> None:
        """Raise a typed error, changing nothing, unless the item can run."""
        if item.logits not in _LOGITS_MODES:
            raise ValueError(f"logits must be one of {_LOGITS_MODES}, got {item.logits!r}")
        self.store.check(item.block)
        if not item.view or item.view[-1] is not item.block:
            raise InvalidViewError(f"the view must end with the written block {item.block.name!r}")
        self._check_view(item.view, len(item.token_ids), item.read_lengths)
        if not item.token_ids:
            raise EmptyInputError(f"no tokens to append to block {item.block.name!r}")
        self.check_token_ids(item.token_ids)

    def step(self, items: list[StepItem]) -> list[torch.Tensor]:
        """One forward pass over all items; returns each item's logits (see `extend`)."""
        for item in items:
            self.validate(item)
        if len({item.block.id for item in items}) != len(items):
            raise InvalidViewError("two items in one step write the same block")
        self.store.reserve([(item.block, item.block.length + len(item.token_ids)) for item in items])
        try:
            batch = ViewBatch(self.store, self.rotary, items, self.dense_summary_min_tokens)
            ids = [t for item in items for t in item.token_ids]
            with torch.inference_mode():
                logits = self.model(
                    torch.tensor(ids, device=self.device), batch, batch.logit_rows().to(self.device)
                )
        except BaseException:
            # Undo the failed step: lengths were not committed; drop appended GDN records and pages.
            for item in items:
                for rec in item.block.linear:
                    rec.truncate(item.block.length)
                self.store.unreserve(item.block)
            raise
        batch.commit()
        out, row = [], 0
        for i, item in enumerate(items):
            n = {"all": len(item.token_ids), "last": 1, "none": 0}[item.logits]
            out.append(logits[row : row + n])
            row += n
            if n:
                item.block.last_logits = (batch.key_after(i), out[-1][-1].clone())
        return out


def load_model(
    path_or_name: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **limits: Any,
) -> ModelRunner:
    """Load a local Hugging Face folder (or the embedded name 'smollm2') as a ModelRunner.

    `limits` go to ModelRunner: kv_tokens (pool size), page_size, max_context, dense_summary_min_tokens.
    """
    from transformers import AutoTokenizer

    from cothink.models.hub import resolve_model_path

    folder = resolve_model_path(path_or_name)
    cfg: ModelConfig = load_config(folder)
    model = load_weights(cfg, folder, dtype, device)
    has_tokenizer = any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True) if has_tokenizer else None
    return ModelRunner(model, tokenizer, **limits)
