"""One forward pass over many items, each writing its own block while reading its own view.

Step semantics (BRIEF §2): every item reads each view block as it was at the start of the step,
plus the tokens the item itself writes in this step. Block lengths are snapshotted before the
forward and committed after it, so what other items write in the same step is invisible until the
next step, and an item's result does not depend on who shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cothink.execution.linear_state import apply_block, empty_state, run_tokens
from cothink.memory.block import Block, view_key
from cothink.memory.store import BlockStore
from cothink.models.attention import merge_grouped, merge_partials, padded_attention, partial_attention
from cothink.models.rope import Rotary
from cothink.models.transformer import GatedDeltaNet


@dataclass
class StepItem:
    """Append `token_ids` to `block` (the last block of `view`); `logits` is 'all', 'last' or 'none'.

    `read_lengths`, if given, reads only that many tokens of each block before the writer (a view of
    an earlier state of those blocks; used to recompute the logits after a view's last token).
    """

    block: Block
    token_ids: list[int]
    view: list[Block] | None = None
    logits: str = "all"
    read_lengths: list[int] | None = None

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = [self.block]


@dataclass
class _Plan:
    """Per-item geometry of one step, shared by every layer."""

    rows: slice  # the item's tokens in the flattened batch
    start: int  # the writer block's length at step start
    lengths: list[int]  # snapshot length of each view block (writer: start + new tokens)
    # Key runs the item attends to: (pool slots, cos, sin, causal). cos/sin rotate the item's queries
    # to their positions relative to the run's block. Every block before the writer is one wholly
    # visible run; the writer block is its old tokens (visible) plus this step's tokens (causal).
    # Layer-independent, so built once per step.
    # The fifth element names a run another item may read too: (block id, length); None for the writer's.
    runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, tuple | None]] = field(
        default_factory=list
    )
    view_key: tuple = ()  # identity of the view's content before this step (for the GDN state cache)


@dataclass
class _SharedRun:
    """A key run several decode items read (a shared block): its keys are gathered once per layer."""

    slots: torch.Tensor  # [L]
    rows: torch.Tensor  # [k] the readers' query rows
    owner: torch.Tensor  # [k] the readers' decode-item indices
    cos: torch.Tensor  # [k, rotary_dim]: each reader's own position relative to the block
    sin: torch.Tensor


@dataclass
class _DecodeRuns:
    """Every key run of the step's single-token items, batched (layer-independent).

    Runs read by several items are attended once per run with all readers' queries; the rest
    (mostly each item's own block) are padded into one batch.
    """

    items: torch.Tensor  # [D] the decode items' rows in the flattened batch
    shared: list[_SharedRun]
    rows: torch.Tensor  # [R] the query row of each padded run
    owner: torch.Tensor  # [R] which decode item (0..D-1) each padded run belongs to
    slots: torch.Tensor  # [R, Lmax] pool slots, padded with slot 0
    valid: torch.Tensor  # [R, Lmax]
    cos: torch.Tensor  # [R, rotary_dim]
    sin: torch.Tensor

    @classmethod
    def build(cls, plans: list[_Plan], device) -> _DecodeRuns:
        readers: dict[tuple, list] = {}
        for d, p in enumerate(plans):
            for run in p.runs:
                if run[4] is not None:
                    readers.setdefault(run[4], []).append((p.rows.start, d, run))
        shared = [
            _SharedRun(
                slots=group[0][2][0],
                rows=torch.tensor([row for row, _, _ in group], device=device),
                owner=torch.tensor([d for _, d, _ in group], device=device),
                cos=torch.cat([r[1] for _, _, r in group]),
                sin=torch.cat([r[2] for _, _, r in group]),
            )
            for group in readers.values()
            if len(group) > 1
        ]
        shared_keys = {key for key, group in readers.items() if len(group) > 1}
        runs = [(p.rows.start, d, r) for d, p in enumerate(plans) for r in p.runs if r[4] not in shared_keys]
        width = max((r[0].numel() for _, _, r in runs), default=0)
        slots = torch.zeros(len(runs), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(runs), width, dtype=torch.bool, device=device)
        for i, (_, _, run) in enumerate(runs):
            slots[i, : run[0].numel()] = run[0]
            valid[i, : run[0].numel()] = True
        return cls(
            items=torch.tensor([p.rows.start for p in plans], device=device),
            shared=shared,
            rows=torch.tensor([row for row, _, _ in runs], dtype=torch.long, device=device),
            owner=torch.tensor([d for _, d, _ in runs], dtype=torch.long, device=device),
            slots=slots,
            valid=valid,
            cos=torch.cat([r[1] for _, _, r in runs]),
            sin=torch.cat([r[2] for _, _, r in runs]),
        )


class ViewBatch:
    """Implements the model's ForwardContext for one step over blocks and views."""

    def __init__(self, store: BlockStore, rotary: Rotary, items: list[StepItem], dense_min_tokens: int):
        self.store, self.rotary, self.items = store, rotary, items
        self.dense_min_tokens = dense_min_tokens
        self.scale = store.cfg.head_dim**-0.5
        self.plans: list[_Plan] = []
        local, writes = [], []
        row = 0
        for item in items:
            n, start = len(item.token_ids), item.block.length
            before = (
                item.read_lengths if item.read_lengths is not None else [b.length for b in item.view[:-1]]
            )
            lengths = [*before, start + n]
            offsets = [0]
            for span in before:  # text tokens: a block's position span is its length
                offsets.append(offsets[-1] + span)
            plan = _Plan(slice(row, row + n), start, lengths)
            plan.view_key = view_key(item.view, [*before, start])
            if store.attn_slot:
                writer_pos = offsets[-1] + torch.arange(start, start + n, device=store.device)
                for j, (block, length, offset) in enumerate(zip(item.view, lengths, offsets)):
                    cos, sin = rotary.cos_sin(writer_pos - offset)  # positions relative to block j
                    slots = store.slots(block, 0, length)
                    if j < len(offsets) - 1 and length:
                        plan.runs.append((slots, cos, sin, False, (block.id, length)))
                if n == 1:  # a single new token sees its whole block: one run
                    plan.runs.append((slots, cos, sin, False, None))
                else:
                    if start:
                        plan.runs.append((slots[:start], cos, sin, False, None))
                    plan.runs.append((slots[start:], cos, sin, True, None))
                writes.append(slots[start:])
            local.append(torch.arange(start, start + n))
            self.plans.append(plan)
            row += n
        self.key_rotation = rotary.cos_sin(torch.cat(local).to(store.device))
        self.write_slots = torch.cat(writes) if writes else None
        # Several single-token items (decoding coroutines) attend in one padded batch instead of a
        # Python loop over items and blocks; prefill chunks keep the per-item flash path.
        decode = [p for p in self.plans if p.rows.stop - p.rows.start == 1] if store.attn_slot else []
        self.decode = _DecodeRuns.build(decode, store.device) if len(decode) > 1 else None
        batched = {id(p) for p in decode} if self.decode is not None else set()
        self.looped = [p for p in self.plans if id(p) not in batched]
        self.new_states: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in items]

    # ---- full attention --------------------------------------------------------------------
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slot = self.store.attn_slot[layer]
        pool = self.store.pool
        pool.k[slot, self.write_slots] = self.rotary.apply(k, *self.key_rotation)
        pool.v[slot, self.write_slots] = v
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if self.decode is not None:
            d = self.decode
            outs, lses, owners = [], [], []
            for run in d.shared:
                o, lse = partial_attention(
                    self.rotary.apply(q[run.rows], run.cos, run.sin),
                    pool.k[slot, run.slots],
                    pool.v[slot, run.slots],
                    self.scale,
                )
                outs.append(o)
                lses.append(lse)
                owners.append(run.owner)
            if d.rows.numel():
                o, lse = padded_attention(
                    self.rotary.apply(q[d.rows], d.cos, d.sin),
                    pool.k[slot, d.slots],
                    pool.v[slot, d.slots],
                    d.valid,
                    self.scale,
                )
                outs.append(o)
                lses.append(lse)
                owners.append(d.owner)
            out[d.items] = merge_grouped(torch.cat(outs), torch.cat(lses), torch.cat(owners), d.items.numel())
        for plan in self.looped:
            q_item = q[plan.rows]
            outs, lses = [], []
            for slots, cos, sin, causal, _ in plan.runs:
                keys, values = pool.k[slot, slots], pool.v[slot, slots]
                o, lse = partial_attention(
                    self.rotary.apply(q_item, cos, sin), keys, values, self.scale, causal
                )
                outs.append(o)
                lses.append(lse)
            out[plan.rows] = merge_partials(outs, lses)
        return out

    # ---- Gated DeltaNet ---------------------------------------------------------------------
    def linear_attention(
        self, layer: int, mixer: GatedDeltaNet, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        slot = self.store.linear_slot[layer]
        out = torch.empty(
            rows.shape[0], mixer.cfg.num_v_heads, mixer.cfg.v_dim, dtype=torch.float32, device=rows.device
        )
        for i, (item, plan) in enumerate(zip(self.items, self.plans)):
            state, tail = self._state_before(item, plan, slot, mixer, rows.dtype, rows.device)
            r = plan.rows
            out[r], state = run_tokens(mixer, tail, rows[r], g[r], beta[r], state)
            w = mixer.cfg.conv_kernel - 1
            self.new_states[i][slot] = (state, torch.cat((tail, rows[r]), dim=0)[-w:] if w else tail)
            rec = item.block.linear[slot]
            rec.rows.append(rows[r])
            rec.g.append(g[r])
            rec.beta.append(beta[r])
        return out

    def _state_before(self, item: StepItem, plan: _Plan, slot: int, mixer: GatedDeltaNet, dtype, device):
        cached = item.block.writer_state
        if cached is not None and cached[0] == plan.view_key:
            return cached[1][slot]
        state, tail = empty_state(mixer, dtype, device)
        for block, length in zip(item.view, plan.lengths[:-1] + [plan.start]):
            if length:
                state, tail = apply_block(
                    mixer, block.linear[slot], length, state, tail, self.dense_min_tokens
                )
        return state, tail

    def commit(self) -> None:
        """Publish the step: lengths grow and each writer remembers its GDN state for the next step."""
        for i, (item, plan, states) in enumerate(zip(self.items, self.plans, self.new_states)):
            item.block.length = plan.start + len(item.token_ids)
            item.block.tokens.extend(item.token_ids)
            if states:
                item.block.writer_state = (self.key_after(i), [states[s] for s in range(len(states))])

    def key_after(self, i: int) -> tuple:
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
