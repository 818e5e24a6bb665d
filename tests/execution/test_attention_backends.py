"""The execution backend seam and the execution cache, through the runner.

The "torch" path (flash kernel per run, padded batch for decode), the "native" path (fused C kernels
for key stores and decode attention) and the plain "reference" math give the same logits on
multi-block views, prefill chunks and batched decode steps whose items share blocks.
"""

from __future__ import annotations

import pytest
import torch
from support import ids, load_runner

from cothink.errors import InvalidParameterError
from cothink.execution import attention_backends
from cothink.execution.attention_backends import (
    NativeBackend,
    NativeStep,
    ReferenceBackend,
    TorchBackend,
    select_backend,
)
from cothink.execution.runner import ModelRunner
from cothink.execution.step import StepItem
from cothink.ops import native

ATOL = 1e-5


def _scenario(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill two shared blocks, then three writers decode together for a few steps (one of them
    alone on its block, two reading both shared blocks in different orders), then a prefill chunk
    and decode tokens in one step."""
    out = []
    sys_, doc = runner.new_block("sys"), runner.new_block("doc")
    out.append(runner.extend(sys_, ids(9, seed=1)))
    out.append(runner.extend(doc, ids(14, seed=2), view=[sys_, doc]))
    writers = [runner.new_block(f"w{i}") for i in range(3)]
    views = [[sys_, doc, writers[0]], [doc, sys_, writers[1]], [writers[2]]]
    for w, view in zip(writers, views):
        out.append(runner.extend(w, ids(3, seed=w.id), view=view))
    for s in range(4):
        items = [StepItem(w, ids(1, seed=10 * s + i), view)
                 for i, (w, view) in enumerate(zip(writers, views))]
        out.extend(runner.step(items))
    mixed = [StepItem(writers[0], ids(6, seed=99), views[0]), StepItem(writers[1], ids(1, seed=98), views[1]),
             StepItem(writers[2], ids(1, seed=97), views[2])]
    out.extend(runner.step(mixed))
    return out


NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")


class _CountingNative(NativeBackend):
    """The native backend, counting how many decode steps its fused attention planned."""

    def __init__(self):
        super().__init__()
        self.plans = 0

    def decode_plan(self, *args):
        plan = super().decode_plan(*args)
        self.plans += plan is not None
        return plan


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=NEEDS_NATIVE)])
@pytest.mark.parametrize("kind", ["llama", "qwen35", "llama_yarn"])
def test_fast_backends_agree_with_reference(kind, backend):
    chosen = _CountingNative() if backend == "native" else backend
    fast = load_runner(kind, kv_tokens=512, page_size=4, attention_backend=chosen)
    slow = load_runner(kind, kv_tokens=512, page_size=4, attention_backend="reference")
    assert isinstance(fast.backend, TorchBackend) and isinstance(slow.backend, ReferenceBackend)
    for a, b in zip(_scenario(fast), _scenario(slow), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    if backend == "native":  # the decode steps (shared blocks, one or three items) took the kernel,
        # except with llama_yarn's head size 8: the kernel reads heads in 16-lane blocks
        assert fast.backend.plans >= 5 if fast.config.head_dim % 16 == 0 else fast.backend.plans == 0


@NEEDS_NATIVE
def test_native_decode_hands_large_steps_to_the_torch_kernels(monkeypatch):
    seen: list[tuple[bool, bool]] = []  # per attention call: (fused decode, padded torch batch)
    monkeypatch.setattr(NativeBackend, "forward", _recording(NativeBackend.forward, seen))
    monkeypatch.setattr(attention_backends, "NATIVE_DECODE_MAX_KEYS", 0)
    monkeypatch.setattr(attention_backends, "NATIVE_DECODE_MAX_SHARING", 0)
    large = _scenario(load_runner("llama", kv_tokens=512, page_size=4, attention_backend="native"))
    over, seen[:] = list(seen), []
    monkeypatch.setattr(attention_backends, "NATIVE_DECODE_MAX_KEYS", 1024)
    small = _scenario(load_runner("llama", kv_tokens=512, page_size=4, attention_backend="native"))
    for a, b in zip(large, small, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert not any(n for n, _ in over) and any(d for _, d in over)  # over the limit: the torch batch
    assert any(n for n, _ in seen)  # the same steps under it: the fused kernel


def test_distinct_keys_count_a_shared_run_once():
    """Over NATIVE_DECODE_MAX_KEYS the native kernel keeps a step whose keys are read by few items each
    (reads / distinct keys <= NATIVE_DECODE_MAX_SHARING): a shared run counts once, own runs each."""
    from types import SimpleNamespace

    from cothink.execution.step import KeyRun, RunKey

    def run(n: int, shared: RunKey | None) -> KeyRun:
        return KeyRun(torch.arange(n), torch.zeros(1), torch.zeros(1), False, shared)

    def plan(*runs: KeyRun) -> SimpleNamespace:  # the one field of an ItemPlan it reads
        return SimpleNamespace(runs=list(runs))

    ctx = RunKey(block_id=1, length=100)
    private = [plan(run(100, RunKey(block_id=10 + i, length=100)), run(3, None)) for i in range(4)]
    shared = [plan(run(100, ctx), run(3, None)) for _ in range(4)]
    assert attention_backends._distinct_keys(private) == 4 * 103
    assert attention_backends._distinct_keys(shared) == 100 + 4 * 3


@NEEDS_NATIVE
def test_a_long_shared_run_counts_once_where_the_kernel_groups_its_readers(monkeypatch):
    """Eight items read one 600-key shared block (8 x 601 reads of 608 distinct keys) over a 1 000-key
    limit: where the kernel attends it once for its readers (bfloat16 pools, AVX-512 BF16) the limit
    counts the keys it reads and the native kernel keeps the step; elsewhere it goes to the torch
    kernels, which read a shared run once."""
    from types import SimpleNamespace

    from cothink.execution.step import KeyRun, RunKey

    monkeypatch.setattr(attention_backends, "NATIVE_DECODE_MAX_KEYS", 1000)
    ctx = RunKey(block_id=1, length=600)
    for dtype in (torch.bfloat16, torch.float32):
        table = torch.zeros(1, 1, 16, dtype=dtype)
        plans = [SimpleNamespace(rows=slice(i, i + 1), runs=[
            KeyRun(torch.arange(600), table, table, False, ctx),
            KeyRun(torch.tensor([600 + i]), table, table, False, None),
        ]) for i in range(8)]
        plan = NativeBackend().decode_plan(plans, torch.zeros(700, 2, 16, dtype=dtype))
        grouped = dtype == torch.bfloat16 and native.bf16_dot()
        assert (plan is not None) == grouped
        if grouped:
            assert plan.groups == 1 and plan.grouped_reads == 7 * 600


def _recording(forward, seen: list[tuple[bool, bool]]):
    def record(backend, layer, q, k, v, metadata):
        assert isinstance(metadata, NativeStep)
        seen.append((bool(metadata.items), metadata.decode is not None))
        return forward(backend, layer, q, k, v, metadata)

    return record


def test_backend_is_chosen_once_by_name(monkeypatch):
    assert select_backend("auto", "cpu").name == ("native" if native.available() else "torch")
    assert select_backend("torch", "cpu").name == "torch"
    assert select_backend("reference", "cpu").name == "reference"
    monkeypatch.setattr(native, "ENABLED", False)  # COTHINK_NATIVE=0
    assert select_backend("auto", "cpu").name == "torch"
    with pytest.raises(InvalidParameterError, match="COTHINK_NATIVE"):
        select_backend("native", "cpu")
    custom = ReferenceBackend()
    assert select_backend(custom, "cpu") is custom
    with pytest.raises(InvalidParameterError) as err:
        select_backend("flash9", "cpu")
    assert err.value.param == "attention_backend"


def test_cached_logits_follow_the_view_and_are_dropped_on_truncate_and_free():
    runner = load_runner("qwen35", kv_tokens=256, page_size=4)
    a, b = runner.new_block("a"), runner.new_block("b")
    runner.extend(a, ids(5, seed=1))
    logits = runner.extend(b, ids(4, seed=2), view=[a, b], logits="last")
    torch.testing.assert_close(runner.cached_logits([a, b]), logits[-1], atol=0, rtol=0)
    assert runner.cached_logits([b]) is None  # another view of the same block
    assert runner.cached_logits([a]) is not None  # a's own write, under its own view
    assert runner.cached_logits([b, a]) is None
    # the writer state is cached under the view after the write; the next write under it starts there
    assert runner.cache.writer_view(b) == ((a.id, a.version, 5), (b.id, b.version, 4))
    runner.extend(b, ids(1, seed=3), view=[a, b], logits="none")
    assert runner.cached_logits([a, b]) is None  # that write computed no logits: the old ones are stale
    assert runner.cache.writer_view(b) == ((a.id, a.version, 5), (b.id, b.version, 5))
    again = runner.extend(b, ids(1, seed=4), view=[a, b], logits="last")
    torch.testing.assert_close(runner.cached_logits([a, b]), again[-1], atol=0, rtol=0)
    runner.truncate(b, 2)
    assert runner.cached_logits([a, b]) is None and runner.cache.writer_view(b) is None
    runner.free(a)
    runner.free(b)
    assert len(runner.cache) == 0


@pytest.mark.parametrize("backend", ["torch", "reference", "auto"])
def test_the_backend_attaches_on_the_compute_thread(tiny_model, monkeypatch, backend):
    """Attaching may copy weights (the native backend's bfloat16 linears unpack oneDNN's weight): a
    parallel torch op on the caller's thread would give it an OpenMP pool of its own beside the
    compute thread's, and with more OpenMP threads than cores libgomp stops spinning (SmolLM2 bfloat16
    on a 2-core AMD EPYC: decode 0.78x, prefill 0.85x for the rest of the process)."""
    import threading

    seen: list[str] = []
    for cls in (TorchBackend, NativeBackend):
        attach = cls.attach
        monkeypatch.setattr(cls, "attach", lambda self, model, attach=attach: (
            seen.append(threading.current_thread().name), attach(self, model))[1])
    tiny_model("llama").runner(attention_backend=backend)
    assert seen and all(name.startswith("cothink-compute") for name in seen)


@pytest.mark.skipif(
    not native.prefill_attention_fits(*(torch.zeros(2, 2, 16, dtype=torch.bfloat16) for _ in range(3))),
    reason="the prefill attention kernel is built only where the CPU has AVX-512 BF16")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "qwen35"])
def test_native_prefill_chunks_take_the_prefill_kernel(kind, dtype, monkeypatch):
    """Prefill chunks (alone on a block, over shared blocks, a writer's old tokens and its new ones in
    one causal run) take the C prefill attention on the native backend, and its logits are as close to
    the reference math's as the torch flash kernel's: bfloat16 (both round P to bfloat16) within a
    bfloat16 step of it, float32 within float32 rounding."""
    rows: list[int] = []
    kernel = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention",
                        lambda q, *a, **kw: (rows.append(q.shape[0]), kernel(q, *a, **kw))[1])
    runners = {name: load_runner(kind, kv_tokens=512, page_size=4, dtype=dtype,
                                 attention_backend=name) for name in ("native", "torch", "reference")}
    native_out, torch_out, want = (_scenario(runners[n]) for n in ("native", "torch", "reference"))
    assert rows and min(rows) > 1  # prefill chunks only; decode items take the decode kernel
    flash = max((a - b).abs().max().item() for a, b in zip(torch_out, want, strict=True))
    kernel = max((a - b).abs().max().item() for a, b in zip(native_out, want, strict=True))
    # (logits of ~3: one bfloat16 step; measured 0-0.016 vs 0.04-0.047 in bfloat16)
    assert kernel <= flash + (1 / 64 if dtype == torch.bfloat16 else 1e-5)
