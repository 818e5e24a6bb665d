"""One forward pass over many items, each writing its own block while reading its own view.

Step semantics (docs/runtime.md, "Semantics"): every item reads each view block as it was at the
start of the step, plus the tokens the item itself writes in this step. Block lengths are snapshotted
before the forward and committed after it, so what other items write in the same step is invisible
until the next step, and an item's result does not depend on who shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cothink.execution.cache import ExecutionCache, LastLogits, ViewKey, WriterState
from cothink.execution.linear_state import LinearState, apply_block, empty_state, run_tokens
from cothink.memory.block import Block, VisionSpan, local_positions, view_key
from cothink.memory.store import BlockStore
from cothink.models.transformer import GatedDeltaNet
from cothink.ops.rope import Rotary

if TYPE_CHECKING:  # the backends read this module's geometry
    from cothink.execution.attention_backends import ExecutionBackend, StepMetadata


@dataclass(frozen=True)
class VisionChunk:
    """The vision part of an item's tokens: which of them are image or frame-group placeholders, the
    tower's features that replace their embeddings, and the runs that begin among them."""

    runs: tuple[VisionSpan, ...]  # runs whose first placeholder is one of the item's tokens (block indices)
    rows: torch.Tensor  # [k] long: the placeholders among the item's tokens (0..n-1)
    features: torch.Tensor  # [k, hidden]: their input embeddings
    deepstack: tuple[torch.Tensor, ...] = ()  # per DeepStack layer [k, hidden], added after that layer


@dataclass
class StepItem:
    """Append `token_ids` to `block` (the last block of `view`); `logits` is 'all', 'last' or 'none'.

    `read_lengths`, if given, reads only that many tokens of each block before the writer (a view of
    an earlier state of those blocks; used to recompute the logits after a view's last token).
    `vision`, if given, makes some of the tokens image placeholders (their features, their 3-D
    positions); `span_added` is then how far the tokens move the block's span (for the context check).
    """

    block: Block
    token_ids: list[int]
    view: list[Block] | None = None
    logits: str = "all"
    read_lengths: list[int] | None = None
    vision: VisionChunk | None = None
    span_added: int | None = None  # None: one position per token

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = [self.block]

    @property
    def positions_added(self) -> int:
        """How many positions the item's tokens add to its view (the context check)."""
        return len(self.token_ids) if self.span_added is None else self.span_added


@dataclass(frozen=True)
class BatchVision:
    """A step's vision input: placeholder rows of the flattened batch and what they take (the model
    reads it through `embed` and `after_layer`; models/transformer.py CausalLM.forward)."""

    rows: torch.Tensor  # [k] long
    features: torch.Tensor  # [k, hidden]
    deepstack: tuple[torch.Tensor, ...]  # per DeepStack layer [k, hidden]

    @staticmethod
    def gather(items: list[StepItem], starts: list[int]) -> BatchVision | None:
        chunks = [(item.vision, row) for item, row in zip(items, starts) if item.vision is not None]
        if not chunks:
            return None
        rows = torch.cat([c.rows + row for c, row in chunks])
        features = torch.cat([c.features for c, _ in chunks])
        layers = min(len(c.deepstack) for c, _ in chunks)
        deepstack = tuple(torch.cat([c.deepstack[i] for c, _ in chunks]) for i in range(layers))
        return BatchVision(rows, features, deepstack)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The token embeddings x [T, hidden] with the placeholder rows replaced by the features."""
        return x.index_copy(0, self.rows.to(x.device), self.features.to(x.device, x.dtype))

    def after_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """DeepStack: decoder layer `layer`'s output plus that layer's features at the placeholders."""
        if layer >= len(self.deepstack):
            return x
        return x.index_add(0, self.rows.to(x.device), self.deepstack[layer].to(x.device, x.dtype))


@dataclass(frozen=True, slots=True)
class RunKey:
    """Identity of a key run other items may read too: a block read up to `length` tokens."""

    block_id: int
    length: int


@dataclass(frozen=True, slots=True)
class KeyRun:
    """Keys an item's queries attend to as one unit, merged with the item's other runs by LSE.

    Every block before the writer is one wholly visible run; the writer block is one run, causal
    where the item writes several tokens (its old tokens visible to all, then this step's own).
    Layer-independent, so built once per step.
    """

    slots: torch.Tensor  # [L] flat pool slots of the run's keys
    # [T, 1, rotary_dim] in the model dtype (Rotary.prepare): rotate the item's queries to positions
    # relative to the run's block
    cos: torch.Tensor
    sin: torch.Tensor
    causal: bool  # the last T of the L keys are the item's new tokens: query row t sees keys 0..L-T+t
    shared: RunKey | None  # set for a block before the writer (another item may read it); None: the writer's
    span: tuple[int, int] | None = None  # slots are exactly the range [a, b): read keys as a view, no gather


@dataclass
class ItemPlan:
    """Per-item geometry of one step, shared by every layer."""

    rows: slice  # the item's tokens in the flattened batch
    start: int  # the writer block's length at step start
    lengths: list[int]  # snapshot length of each view block (writer: start + new tokens)
    view_key: ViewKey  # identity of the view's content before this step (for the writer-state cache)
    runs: list[KeyRun] = field(default_factory=list)
    new_slots: torch.Tensor | None = None  # [n] pool slots this step's keys are written to
    new_span: tuple[int, int] | None = None  # new_slots are exactly the range [a, b)
    # the new tokens' rotation tables, at their positions in the writer block (their keys')
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class LinearDecode:
    """A Gated DeltaNet layer's buffers in a fused decode step (ViewBatch.linear_decode): the step's
    pre-conv rows [T, conv_dim], g and beta [T, HV] (float32), and per item its (state, conv tail)
    before and after its token."""

    rows: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    before: list[LinearState] = field(default_factory=list)
    after: list[LinearState] = field(default_factory=list)


Rows = torch.Tensor | slice  # row indices; a slice when they are consecutive (a view, no gather)


def row_index(rows: list[int], device: torch.device | str) -> Rows:
    """Indices of `rows` for q[...] / out[...]: a slice when consecutive, so reading them is a view
    and writing them a plain copy (decode items usually are: one row each, in order)."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)


class ViewBatch:
    """One step over blocks and views: its geometry (an ItemPlan per item, the key runs it reads,
    where its keys go), its Gated DeltaNet state and its commit; the model's ForwardContext.

    `backend` runs the step (execution/attention_backends.py): its `prepare`, called once here when
    the geometry is built, decides which path runs the step and builds what the path needs
    (`metadata`); every attention layer then goes to its `forward`. `cache` holds the writer states
    this step starts from and receives the ones it ends with (execution/cache.py).
    """

    def __init__(
        self,
        store: BlockStore,
        rotary: Rotary,
        items: list[StepItem],
        dense_min_tokens: int,
        backend: ExecutionBackend,
        cache: ExecutionCache | None = None,
    ):
        self.store, self.rotary, self.items = store, rotary, items
        self.dense_min_tokens = dense_min_tokens
        self.backend = backend
        self.cache = cache if cache is not None else ExecutionCache()
        self.scale = store.cfg.attention_scale
        self._read_slots: dict[tuple[int, int], tuple[torch.Tensor, tuple[int, int] | None]] = {}
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # `_rotation`'s
        starts = self._starts(items)
        self.plans = [self._plan(item, row) for item, row in zip(items, starts)]
        # placeholder rows and their features (None: a text-only step)
        self.vision = BatchVision.gather(items, starts)
        # [T, 1, rot] the rotation of this step's keys, row by row (None: no attention layer)
        self.key_rotation = self._key_rotation() if store.attn_slot else None
        # this step's keys go to the slots after each writer's old tokens
        self.write_slots = self._write_index() if store.attn_slot else None
        # per item, per linear slot: the state after the item's tokens (published by commit)
        self.new_states: list[dict[int, LinearState]] = [{} for _ in items]
        # per item, per linear slot: the tokens' GDN records (pre-conv rows, g, beta), appended by commit
        self.new_records: list[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            {} for _ in items
        ]
        self.metadata: StepMetadata = backend.prepare(self)

    @property
    def path(self) -> str:
        """Which code runs this step ("fused", "native", "torch", "reference"): the backend's choice."""
        return self.metadata.path

    @property
    def has_attention(self) -> bool:
        """Whether the model has attention layers (keys to store and attend)."""
        return bool(self.store.attn_slot)

    def decode_plans(self) -> list[ItemPlan]:
        """The single-token items (decoding coroutines), which backends batch; none without attention."""
        return [p for p in self.plans if p.size == 1] if self.store.attn_slot else []

    @property
    def rows(self) -> int:
        """Token rows this step computes (every item's new tokens)."""
        return sum(p.size for p in self.plans)

    @staticmethod
    def _starts(items: list[StepItem]) -> list[int]:
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += len(item.token_ids)
        return starts

    def _plan(self, item: StepItem, row: int) -> ItemPlan:
        store, n, start = self.store, len(item.token_ids), item.block.length
        before = item.read_lengths
        if before is None:  # (an image another item is writing is read only once whole)
            before = [b.readable_length for b in item.view[:-1]]
        key = view_key(item.view, [*before, start])
        plan = ItemPlan(slice(row, row + n), start, [*before, start + n], key)
        if not store.attn_slot:
            return plan
        # The writer block's new tokens sit at their local positions: text at the block's span
        # (one scalar per token, the 1-D rotary), placeholders at their 3-D positions. A query
        # reading block j is rotated to its position relative to j: local + the spans from j on.
        block = item.block
        pos3 = None
        if item.vision is not None:
            pos3 = local_positions([*block.vision, *item.vision.runs], start, start + n)
        first = block.span_at(start)
        spans = [b.span_at(length) for b, length in zip(item.view[:-1], before)]
        distance = sum(spans)
        for b, length, span in zip(item.view[:-1], before, spans):
            if length:
                cos, sin = self._table(first, distance, n, pos3)
                slots, slot_span = self._block_slots(b, length)
                run = KeyRun(slots, cos, sin, False, RunKey(b.id, length), slot_span)
                plan.runs.append(run)
            distance -= span
        cos, sin = plan.rotation = self._table(first, 0, n, pos3)  # positions in the writer block
        slots, span = store.slots_and_span(block, 0, start + n)
        plan.new_slots, plan.new_span = slots[start:], store.span(block, start, start + n)
        # the writer block, old tokens and new, is one run (queries rotated once, no merge): causal,
        # row t sees keys 0..start+t; a single new token sees the whole block
        plan.runs.append(KeyRun(slots, cos, sin, n > 1, None, span))
        return plan

    def _write_index(self) -> Rows:
        """Where this step's keys go: one slice when each writer's new slots follow the previous
        one's (always for a single writer on consecutive pages: a plain copy), else the slots."""
        spans = [p.new_span for p in self.plans]
        if all(spans) and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return slice(spans[0][0], spans[-1][1])
        return torch.cat([p.new_slots for p in self.plans])

    def _rotation(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepared rotation tables (Rotary.prepare) for positions first..first+n-1, in the pool's dtype;
        looked up once per step (coroutines decoding over a shared context all read it from the same
        positions: one pair of slices for the step rather than two per item and run)."""
        key = (first, n)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = self.rotary.prepared(range(first, first + n), self.store.dtype)
        return tables

    def _table(
        self, first: int, shift: int, n: int, pos3: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables of an item's n new tokens moved `shift` positions on: text tokens sit at
        first..first+n-1 (pos3 None: the 1-D table), others at their 3-D local positions pos3 (the
        same scalar shift on every axis)."""
        if pos3 is None:
            return self._rotation(first + shift, n)
        return self.rotary.prepared3(pos3 + shift, self.store.dtype)

    def _key_rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of this step's keys, row by row: each item's at its writer positions."""
        tables = [p.rotation for p in self.plans]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([cos for cos, _ in tables]), torch.cat([sin for _, sin in tables])

    def _block_slots(self, block: Block, length: int) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """Slots (and span) of a block read before the writer, built once per step however many
        items read it (decoding coroutines sharing a context)."""
        key = (block.id, length)
        found = self._read_slots.get(key)
        if found is None:
            found = self._read_slots[key] = self.store.slots_and_span(block, 0, length)
        return found

    # ---- full attention --------------------------------------------------------------------
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.metadata)

    # ---- Gated DeltaNet ---------------------------------------------------------------------
    def linear_attention(
        self, layer: int, mixer: GatedDeltaNet, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        slot = self.store.linear_slot[layer]
        out = torch.empty(
            rows.shape[0], mixer.cfg.num_v_heads, mixer.cfg.v_dim, dtype=torch.float32, device=rows.device
        )
        for i, (item, plan) in enumerate(zip(self.items, self.plans)):
            before = self._state_before(item, plan, slot, mixer, rows.dtype, rows.device)
            r = plan.rows
            out[r], state = run_tokens(mixer, before.tail, rows[r], g[r], beta[r], before.state)
            w = mixer.cfg.conv_kernel - 1
            tail = torch.cat((before.tail, rows[r]), dim=0)[-w:] if w else before.tail
            self.new_states[i][slot] = LinearState(state, tail)
            self.new_records[i][slot] = (rows[r], g[r], beta[r])
        return out

    def linear_decode(self, layer: int, mixer: GatedDeltaNet, dtype: torch.dtype) -> LinearDecode:
        """A Gated DeltaNet layer of a fused decode step (execution/fused_decode.py; every item one
        token): each item's state before its token, and empty buffers for what the step makes of it,
        recorded as `linear_attention` records its results. The fused kernel fills them before
        `commit` reads them."""
        assert all(p.size == 1 for p in self.plans)  # item i is row i
        slot, g = self.store.linear_slot[layer], mixer.cfg
        rows = torch.empty(len(self.items), g.conv_dim, dtype=dtype)
        decay, beta = torch.empty(2, len(self.items), g.num_v_heads)
        step = LinearDecode(rows, decay, beta)
        for i, (item, plan) in enumerate(zip(self.items, self.plans)):
            before = self._state_before(item, plan, slot, mixer, dtype, rows.device)
            # the kernel reads both whole, as laid out row by row
            step.before.append(LinearState(before.state.contiguous(), before.tail.contiguous()))
            after = LinearState(torch.empty(before.state.shape), torch.empty(before.tail.shape, dtype=dtype))
            step.after.append(after)
            self.new_states[i][slot] = after
            self.new_records[i][slot] = (rows[i : i + 1], decay[i : i + 1], beta[i : i + 1])
        return step

    def _state_before(
        self, item: StepItem, plan: ItemPlan, slot: int, mixer: GatedDeltaNet, dtype, device
    ) -> LinearState:
        cached = self.cache.writer_state(item.block, plan.view_key)
        if cached is not None:
            return cached.layers[slot]
        state = empty_state(mixer, dtype, device)
        for block, length in zip(item.view, plan.lengths[:-1] + [plan.start]):
            if length:
                state = apply_block(mixer, block.linear[slot], length, state, self.dense_min_tokens)
        return state

    def commit(self, keep: list[bool] | None = None) -> None:
        """Publish the step: lengths grow and each writer's GDN state is cached for its next step.

        Items with keep[i] False are dropped instead (`undo`): their blocks stay as they were."""
        for i, (item, plan, states) in enumerate(zip(self.items, self.plans, self.new_states)):
            if keep is not None and not keep[i]:
                undo(self.store, item)
                continue
            for slot, (rows, g, beta) in sorted(self.new_records[i].items()):
                rec = item.block.linear[slot]
                rec.rows.append(rows)
                rec.g.append(g)
                rec.beta.append(beta)
            item.block.length = plan.start + len(item.token_ids)
            item.block.tokens.extend(item.token_ids)
            if item.vision is not None:
                item.block.vision.extend(item.vision.runs)
            if states:
                layers = [states[s] for s in range(len(states))]
                self.cache.set_writer_state(item.block, WriterState(self.key_after(i), layers))

    def remember_logits(self, logits: list[torch.Tensor], keep: list[bool] | None = None) -> None:
        """Cache each kept item's logits after its last token (call after commit)."""
        self.cache.set_step_logits(
            [
                (item.block, LastLogits(self.key_after(i), rows[-1]))
                for i, (item, rows) in enumerate(zip(self.items, logits))
                if len(rows) and (keep is None or keep[i])
            ]
        )

    def key_after(self, i: int) -> ViewKey:
        """The view key of item i once the step is committed."""
        block = self.items[i].block
        return self.plans[i].view_key[:-1] + ((block.id, block.version, block.length),)

    def logit_rows(self) -> torch.Tensor:
        rows: list[int] = []
        for item, plan in zip(self.items, self.plans):
            if item.logits == "all":
                rows.extend(range(plan.rows.start, plan.rows.stop))
            elif item.logits == "last":
                rows.append(plan.rows.stop - 1)
        return torch.tensor(rows, dtype=torch.long)


def undo(store: BlockStore, item: StepItem) -> None:
    """Drop what an uncommitted step appended for `item`: GDN records past the block's committed
    length and pages reserved beyond it (keys written into those slots are never read)."""
    for rec in item.block.linear:
        rec.truncate(item.block.length)
    store.unreserve(item.block)
