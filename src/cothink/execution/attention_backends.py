"""The execution backend seam: which code runs a step.

A runner picks one backend at construction (`ModelRunner(..., attention_backend=...)`, `select_backend`)
and calls its `attach(model)` once. Then, per step:

    ViewBatch(...)                         the step's geometry (execution/step.py: items, key runs, slots)
      -> backend.prepare(batch)            once: decides the step's path, builds its tables -> metadata
      -> model(ids, batch, rows, metadata.layers, ..., metadata.to_logits)
           per attention layer: batch.attention(layer, q, k, v) -> backend.forward(layer, q, k, v, metadata)
           (or, where metadata.layers is set, every decoder layer in that one call; where
           metadata.to_logits is set and every row wants logits, the final norm and lm_head too)
      -> sample, batch.commit()

A step (execution/step.py) gives each item the key runs its view exposes (each block before the
writer, then the writer block: causal where the item writes several tokens, its old tokens seen by
every row and this step's own by the rows after them). The backend stores the
step's keys, attends each item's queries over its runs and merges the partials by their log-sum-exp.

- "torch" (`TorchBackend`): the CPU flash kernel per run (math fallback off CPU), one padded batch
  for the runs of decode items, the LSE merges of cothink.ops.attention; plain torch modules.
- "reference" (`ReferenceBackend`): the plain, slow math (float64 scores, per-run loops, explicit
  merges); tests check the fast paths against it.
- "native" (`NativeBackend`): cothink's C kernels (cothink/ops/native.py). The model's modules are
  replaced by native ones (execution/native_modules.py); the step's keys are rotated and stored in
  one call per layer; single-token items whose step reads at most NATIVE_DECODE_MAX_KEYS keys attend
  in one call (the query rotated per run, one softmax over the runs); and a step the per-module path
  would run wholly in the C kernels runs all its decoder layers in one call (execution/fused_decode.py).
- "auto": "native" on a CPU where the kernels build, else "torch".

Each step's path ("fused", "native", "torch", "reference") is decided in `prepare` and recorded in
the step timeline (scheduler/accounting.py StepRecord.path).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cothink.errors import InvalidParameterError
from cothink.execution.fused_decode import FusedDecode, FusedStep, LinearDecoder
from cothink.execution.native_modules import use_native_modules, use_torch_modules
from cothink.execution.step import ItemPlan, KeyRun, Rows, RunKey, ViewBatch, row_index
from cothink.models.transformer import CausalLM, DecoderLayers
from cothink.ops import native
from cothink.ops.attention import (
    merge_grouped,
    merge_partials,
    padded_attention,
    partial_attention,
    reference_merge,
    reference_partial_attention,
)
from cothink.ops.rope import Rotary

BACKEND_NAMES = ("auto", "torch", "native", "reference")

# Keys (per query head, summed over a step's decode items) up to which the native decode attention
# runs a step's decode items. Measured with `bench/decode_attention.py` (whole SmolLM2 decode steps of
# N <= 8 items sharing a context, 2-core AMD EPYC Zen 3): the native step 2.0-4.9x faster than the
# torch kernels up to 16,416 keys; without the fused step around it, even at 32,832 keys and 0.74-0.78x
# at 65,664 (the torch path reads a shared run once for all its readers, the kernel once per reader).
# With bfloat16 pools where the CPU has AVX-512 BF16 the kernel too reads a long shared run once per
# group of readers (native.DecodePlan, SHARED_MIN_KEYS), and the limits count the keys it reads: on a
# 2-core AMD EPYC Zen 4 (the same bench) native 1.68x torch at 32 x 2048 keys (68.7 / 115.2 ms a step;
# reading the run per reader it took 85.7), 1.75x at 16 x 4096, 1.46x at 32 x 4096.
NATIVE_DECODE_MAX_KEYS = 16384
# Above that, the native decode attention still runs a step whose keys are read by few items each:
# reads over distinct keys (a shared run counted once) up to this. The torch kernels' advantage is
# reading a shared run once for all its readers; on private contexts they gather and widen every key.
# Measured (`bench/decode_attention.py --private`, SmolLM2 bfloat16, 2-vCPU Intel Xeon with AMX): N
# coroutines on contexts of their own, the native step 4.1-4.9x faster at 4-8k keys, 12.8-17.8x at
# 16-33k (32 x 1024 keys: 139 vs 2 471 ms a step); on one shared context, 1.3-1.8x at 8-33k keys.
NATIVE_DECODE_MAX_SHARING = 2.0


def _distinct_keys(plans: list[ItemPlan]) -> int:
    """Keys of the step's decode items, each shared run (a block others may read) counted once."""
    shared = {run.shared: run.slots.numel() for p in plans for run in p.runs if run.shared is not None}
    own = sum(run.slots.numel() for p in plans for run in p.runs if run.shared is None)
    return own + sum(shared.values())


@dataclass(kw_only=True)
class StepMetadata:
    """What a backend's `prepare` built for one step; its `forward` reads it in every layer."""

    path: str  # which code runs the step: "fused", "native", "torch" or "reference"
    # the step's geometry, held weakly: the batch holds this (ViewBatch.metadata), and a reference back
    # would make every step's plans a cycle that only the garbage collector frees (its collections
    # then took ~1% of a 32-coroutine step's time, ~3 ms each)
    batch_ref: weakref.ref[ViewBatch]
    # the decoder layers in one call, in place of the modules (CausalLM.forward's `layers`); None:
    # the modules, with `forward` per attention layer
    layers: DecoderLayers | None = None
    # the layers, the final norm and the lm_head in that one call, from the embeddings to every row's
    # float32 logits (CausalLM.forward's `to_logits`); None: the norm and lm_head as modules
    to_logits: DecoderLayers | None = None

    @property
    def batch(self) -> ViewBatch:
        batch = self.batch_ref()
        assert batch is not None, "a step's metadata outlived its batch"
        return batch


class ExecutionBackend(Protocol):
    """Runs steps: prepare once per step, then forward per attention layer. Results are fp32."""

    name: str
    # the native backend's fused decode step (None: none); `ModelRunner.fused_decode` reads and sets it
    fused: FusedDecode | None

    def attach(self, model: CausalLM) -> None:
        """Make `model` this backend's, once, when a runner is built (by module replacement)."""
        ...

    def prepare(self, batch: ViewBatch) -> StepMetadata:
        """Decide which path runs the step and build its tables (once per step, before the forward)."""
        ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        """Attention layer `layer`: store this step's keys k, v [T, Hkv, D] (normed, not rotated) and
        attend q [T, Hq, D] over each item's key runs -> [T, Hq, D] fp32."""
        ...


@dataclass
class _SharedRun:
    """A key run several decode items read (a shared block): its keys are read once per layer."""

    slots: torch.Tensor  # [L]
    rows: Rows  # [k] the readers' query rows
    cos: torch.Tensor  # [k, rotary_dim]: each reader's own position relative to the block
    sin: torch.Tensor
    span: tuple[int, int] | None  # slots are exactly the range [a, b): read keys as a view, no gather


@dataclass(frozen=True, slots=True)
class _Reader:
    """One decode item's use of one key run."""

    row: int  # the item's query row in the flattened batch
    item: int  # the decode item's index (0..D-1)
    run: KeyRun


@dataclass
class DecodeRuns:
    """Every key run of the step's single-token items, batched (layer-independent).

    Runs read by several items are attended once per run with all readers' queries; the rest
    (mostly each item's own block) are padded into one batch.
    """

    size: int  # D, the number of decode items
    items: Rows  # [D] the decode items' rows in the flattened batch
    shared: list[_SharedRun]
    rows: Rows  # [R] the query row of each padded run
    # which decode item (0..D-1) each partial belongs to: the shared runs' readers, then the padded runs
    owners: torch.Tensor
    slots: torch.Tensor  # [R, Lmax] pool slots, padded with slot 0
    valid: torch.Tensor  # [R, Lmax]
    cos: torch.Tensor  # [R, rotary_dim]
    sin: torch.Tensor

    @classmethod
    def build(cls, plans: list[ItemPlan], device) -> DecodeRuns:
        readers: dict[RunKey, list[_Reader]] = {}
        for d, p in enumerate(plans):
            for run in p.runs:
                if run.shared is not None:
                    readers.setdefault(run.shared, []).append(_Reader(p.rows.start, d, run))
        groups = [group for group in readers.values() if len(group) > 1]  # in first-reader order
        shared_keys = {group[0].run.shared for group in groups}
        shared = [
            _SharedRun(
                slots=group[0].run.slots,
                rows=row_index([r.row for r in group], device),
                cos=torch.cat([r.run.cos for r in group]),
                sin=torch.cat([r.run.sin for r in group]),
                span=group[0].run.span,
            )
            for group in groups
        ]
        padded = [
            _Reader(p.rows.start, d, run)
            for d, p in enumerate(plans)
            for run in p.runs
            if run.shared not in shared_keys
        ]
        shared_readers = [r for group in groups for r in group]  # in the order of `shared`
        width = max((r.run.slots.numel() for r in padded), default=0)
        slots = torch.zeros(len(padded), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(padded), width, dtype=torch.bool, device=device)
        for i, r in enumerate(padded):
            slots[i, : r.run.slots.numel()] = r.run.slots
            valid[i, : r.run.slots.numel()] = True
        return cls(
            size=len(plans),
            items=row_index([p.rows.start for p in plans], device),
            shared=shared,
            rows=row_index([r.row for r in padded], device),
            owners=torch.tensor([r.item for r in [*shared_readers, *padded]], device=device),
            slots=slots,
            valid=valid,
            cos=torch.cat([r.run.cos for r in padded]),
            sin=torch.cat([r.run.sin for r in padded]),
        )


@dataclass(kw_only=True)
class TorchStep(StepMetadata):
    """The torch path's tables: decode items' runs batched, the other items looped."""

    decode: DecodeRuns | None = None  # the runs of two or more decode items, batched
    looped: list[ItemPlan] = field(default_factory=list)  # items attended one by one, run by run


class TorchBackend:
    """The CPU torch path: flash kernel per run, a padded batch for decode, vectorised merges."""

    name = "torch"
    fused: FusedDecode | None = None

    def attach(self, model: CausalLM) -> None:
        use_torch_modules(model)

    def prepare(self, batch: ViewBatch) -> StepMetadata:
        return self._torch_step(batch, batch.decode_plans(), self.name)

    def _torch_step(self, batch: ViewBatch, decode: list[ItemPlan], path: str) -> TorchStep:
        """Single-token items (decoding coroutines) attend in one padded batch instead of a Python
        loop over items and blocks; prefill chunks, and a lone decode item, loop."""
        runs = DecodeRuns.build(decode, batch.store.device) if len(decode) > 1 else None
        looped = _others(batch, decode if runs else [])
        return TorchStep(path=path, batch_ref=weakref.ref(batch), decode=runs, looped=looped)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: StepMetadata) -> torch.Tensor:
        assert isinstance(metadata, TorchStep)  # built by this backend's prepare
        batch = metadata.batch
        slot = batch.store.attn_slot[layer]
        self._store(batch, slot, k, v)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        self._attend(metadata, q, slot, out)
        return out

    def _store(self, batch: ViewBatch, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's keys, rotated to their positions in their writer blocks, and values to the pool."""
        pool = batch.store.pool
        pool.k[slot][batch.write_slots] = batch.rotary.apply_prepared(k, *batch.key_rotation)
        pool.v[slot][batch.write_slots] = v

    def _attend(self, meta: TorchStep, q: torch.Tensor, slot: int, out: torch.Tensor) -> None:
        """The batched decode runs, then the looped items, into out's rows."""
        batch = meta.batch
        if meta.decode is not None:
            d, pool, rotary = meta.decode, batch.store.pool, batch.rotary
            outs, lses = [], []
            for run in d.shared:
                k_run, v_run = _keys(batch, slot, run)
                q_run = rotary.apply_prepared(q[run.rows], run.cos, run.sin)
                o, lse = self.run(q_run, k_run, v_run, batch.scale)
                outs.append(o)
                lses.append(lse)
            if d.slots.numel():
                o, lse = self.padded(
                    rotary.apply_prepared(q[d.rows], d.cos, d.sin),
                    pool.k[slot, d.slots],
                    pool.v[slot, d.slots],
                    d.valid,
                    batch.scale,
                )
                outs.append(o)
                lses.append(lse)
            out[d.items] = self.merge_grouped(torch.cat(outs), torch.cat(lses), d.owners, d.size)
        for plan in meta.looped:
            self._attend_item(batch, plan, q, slot, out)

    def _attend_item(self, batch: ViewBatch, plan: ItemPlan, q: torch.Tensor, slot: int,
                     out: torch.Tensor) -> None:
        """One item's queries over each of its key runs, partials merged by LSE, into out[rows] (a lone
        run's output straight into them)."""
        q_item = q[plan.rows]
        lone = out[plan.rows] if len(plan.runs) == 1 else None
        outs, lses = [], []
        for run in plan.runs:
            o, lse = self._run_rotated(batch.rotary, q_item, run, *_keys(batch, slot, run), batch.scale, lone)
            outs.append(o)
            lses.append(lse)
        if lone is None:
            out[plan.rows] = self.merge(outs, lses)

    def _run_rotated(self, rotary: Rotary, q: torch.Tensor, run: KeyRun, k: torch.Tensor, v: torch.Tensor,
                     scale: float, into: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` for an item's queries q [T, Hq, D] over one of its key runs, q rotated for the run
        first; the output also written into `into` where given."""
        o, lse = self.run(rotary.apply_prepared(q, run.cos, run.sin), k, v, scale, run.causal)
        if into is not None:
            into.copy_(o)
        return o, lse

    # ---- the kernels: every result fp32, LSE natural-log ------------------------------------------
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] over one run k, v [L, Hkv, D] -> (out [T, Hq, D], lse [T, Hq]).
        `causal`: L >= T and row t sees keys 0..L-T+t (the last T keys are the rows' own)."""
        return partial_attention(q, k, v, scale, causal)

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
        """One item's partials over disjoint runs -> its attention output [T, Hq, D]."""
        return merge_partials(outs, lses)

    def padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One query row per run: q [R, Hq, D], k, v [R, L, Hkv, D], valid [R, L] (>= 1 per row)
        -> (out [R, Hq, D], lse [R, Hq])."""
        return padded_attention(q, k, v, valid, scale)

    def merge_grouped(self, out: torch.Tensor, lse: torch.Tensor, owner: torch.Tensor,
                      groups: int) -> torch.Tensor:
        """Partials of many rows -> [groups, Hq, D]: rows with the same owner merge together."""
        return merge_grouped(out, lse, owner, groups)


class ReferenceBackend(TorchBackend):
    """The plain math, one run and one group at a time: slow, obviously correct."""

    name = "reference"

    def run(self, q, k, v, scale, causal=False):
        return reference_partial_attention(q, k, v, scale, causal)

    def merge(self, outs, lses):
        return reference_merge(outs, lses)

    def padded(self, q, k, v, valid, scale):
        parts = [reference_partial_attention(q[r : r + 1], k[r][valid[r]], v[r][valid[r]], scale)
                 for r in range(q.shape[0])]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])

    def merge_grouped(self, out, lse, owner, groups):
        merged = []
        for g in range(groups):
            rows = (owner == g).nonzero().flatten().tolist()
            merged.append(reference_merge([out[r] for r in rows], [lse[r] for r in rows]))
        return torch.stack(merged)


@dataclass(kw_only=True)
class NativeStep(TorchStep):
    """The native path's tables, on top of the torch path's (for the items the kernels do not take)."""

    store_slots: torch.Tensor | None = None  # [T] every new key's slot, row by row (the kernel's store)
    plan: native.DecodePlan | None = None  # the decode attention of `items`
    items: list[ItemPlan] = field(default_factory=list)  # the single-token items the kernel attends


class NativeBackend(TorchBackend):
    """The torch path with cothink's C kernels: native modules, key stores, decode attention, and the
    fused decode step where a step fits it."""

    name = "native"

    def __init__(self) -> None:
        self.fused: FusedDecode | None = None

    def attach(self, model: CausalLM) -> None:
        use_native_modules(model)
        self.fused = FusedDecode.for_model(model)

    def prepare(self, batch: ViewBatch) -> StepMetadata:
        decode = batch.decode_plans()
        if not native.available():  # switched off since the runner was built: the torch kernels
            return self._torch_step(batch, decode, "torch")
        plan = self.decode_plan(decode, batch.store.pool.k) if decode else None
        if plan is None:  # the torch kernels take the decode items (batched) with the others
            torch_step = self._torch_step(batch, decode, self.name)
            decode_runs, looped, items = torch_step.decode, torch_step.looped, []
        else:
            decode_runs, looped, items = None, _others(batch, decode), decode
        step = NativeStep(
            path=self.name, batch_ref=weakref.ref(batch), decode=decode_runs, looped=looped,
            # the kernel writes keys slot by slot: every new slot in one index tensor
            store_slots=torch.cat([p.new_slots for p in batch.plans]) if batch.has_attention else None,
            plan=plan, items=items,
        )
        # (a step with image placeholders takes the per-module path, which injects their features)
        if (self.fused is not None and len(items) == len(batch.plans) and batch.rows <= self.fused.max_rows
                and batch.vision is None):
            step.path = "fused"
            fused = FusedStep(
                pool_k=batch.store.pool.k, pool_v=batch.store.pool.v, store_slots=step.store_slots,
                key_cos=batch.key_rotation[0], key_sin=batch.key_rotation[1], plan=plan,
                scale=batch.scale, items=len(items), linear_decode=_weakly(batch.linear_decode),
            )
            step.layers, step.to_logits = self.fused.layers(fused), self.fused.logits(fused)
        return step

    def decode_plan(self, plans: list[ItemPlan], pool: torch.Tensor) -> native.DecodePlan | None:
        """A plan for the fused decode attention of these items, or None where the torch kernels
        are the better choice (too many keys) or cannot be matched (dtype, head size: a multiple
        of 16, as every released model's)."""
        if pool.dtype not in native.DTYPES or pool.shape[-1] % 16:
            return None
        # a shared block's runs carry its key: the kernel attends a long one once for all its readers
        runs = [[(run.slots, run.cos, run.sin, run.shared) for run in p.runs] for p in plans]
        plan = native.DecodePlan([p.rows.start for p in plans], runs)
        keys = sum(run.slots.numel() for p in plans for run in p.runs)  # the keys the kernel reads
        if pool.dtype == torch.bfloat16 and native.bf16_dot():  # where it groups them (native.c shared_tasks)
            keys -= plan.grouped_reads
        if keys > NATIVE_DECODE_MAX_KEYS and keys > NATIVE_DECODE_MAX_SHARING * _distinct_keys(plans):
            return None
        return plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's queries over one run in the C kernel where it takes them
        (`native.prefill_attention_fits`: AVX-512 BF16 without AMX tiles, bfloat16 pools): torch's
        flash kernel multiplies bfloat16 through MKL, which on AMD's CPUs runs float32 AVX2 code; the
        kernel multiplies bfloat16 pairs (VDPBF16PS) with float32 sums: float32 scores and softmax, P
        rounded to bfloat16 for P V as the flash kernel rounds it. Single rows, and anything else,
        take the torch path."""
        if q.shape[0] > 1 and native.prefill_attention_fits(q, k, v):
            return native.prefill_attention(q, k, v, scale, causal)
        return super().run(q, k, v, scale, causal)

    def _run_rotated(self, rotary: Rotary, q: torch.Tensor, run: KeyRun, k: torch.Tensor, v: torch.Tensor,
                     scale: float, into: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill item's run in the C kernel where it takes it (as `run`), which rotates the queries
        itself (to the bit as Rotary.apply_prepared: five torch ops per layer and run spared) and
        writes its output into `into` in place."""
        if q.shape[0] > 1 and native.prefill_attention_fits(q, k, v):
            return native.prefill_attention(q, k, v, scale, run.causal, rotation=(run.cos, run.sin), out=into)
        return super()._run_rotated(rotary, q, run, k, v, scale, into)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: StepMetadata) -> torch.Tensor:
        if not isinstance(metadata, NativeStep):  # the kernels were off when the step was prepared
            return super().forward(layer, q, k, v, metadata)
        batch = metadata.batch
        slot = batch.store.attn_slot[layer]
        pool_k, pool_v = batch.store.pool.k[slot], batch.store.pool.v[slot]
        if metadata.store_slots is not None and _can_store(k, v, pool_k):
            native.store_kv(k, v, metadata.store_slots, *batch.key_rotation, pool_k, pool_v)
        else:
            self._store(batch, slot, k, v)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if metadata.items:
            if q.dtype == pool_k.dtype and native.supports(q):
                native.decode_attention(q, metadata.plan, pool_k, pool_v, batch.scale, out)
            else:  # not the kernel's input layout: the per-item torch path
                for plan in metadata.items:
                    self._attend_item(batch, plan, q, slot, out)
        self._attend(metadata, q, slot, out)
        return out


def _others(batch: ViewBatch, taken: list[ItemPlan]) -> list[ItemPlan]:
    """The step's items other than `taken`, in order."""
    ids = {id(p) for p in taken}
    return [p for p in batch.plans if id(p) not in ids]


def _can_store(k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether native.store_kv can write this step's k, v [T, H, D] into pool [S, H, D]."""
    d = k.shape[-1]
    return (
        k.dtype == v.dtype == pool.dtype and native.supports(k) and native.supports(v)
        and k.stride(1) == d and v.stride(1) == d and pool.is_contiguous()
    )


def _keys(batch: ViewBatch, slot: int, run: KeyRun | _SharedRun) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's keys and values in one layer: a view when its slots are one range, else gathered."""
    pool = batch.store.pool
    if run.span is not None:
        a, b = run.span
        return pool.k[slot, a:b], pool.v[slot, a:b]
    return pool.k[slot, run.slots], pool.v[slot, run.slots]


def select_backend(name: str | ExecutionBackend, device: torch.device | str) -> ExecutionBackend:
    """The backend for `name` on `device`, chosen once per runner. An object passes through (one
    runner per backend object: `attach` makes it that runner's)."""
    if not isinstance(name, str):
        return name
    if name not in BACKEND_NAMES:
        raise InvalidParameterError(
            f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}", param="attention_backend"
        )
    if name == "reference":
        return ReferenceBackend()
    on_cpu = torch.device(device).type == "cpu"
    if name == "native":
        if not (on_cpu and native.available()):
            raise InvalidParameterError(
                "attention_backend 'native' needs a CPU device and cothink's C kernels, which are "
                "switched off (COTHINK_NATIVE=0) or could not be built (no C compiler?)",
                param="attention_backend",
            )
        return NativeBackend()
    if name == "auto" and on_cpu and native.available():
        return NativeBackend()
    # the torch path (its kernel falls back to the math off CPU)
    return TorchBackend()


def _weakly(method: LinearDecoder) -> LinearDecoder:
    """A batch's bound method that does not keep the batch alive (the batch holds what holds it)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)  # type: ignore[misc]
