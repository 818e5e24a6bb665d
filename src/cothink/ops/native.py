"""Fused CPU kernels for decode-sized work (ops/native.c): compiled on first use, called by ctypes.

A decode step on CPU is bound by dispatch, not arithmetic: an RMSNorm of one row is eight torch ops
(~18 us), a view attention of one query ~200 us around a ~40 us kernel. The kernels here do each unit
in one call; `linear` runs the products of steps of a few rows, where torch's bfloat16 kernel on a
CPU without bfloat16 arithmetic costs a GEMV per row; `decode_layers` chains them over every decoder
layer of a small Llama-family decode step, and its final norm and lm_head (execution/fused_decode.py).
They are plain C (no torch headers, so they build in about a second with the system compiler and its
OpenMP, for this machine's CPU); the products and the attentions split their work over the caller's
torch thread count (or the count `team_threads` sets: a step run on the event loop, whose torch ops
stay on one thread), the attentions on OpenMP's threads (the runtime torch loaded: one team with
torch's ops), the products and the fused step on helper threads of their own (native.c says why), the
rest run on the calling thread.

`available()` is False, and every caller keeps its torch path, when the kernels are switched off
(`COTHINK_NATIVE=0` in the environment, or `native.ENABLED = False`), when no C compiler is found
(`$CC`, else `cc` or `gcc` on the PATH), or when the build fails (logged once); `status()` says which.
With `COTHINK_REQUIRE_NATIVE=1` a kernel that cannot be built or loaded raises NativeKernelError
instead (switching the kernels off stays allowed). The library is cached in cothink's user cache
(`$COTHINK_CACHE/native`, default `~/.cache/cothink/native`) under a name that hashes the source,
the compiler and the CPU; it reports its interface version (`ct_abi_version`), and a cached file that
reports another than ABI_VERSION (copied, or left by another build) is rebuilt before anything in it
is called.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from cothink.errors import NativeKernelError

log = logging.getLogger(__name__)

ENABLED = os.environ.get("COTHINK_NATIVE", "1") != "0"
REQUIRED = os.environ.get("COTHINK_REQUIRE_NATIVE", "0") == "1"
# bfloat16 products of decode-sized steps in the C kernel where it has the CPU's bfloat16 dot products,
# beside oneDNN's packed weights for wider steps (a second copy of every bfloat16 linear's weight);
# COTHINK_BF16_DECODE=0 keeps them on oneDNN (execution/native_modules.py)
BF16_DECODE = os.environ.get("COTHINK_BF16_DECODE", "1") != "0"
# float32 linears keep a copy of their weight in tiles for the C kernel's products (`takes_f32_tiles`);
# COTHINK_F32_TILES=0 keeps one copy, the C kernel then reading the plain weight
F32_TILES = os.environ.get("COTHINK_F32_TILES", "1") != "0"
# int8 and 4-bit weights in pairs take the activations as 8-bit codes (models/quantize.py);
# COTHINK_8BIT_ACTIVATIONS=0 keeps those layers on the plain kernels' bfloat16 activations (`takes_pairs`)
ACTIVATIONS_8BIT = os.environ.get("COTHINK_8BIT_ACTIVATIONS", "1") != "0"
# CT_ABI_VERSION in native.c: the interface (signatures, tables) this module calls
ABI_VERSION = 17
SOURCE = Path(__file__).with_name("native.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# weight storage the C linear reads (WT_* in native.c): the model dtypes, int8 with row scales,
# 4-bit groups packed two to a byte (uint8, models/quant4.py) with a scale and offset per group, and
# bfloat16 or int8 in pairs (int32 or int16, `pack_pairs`), 4-bit in pairs (uint16, `pack_q4_pairs`;
# with half-precision scales, WT_Q4_HALF: `weight_kind`); float32 in tiles (3-D, `pack_f32_tiles`)
WEIGHT_TYPES = {**DTYPES, torch.int8: 2, torch.uint8: 3, torch.int32: 4, torch.int16: 5, torch.uint16: 6}
WT_Q4_HALF = 7
WT_F32_TILES = 8
# a weight's dtype -> the dtype of its pairs (`pack_pairs`)
PAIRS_OF = {torch.bfloat16: torch.int32, torch.int8: torch.int16}
# weights per 4-bit group (Q4_GROUP in native.c)
Q4_GROUP = 32
# outputs per tile of a weight in pairs (PAIR_TILE in native.c)
PAIR_TILE = 32
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-fopenmp",
          # extra compiler flags (part of the cache key), e.g. -mno-avx512f for the portable kernels on a
          # CPU with AVX-512 (the tests build both)
          *os.environ.get("COTHINK_NATIVE_CFLAGS", "").split()]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "ct_rms_norm": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, ctypes.c_int, ctypes.c_int, _I],
    "ct_silu_mul": [_P, _I, _P, _I, _I, ctypes.c_int, _I],
    "ct_gdn_gates": [_P, _P, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int],
    "ct_gated_rms_norm": [_P, _P, _I, _P, _P, _I, _I, _I, _F, ctypes.c_int],
    "ct_gdn_token": [_P, _I, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _F, ctypes.c_int],
    "ct_store_kv": [_P, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, ctypes.c_int, _I],
    "ct_decode_attention": [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P,
                            _F, _P, ctypes.c_int, _I],
    "ct_linear": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I],
    "ct_head_rms_norm": [_P, _I, _I, _P, _P, _I, _I, _I, _F, ctypes.c_int, ctypes.c_int],
    "ct_sigmoid_gate": [_P, _P, _I, _I, _P, _I, _I, _I, ctypes.c_int],
    "ct_decode_layers": [_P, _I, _I, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int, _I],
    "ct_q4_dequant": [_P, _P, _P, ctypes.c_int, _I, _I, _I, _I],
    "ct_helper_grains": [],
    "ct_linear_tiles": [],
    "ct_linear_bf16_dot": [],
    "ct_linear_f32_tiles": [],
    "ct_prefill_attention": [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int, _F, _P, _P,
                             ctypes.c_int, _I],
    "ct_prefill_attention_built": [],
    "ct_layout": [ctypes.POINTER(_I)],
}


# ct_decode_layers' inputs (native.c, the Ct* structs): mirrors, field by field, checked against the
# library's own offsets and sizes (`ct_layout`) when it is loaded, so the two cannot drift apart.
class CtLinear(ctypes.Structure):
    """One linear of a layer: the weight, its int8 row scales or 4-bit group scales and offsets (None: a
    weight of the model dtype), its bias (None: none)."""

    _fields_ = [("weight", _P), ("scale", _P), ("bias", _P)]


class CtLayer(ctypes.Structure):
    """One decoder layer (a missing norm: None). mix_in and mix_out are the mixer's projections
    (attention q/k/v and o, or Gated DeltaNet's input and output); kv_slot the layer's index in the
    key pool, -1 for a Gated DeltaNet layer (whose conv .. gated_norm are then set)."""

    _fields_ = [
        ("in_norm", _P), ("post_norm", _P), ("mix_in", CtLinear), ("mix_out", CtLinear),
        ("gate_up", CtLinear), ("down", CtLinear), ("q_norm", _P), ("k_norm", _P), ("kv_slot", _I),
        ("conv", _P), ("a_log", _P), ("dt_bias", _P), ("gated_norm", _P),
    ]


class CtShape(ctypes.Structure):
    """The model's sizes (`LayerShape`)."""

    _fields_ = [
        ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
        ("gated", _I), ("zero_centred", _I), ("key_heads", _I), ("value_heads", _I), ("key_dim", _I),
        ("value_dim", _I), ("conv_kernel", _I), ("eps", _F), ("l2_eps", _F),
    ]


class CtStepKeys(ctypes.Structure):
    """A step's keys: the pool, where this step's keys go, the items' key runs (a DecodePlan)."""

    _fields_ = [
        ("pool_k", _P), ("pool_v", _P), ("pool_layer", _I), ("store_slots", _P), ("key_cos", _P),
        ("key_sin", _P), ("items", _I), ("rows", _P), ("run_start", _P), ("key_start", _P), ("slots", _P),
        ("cos", _P), ("sin", _P), ("groups", _I), ("group_start", _P), ("group_runs", _P), ("shared_of", _P),
        ("rot", _I), ("scale", _F),
    ]


class CtLinearItem(ctypes.Structure):
    """One item of a Gated DeltaNet layer: its conv tail and state before its token, buffers after."""

    _fields_ = [("tail", _P), ("tail_stride", _I), ("state", _P), ("state_out", _P), ("tail_out", _P)]


class CtLinearIO(ctypes.Structure):
    """A Gated DeltaNet layer's step buffers: pre-conv rows, g, beta, and one CtLinearItem per item."""

    _fields_ = [("rows", _P), ("g", _P), ("beta", _P), ("items", ctypes.POINTER(CtLinearItem))]


class CtHead(ctypes.Structure):
    """A step's logits after its last layer: the final norm's weight, the lm_head (storage `wt`, `vocab`
    outputs) and the float32 rows [T, vocab] it writes."""

    _fields_ = [("norm", _P), ("linear", CtLinear), ("wt", _I), ("vocab", _I), ("logits", _P)]


STRUCTS = (CtLinear, CtLayer, CtShape, CtStepKeys, CtLinearItem, CtLinearIO, CtHead)


class _CtField(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", _I)]


def layout_mismatches(lib: ctypes.CDLL, structs: tuple[type[ctypes.Structure], ...] = STRUCTS) -> list[str]:
    """Where the ctypes mirrors disagree with the library's structs (ct_layout: each field's offset,
    each struct's size); empty when they agree."""
    count = _I()
    fn = lib.ct_layout
    fn.restype = ctypes.POINTER(_CtField)
    fields = fn(ctypes.byref(count))
    theirs = {fields[i].name.decode(): fields[i].offset for i in range(count.value)}
    ours: dict[str, int] = {}
    for struct in structs:
        ours[struct.__name__] = ctypes.sizeof(struct)
        for name, *_ in struct._fields_:
            ours[f"{struct.__name__}.{name}"] = getattr(struct, name).offset
    return [f"{name}: native.c {theirs.get(name)}, native.py {ours.get(name)}"
            for name in sorted(theirs.keys() | ours.keys()) if theirs.get(name) != ours.get(name)]


def _cache_dir() -> Path:
    from cothink.models.hub import cache_dir  # a leaf helper (paths only): the one user cache

    return cache_dir() / "native"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _target(compiler: str) -> Path:
    """Where the library built from this source, by this compiler, for this CPU is cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), version.encode(), _cpu_signature().encode(), " ".join(_FLAGS).encode()]
    )).hexdigest()[:16]
    return _cache_dir() / f"native-{key}.so"


def _build(compiler: str, stale: bool = False) -> Path:
    """The cached library, built first if missing (or `stale`: replacing the file there)."""
    target = _target(compiler)
    if target.exists() and not stale:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build to a private name, then rename: processes building at once never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            message = done.stderr.strip() or done.stdout.strip()
            raise RuntimeError(f"{' '.join(cmd)} exited with status {done.returncode}"
                               + (f":\n{message}" if message else " (no message)"))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """Whether this process runs the C kernels, and why not when it does not (`cothink info`,
    /health, the engine's start log)."""

    available: bool
    reason: str | None  # why not, for a person: switched off, no compiler, the compiler's message...
    library: str | None  # the loaded library's path
    abi: int  # the interface version cothink calls (ABI_VERSION); a loaded library reports the same
    required: bool  # COTHINK_REQUIRE_NATIVE=1: not available raises NativeKernelError where they are used


def _abi_of(lib: ctypes.CDLL) -> int | None:
    """The version a library reports (None: it has no ct_abi_version, a build older than the check)."""
    try:
        fn = lib.ct_abi_version
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_int
    return int(fn())


def _off(reason: str) -> tuple[None, KernelStatus]:
    return None, KernelStatus(False, reason, None, ABI_VERSION, REQUIRED)


@cache
def _load() -> tuple[ctypes.CDLL | None, KernelStatus]:
    """Build (once per source, compiler and CPU) and load the library; nothing in it is called before
    its ABI version is checked."""
    compiler = _compiler()
    if compiler is None:
        log.info("native kernels off: no C compiler found (set CC to use one)")
        return _off("no C compiler found (set CC to use one)")
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
        found = _abi_of(lib)
        if found != ABI_VERSION:
            log.warning("native library %s has ABI %s, cothink calls %d: rebuilding it", path, found,
                        ABI_VERSION)
            # unloaded first: dlopen of a path it holds open returns that handle, not the file there now
            _ctypes.dlclose(lib._handle)
            path = _build(compiler, stale=True)
            lib = ctypes.CDLL(str(path))
            found = _abi_of(lib)
            if found != ABI_VERSION:  # native.c and ABI_VERSION disagree: a source that was not released
                reason = f"ABI mismatch: {path} reports {found}, cothink calls {ABI_VERSION}"
                log.warning("native kernels off: %s", reason)
                return _off(reason)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        if not REQUIRED:
            log.warning("native kernels off, torch paths used instead: %s", err)
        return _off(f"build failed: {err}")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.ct_helper_grains.restype = ctypes.c_int64
    lib.ct_linear_tiles.restype = ctypes.c_int
    lib.ct_linear_bf16_dot.restype = ctypes.c_int
    lib.ct_linear_f32_tiles.restype = ctypes.c_int
    lib.ct_prefill_attention_built.restype = ctypes.c_int
    drift = layout_mismatches(lib)
    if drift:  # a field added, moved or retyped on one side only: never call the library
        reason = "native.py's structs do not match native.c's: " + "; ".join(drift)
        log.warning("native kernels off: %s", reason)
        return _off(reason)
    return lib, KernelStatus(True, None, str(path), ABI_VERSION, REQUIRED)


def _library() -> ctypes.CDLL | None:
    lib, state = _load()
    if lib is None and REQUIRED:
        raise NativeKernelError(
            f"cothink's C kernels are required (COTHINK_REQUIRE_NATIVE=1) but not available: {state.reason}"
        )
    return lib


def status() -> KernelStatus:
    """Whether the kernels run in this process (building them on first call), and why not; never raises."""
    if not ENABLED:
        how = "COTHINK_NATIVE=0" if os.environ.get("COTHINK_NATIVE") == "0" else "native.ENABLED = False"
        return KernelStatus(False, f"switched off ({how})", None, ABI_VERSION, REQUIRED)
    return _load()[1]


def start_note(device: torch.device) -> tuple[int, str]:
    """(log level, message) of the kernels' status for an engine starting on `device`: WARNING when it
    runs on the CPU without them (the torch path, 2-4x slower at decode), INFO otherwise."""
    state = status()
    if state.available:
        return logging.INFO, f"engine on {device}: cothink's C kernels loaded ({state.library})"
    if device.type != "cpu":
        return logging.INFO, f"engine on {device}: cothink's C kernels not used ({state.reason})"
    return logging.WARNING, (f"engine on the CPU without cothink's C kernels, the slower torch path runs: "
                             f"{state.reason} (`cothink info` checks them)")


def available() -> bool:
    """Whether the fused kernels can be used (switched on, and built for this machine); with
    COTHINK_REQUIRE_NATIVE=1, NativeKernelError where they are switched on but cannot be built."""
    return ENABLED and _library() is not None


_team = threading.local()  # `team_threads`: this thread's count for the kernels, where set


@contextmanager
def team_threads(n: int) -> Iterator[None]:
    """Within the block, this thread's kernel calls split their work over `n` threads, whatever
    torch's thread count: a step on the event loop keeps its torch ops on one thread (a second
    OpenMP pool beside the compute thread's costs every step, execution/threads.py) while its C
    kernels, which a decode-sized step runs on their own helper threads, use the step's count."""
    before = getattr(_team, "threads", None)
    _team.threads = n
    try:
        yield
    finally:
        _team.threads = before


def _threads() -> int:
    """Threads a kernel call splits its work over: `team_threads`' count, else torch's."""
    return getattr(_team, "threads", None) or torch.get_num_threads()


def bf16_tiles() -> bool:
    """Whether `linear`'s bfloat16 products run on AMX tiles here (an x86 CPU with AMX, Linux granting
    the tile state, the library built for them): then they are as fast as oneDNN's up to 32 rows."""
    return available() and bool(_library().ct_linear_tiles())


def bf16_pairs() -> bool:
    """Whether `linear` takes bfloat16 weights in pairs (`pack_pairs`): AVX-512 BF16 and VNNI (every CPU
    with the first has the second; the 4-bit products in pairs use it) without AMX tiles (where tiles
    run the plain layout, it stays on them)."""
    return bf16_dot() and not bf16_tiles()


def takes_pairs(weight: torch.Tensor) -> bool:
    """Whether `linear` runs this weight in pairs here: `bf16_pairs`, and a bfloat16 [N, K] weight that
    `pack_pairs` takes (N a multiple of PAIR_TILE, K of 16), an int8 one with K a multiple of Q4_GROUP
    (its products take x in 8-bit groups), or a 4-bit one (uint8 [N, K / 2]) that `pack_q4_pairs` takes
    (N a multiple of PAIR_TILE, K of Q4_GROUP); int8 and 4-bit ones not with COTHINK_8BIT_ACTIVATIONS=0."""
    eight_bit = weight.dtype in (torch.int8, torch.uint8)
    return (bf16_pairs() and weight.dtype in (*PAIRS_OF, torch.uint8) and weight.dim() == 2
            and (ACTIVATIONS_8BIT or not eight_bit)
            and weight.shape[0] % PAIR_TILE == 0
            and weight.shape[1] % (Q4_GROUP if weight.dtype == torch.int8 else 16) == 0)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 or int8 weight [N, K] (N a multiple of PAIR_TILE, K of 16) in the layout `linear`
    reads in tiles of PAIR_TILE outputs, the outputs along the vector lanes (native.c WT_BF16P,
    WT_INT8P): int32 [N, K / 2] holding per tile [K / 2][PAIR_TILE] bfloat16 pairs (w[o][2p],
    w[o][2p + 1]); int16 [N, K / 2] holding per tile [K / 4][PAIR_TILE] quads of int8 weights
    (w[o][4q] .. w[o][4q + 3]) plus 128 as unsigned bytes, the order VPDPBUSD multiplies them in. The
    same bytes as the weight, reordered (and, int8, each one's top bit flipped)."""
    n, k = weight.shape
    if weight.dtype not in PAIRS_OF or n % PAIR_TILE or k % 16:
        raise ValueError(f"pack_pairs: a bfloat16 or int8 [N, K] weight with N % {PAIR_TILE} == 0 and "
                         f"K % 16 == 0, not {tuple(weight.shape)} {weight.dtype}")
    if weight.dtype == torch.int8:
        unsigned = _tile_quads(weight).contiguous().view(torch.uint8) ^ 0x80
        return unsigned.view(torch.int16).reshape(n, k // 2)
    tiles = weight.reshape(n // PAIR_TILE, PAIR_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return tiles.view(PAIRS_OF[weight.dtype]).reshape(n, k // 2)


def unpack_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight in pairs (`pack_pairs`: int32 [N, K / 2]) as it was: bfloat16 [N, K], the same
    bytes in their first order."""
    n, half = pairs.shape
    if pairs.dtype != PAIRS_OF[torch.bfloat16] or n % PAIR_TILE:
        raise ValueError(f"unpack_pairs: a bfloat16 weight in pairs, int32 [N, K / 2] with "
                         f"N % {PAIR_TILE} == 0, not {tuple(pairs.shape)} {pairs.dtype}")
    tiles = pairs.view(torch.bfloat16).reshape(n // PAIR_TILE, half, PAIR_TILE, 2).permute(0, 2, 1, 3)
    return tiles.reshape(n, 2 * half)


def _tile_quads(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / PAIR_TILE, K / 4, PAIR_TILE, 4]: per tile of outputs and four inputs, each output's
    four weights together, the order VPDPBUSD multiplies them in (int8 and 4-bit pairs)."""
    n, k = weight.shape
    return weight.reshape(n // PAIR_TILE, PAIR_TILE, k // 4, 4).permute(0, 2, 1, 3)


def f32_tiles() -> bool:
    """Whether `linear` takes float32 weights in tiles (`pack_f32_tiles`): the library built with AVX-512."""
    return available() and bool(_library().ct_linear_f32_tiles())


def takes_f32_tiles(weight: torch.Tensor) -> bool:
    """Whether `linear` runs this weight in tiles here: `f32_tiles`, unless COTHINK_F32_TILES=0, and a
    float32 [N, K] weight with K a multiple of 16."""
    return (F32_TILES and f32_tiles() and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] % 16 == 0)


def pack_f32_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (K a multiple of 16) as `linear` reads it in tiles: [ceil(N / PAIR_TILE),
    K, PAIR_TILE], tile t holding outputs PAIR_TILE t .. PAIR_TILE (t + 1) - 1 along its last dim, the
    last tile padded with zeros (native.c WT_F32T: per input, the tile's outputs along the vector lanes;
    each output's sum over K in order). `linear` then takes the weight's N as `n`. Measured on a 2-core
    AMD EPYC Zen 4 against the plain layout's C kernel: docs/benchmarks.md."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 16:
        raise ValueError(f"pack_f32_tiles: a float32 [N, K] weight with K % 16 == 0, "
                         f"not {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % PAIR_TILE))
    return padded.reshape(-1, PAIR_TILE, k).transpose(1, 2).contiguous()


def halves_exact(scale: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor is an IEEE half exactly (4-bit scales and offsets that
    `pack_q4_pairs` may store as halves: GGUF's Q4_0 and Q4_1, models/quant4.py's quantizer)."""
    return bool(torch.equal(scale.half().float(), scale))


def pack_q4_pairs(
    weight: torch.Tensor, scale: torch.Tensor, half: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit weight (uint8 [N, K / 2] with float32 scales and offsets [N, K / Q4_GROUP, 2], as `linear`
    takes it; N a multiple of PAIR_TILE) in the layout `linear` reads as pairs (native.c WT_Q4P): uint16
    [N, K / 4] holding, per tile of PAIR_TILE outputs, group of Q4_GROUP inputs and four inputs 4u .. 4u + 3
    of it, 64 bytes, byte 4j + i holding the code of output j at input 4u + i in its low nibble and that of
    output 16 + j in its high one; and the scales as [N / PAIR_TILE, K / Q4_GROUP, 2, PAIR_TILE] (per
    tile and group the outputs' scales, then their offsets). The same codes and scales, reordered.
    `half`: the scales as float16 (native.c WT_Q4PH: a sixth fewer bytes, the same results), for scales
    that are halves exactly (`halves_exact`; else ValueError)."""
    n, half_k = weight.shape
    groups = 2 * half_k // Q4_GROUP
    if (weight.dtype != torch.uint8 or n % PAIR_TILE or half_k % (Q4_GROUP // 2)
            or scale.dtype != torch.float32 or scale.shape != (n, groups, 2)):
        raise ValueError(f"pack_q4_pairs: a 4-bit weight [N, K / 2] (N % {PAIR_TILE} == 0) with its scales "
                         f"[N, K / {Q4_GROUP}, 2], not {tuple(weight.shape)} {weight.dtype} and "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if half and not halves_exact(scale):
        raise ValueError("pack_q4_pairs: half scales asked of scales or offsets that are not all halves")
    bytes_ = weight.view(n, groups, Q4_GROUP // 2)
    codes = torch.cat([bytes_ & 0x0F, bytes_ >> 4], dim=-1).view(n, -1)  # [N, K], inputs in order
    quads = _tile_quads(codes)  # the tile's outputs 0-15 in the low nibbles, 16-31 in the high ones
    packed = (quads[:, :, : PAIR_TILE // 2] | (quads[:, :, PAIR_TILE // 2 :] << 4)).contiguous()
    scales = scale.view(n // PAIR_TILE, PAIR_TILE, groups, 2).permute(0, 2, 3, 1)
    scales = (scales.half() if half else scales).contiguous()
    return packed.view(torch.uint16).reshape(n, half_k // 2), scales


def weight_kind(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The storage kind the C kernels read a weight and its scale as (WT_* in native.c)."""
    if weight.dtype == torch.uint16 and scale is not None and scale.dtype == torch.float16:
        return WT_Q4_HALF
    if weight.dtype == torch.float32 and weight.dim() == 3:
        return WT_F32_TILES
    return WEIGHT_TYPES[weight.dtype]


def bf16_dot() -> bool:
    """Whether `linear`'s bfloat16 products use the CPU's bfloat16 dot products (AVX-512 BF16 pairs, or
    AMX tiles: `bf16_tiles`): then, for a few rows, they are faster than oneDNN's (no per-call
    dispatch; execution/native_modules.py PACKED_NATIVE_MAX_ROWS)."""
    return available() and bool(_library().ct_linear_bf16_dot())


def use_bf16_decode() -> bool:
    """Whether oneDNN-packed bfloat16 linears also take the C kernel for decode-sized steps (where
    `bf16_dot`, unless COTHINK_BF16_DECODE=0): faster decode, a second copy of those weights."""
    return BF16_DECODE and bf16_dot()


def helper_grains() -> int:
    """Grains of work (weight rows, items, key blocks) that threads other than the caller ran in this
    process so far: the products and the attentions split over the step's torch thread count (native.c)."""
    return _library().ct_helper_grains()


def supports(x: torch.Tensor) -> bool:
    """Whether `x` is a tensor the kernels read: on the CPU, float32 or bfloat16, last dim contiguous."""
    return x.is_cpu and x.dtype in DTYPES and x.stride(-1) == 1 and not x.requires_grad and available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of 2-D x (with `residual` added first) -> (normed, x + residual).

    The second result is x itself without a residual. Same math and roundings as models.RMSNorm."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    total = x if residual is None else torch.empty((rows, dim), dtype=x.dtype)
    res_ptr, res_stride = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    _library().ct_rms_norm(
        x.data_ptr(), x.stride(0), res_ptr, res_stride, total.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, int(zero_centred), DTYPES[x.dtype], _threads(),
    )
    return out, total


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, dim] (any token and head strides, the last dim contiguous:
    the q/k norms on views of the q/k/v projection) -> contiguous [T, heads, dim]; the math and
    roundings of `rms_norm`."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    _library().ct_head_rms_norm(
        x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), out.data_ptr(), tokens, heads, dim, eps,
        int(zero_centred), DTYPES[x.dtype],
    )
    return out


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x [T, heads * dim] (contiguous) and gate [T, heads, dim] of x's dtype
    (any token and head strides: the gate halves of Qwen3.5's q projection), sigmoid rounded to the
    dtype first, as torch computes `x * torch.sigmoid(gate)`."""
    tokens, heads, dim = gate.shape
    out = torch.empty_like(x)
    _library().ct_sigmoid_gate(
        x.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1), out.data_ptr(), tokens, heads, dim,
        DTYPES[x.dtype],
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for 2-D gate_up = [gate | up] (the fused gate/up projection's output)."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _library().ct_silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2, DTYPES[gate_up.dtype],
        _threads(),
    )
    return out


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates of b, a [T, heads] (one kernel dtype, the same row stride, a_log and
    dt_bias [heads] of it too): (g, beta) float32 [T, heads], g = -exp(a_log) softplus(a + dt_bias),
    beta = sigmoid(b) rounded to the dtype, as models.GatedDeltaNet computes them."""
    rows, heads = b.shape
    g, beta = torch.empty(rows, heads), torch.empty(rows, heads)
    _library().ct_gdn_gates(
        b.data_ptr(), a.data_ptr(), b.stride(0), a_log.data_ptr(), dt_bias.data_ptr(), g.data_ptr(),
        beta.data_ptr(), rows, heads, DTYPES[b.dtype],
    )
    return g, beta


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm: RMSNorm of x [T, heads, dim] (contiguous) per head, scaled by
    `weight` [dim], times silu(z) (z [T, heads, dim], heads contiguous within a token), with the
    roundings of models.GatedRMSNorm; all of one kernel dtype."""
    tokens, heads, dim = x.shape
    out = torch.empty_like(x)
    _library().ct_gated_rms_norm(
        x.data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(), out.data_ptr(), tokens, heads, dim, eps,
        DTYPES[x.dtype],
    )
    return out


@dataclass(frozen=True)
class GdnShape:
    """The sizes ct_gdn_token needs of a Gated DeltaNet layer."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    eps: float  # of the l2 normalisation of q and k


def gdn_token(
    history: torch.Tensor, row: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, shape: GdnShape,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of a Gated DeltaNet layer (execution/linear_state.py `run_tokens` for one row): the
    causal conv over `history` [W-1, C] and `row` [1, C] (model dtype) with `conv_weight` [C, W], the
    l2-normalised q/k split and the gated delta rule from `state` [HV, K, V] (float32, left as it
    is) with g, beta [1, HV] (float32). Returns (out [1, HV, V], new state), as ops/gdn.py to float
    rounding."""
    s = shape
    out = torch.empty(1, s.value_heads, s.value_dim)
    new = torch.empty_like(state)
    _library().ct_gdn_token(
        history.data_ptr(), history.stride(0), history.shape[0], row.data_ptr(), conv_weight.data_ptr(),
        row.shape[-1], s.key_heads, s.value_heads, s.key_dim, s.value_dim, g.data_ptr(), beta.data_ptr(),
        state.data_ptr(), new.data_ptr(), out.data_ptr(), s.eps, DTYPES[row.dtype],
    )
    return out, new


def store_kv(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    pool_k: torch.Tensor, pool_v: torch.Tensor,
) -> None:
    """Rotate keys k [T, H, D] with prepared tables cos/sin [T, 1, rot] (Rotary.prepare) and write them
    and v [T, H, D] to `slots` [T] of one layer's pool_k/pool_v [S, H, D]; the tokens split over the
    kernels' thread count, the same values whatever it."""
    t, heads, d = k.shape
    _library().ct_store_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), t, heads, d, cos.shape[-1],
        cos.data_ptr(), sin.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), DTYPES[k.dtype], _threads(),
    )


def decode_attention(
    q: torch.Tensor, plan: DecodePlan, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float,
    out: torch.Tensor, threads: int | None = None,
) -> None:
    """Attention of each single-query item of `plan` over its key runs (one softmax across runs, the
    query rotated per run) from q [T, Hq, D] into rows of out [T, Hq, D] float32; the items split
    over `threads` threads (default: torch's thread count)."""
    _, hq, d = q.shape
    _library().ct_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), hq, pool_k.shape[1], d, plan.cos.shape[-1], plan.items,
        plan.rows, plan.run_start, plan.key_start, plan.slots.data_ptr(),
        plan.cos.data_ptr(), plan.sin.data_ptr(), plan.groups, plan.group_start,
        plan.group_runs, plan.shared_of, pool_k.data_ptr(), pool_v.data_ptr(), scale,
        out.data_ptr(), DTYPES[q.dtype], _threads() if threads is None else threads,
    )


def prefill_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes these: built here (AVX-512 BF16) on a CPU without AMX tiles
    (with them, the MKL bfloat16 GEMMs inside torch's flash kernel run on the tiles; measured only
    without: AMD EPYC Zen 4, docs/benchmarks.md); all bfloat16 or all float32 on the CPU, heads
    contiguous within a row, a head size that is a multiple of 16, whole key heads per query group."""
    return (
        q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float32) and available()
        and _prefill_kernel_here()
        and all(x.is_cpu and x.stride(-1) == 1 and x.stride(1) == x.shape[-1] for x in (q, k, v))
        and q.shape[-1] % 16 == 0 and q.shape[1] % k.shape[1] == 0
    )


@cache
def _prefill_kernel_here() -> bool:
    """The library's answer, once per process (it is loaded once): asked per run and layer otherwise."""
    lib = _library()
    return bool(lib.ct_prefill_attention_built()) and not lib.ct_linear_tiles()


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, threads: int | None = None,
    *, rotation: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/attention.py `partial_attention`'s contract in the C kernel (where `prefill_attention_fits`):
    q [T, Hq, D] over k, v [L, Hkv, D] -> (out [T, Hq, D], lse [T, Hq]) float32; `causal`: row t sees
    keys 0..L-T+t. bfloat16: scores and the softmax in float32 (the products of bfloat16 pairs summed
    by VDPBF16PS), P V of P rounded to bfloat16 (as torch's flash kernel does) by VDPBF16PS too, each
    output within 2^-9 max|v| of the float32 one. float32: float32 FMAs throughout, P unrounded, within
    float32 rounding of the float64 math. Tasks over `threads` threads (default: torch's thread count),
    each computed whole by one. `rotation`: the run's (cos, sin) tables from Rotary.prepare ([T, 1, R]
    of q's dtype, R <= D): q comes unrotated and the kernel rotates it as `Rotary.apply_prepared`
    would, to the bit.
    `out`: a float32 [T, Hq, D] tensor (rows may be a view into a larger one) to write into."""
    t, hq, d = q.shape
    if out is None:
        out = torch.empty(t, hq, d, dtype=torch.float32)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"prefill_attention: out must be a contiguous float32 {tuple(q.shape)}, "
                         f"not {tuple(out.shape)} {out.dtype}")
    lse = torch.empty(t, hq, dtype=torch.float32)
    cos = sin = None
    rot = 0
    if rotation is not None:
        cos, sin = (x.reshape(t, -1).contiguous() for x in rotation)
        rot = cos.shape[1]
        if cos.dtype != q.dtype or sin.shape != cos.shape or rot > d or rot % 2:
            raise ValueError(f"prefill_attention: rotation tables [T, 1, R <= {d}] of {q.dtype}, "
                             f"not {tuple(rotation[0].shape)} {rotation[0].dtype}")
    _library().ct_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), rot,
        t, hq, k.shape[1], d, k.shape[0], int(causal), scale, out.data_ptr(), lse.data_ptr(),
        int(q.dtype == torch.bfloat16), _threads() if threads is None else threads,
    )
    return out, lse


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, scale: torch.Tensor | None = None,
    float_out: bool = False, n: int | None = None,
) -> torch.Tensor:
    """x W^T (+ b) for 2-D x [M, K] and a contiguous weight [N, K], K a multiple of 16 (`linear_fits`):
    a few rows at a time over the weight, bound by reading it once per 8 rows. The weight is of x's
    dtype, or int8 with a bfloat16 `scale` [N] per row (models/quantize.py): then x is rounded to
    bfloat16 and each output is its sum times the scale rounded to bfloat16, as torch's int8 kernel
    (`_weight_int8pack_mm`) computes it, before the bias (of x's dtype); or 4-bit, uint8 [N, K / 2]
    with float32 `scale` [N, K / 32, 2] (models/quant4.py `Int4Weights`): the product with the
    dequantized weight within float32 rounding, rounded to x's dtype once, after the bias; or a
    bfloat16 weight in pairs (int32 [N, K / 2] from `pack_pairs`, x bfloat16, where `bf16_pairs`), or an
    int8 one (int16 [N, K / 2], K a multiple of 32, with its scale: the int8 product above of x taken as
    8-bit codes per group of 32, models/quantize.py `quantize_activations`, which states its bound).
    A 4-bit weight in pairs (uint16 [N, K / 4] with its float32 or float16 scales from `pack_q4_pairs`, x
    bfloat16, where `bf16_pairs`): x taken as 8-bit codes per group of 32 (models/quantize.py
    `quantize_activations`, to the bit), the 4-bit product above within that bound plus
    models/quantize.py `activation_bound` (either scales, the same results). A float32 weight in tiles
    ([ceil(N / 32), K, 32] from `pack_f32_tiles`, x float32, where `f32_tiles`; `n` its N, by default
    every output of its tiles): each output's sum in another fixed order, within float32 rounding of the
    plain weight's.
    `float_out`: the result as float32, equal to `linear(...).float()` without the widening pass."""
    m, k = x.shape
    tiled = weight.dim() == 3  # float32 in tiles
    n_stored = weight.shape[0] * PAIR_TILE if tiled else weight.shape[0]
    n = n_stored if n is None else n
    # weights per stored element
    packed = {torch.uint16: 4, torch.uint8: 2, **dict.fromkeys(PAIRS_OF.values(), 2)}.get(weight.dtype, 1)
    if tiled:
        kind_fits = (scale is None and x.dtype == weight.dtype == torch.float32
                     and weight.shape[2] == PAIR_TILE and f32_tiles())
    elif weight.dtype == torch.uint16:
        tiles = (n // PAIR_TILE, k // Q4_GROUP, 2, PAIR_TILE)
        kind_fits = (scale is not None and scale.dtype in (torch.float32, torch.float16)
                     and scale.shape == tiles and x.dtype == torch.bfloat16 and n % PAIR_TILE == 0
                     and k % Q4_GROUP == 0 and bf16_pairs())
    elif weight.dtype == torch.int32:
        kind_fits = scale is None and x.dtype == torch.bfloat16 and n % PAIR_TILE == 0 and bf16_pairs()
    elif weight.dtype == torch.int16:
        kind_fits = (scale is not None and scale.dtype == torch.bfloat16 and scale.shape == (n,)
                     and n % PAIR_TILE == 0 and k % Q4_GROUP == 0 and bf16_pairs())
    elif weight.dtype == torch.int8:
        kind_fits = scale is not None and scale.dtype == torch.bfloat16 and scale.shape == (n,)
    elif weight.dtype == torch.uint8:
        kind_fits = (scale is not None and scale.dtype == torch.float32 and k % Q4_GROUP == 0
                     and scale.shape == (n, k // Q4_GROUP, 2))
    else:
        kind_fits = scale is None and weight.dtype == x.dtype
    # C reads k columns, the scales and the bias in x's dtype blindly
    bias_fits = bias is None or (bias.dtype == x.dtype and bias.shape == (n,))
    n_fits = n_stored - PAIR_TILE < n <= n_stored if tiled else n == n_stored  # (only tiles are padded)
    if not (kind_fits and bias_fits and n_fits) or k != weight.shape[1] * packed or x.stride(1) != 1:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} (or its rows are not contiguous, or its scale or bias)")
    y = torch.empty((m, n), dtype=torch.float32 if float_out else x.dtype)
    _library().ct_linear(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, DTYPES[x.dtype],
        weight_kind(weight, scale), int(float_out), _threads(),
    )
    return y


def linear_fits(weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes this weight and bias: contiguous, K % 16 == 0, of a kernel dtype (the
    bias too), or int8 with a contiguous bfloat16 `scale` per row, or 4-bit (uint8 [N, K / 2]) with
    contiguous float32 group scales and offsets [N, K / 32, 2] (the bias then of a kernel dtype), or a
    weight in pairs (`pack_pairs`, where `bf16_pairs`): bfloat16 (int32; the bias bfloat16) or int8
    (int16, with its scale as for int8) or 4-bit (uint16 with its float32 or float16 scales,
    `pack_q4_pairs`; the bias bfloat16), or float32 in tiles (`pack_f32_tiles`, where `f32_tiles`)."""
    if weight.dim() == 3:
        return (
            weight.device.type == "cpu" and f32_tiles() and weight.dtype == torch.float32
            and weight.is_contiguous() and weight.shape[2] == PAIR_TILE and weight.shape[1] % 16 == 0
            and scale is None and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32))
        )
    if weight.dtype == torch.uint16:
        n, k = weight.shape[0], 4 * weight.shape[1] if weight.dim() == 2 else 0
        return (
            weight.device.type == "cpu" and bf16_pairs() and weight.dim() == 2 and weight.is_contiguous()
            and n % PAIR_TILE == 0 and k % Q4_GROUP == 0 and scale is not None
            and scale.dtype in (torch.float32, torch.float16) and scale.is_contiguous()
            and scale.shape == (n // PAIR_TILE, k // Q4_GROUP, 2, PAIR_TILE)
            and (bias is None or (bias.is_contiguous() and bias.dtype == torch.bfloat16))
        )
    if weight.dtype in (torch.int32, torch.int16):
        int8 = weight.dtype == torch.int16
        bias_dtypes = DTYPES if int8 else (torch.bfloat16,)
        return (
            weight.device.type == "cpu" and bf16_pairs() and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[0] % PAIR_TILE == 0 and (2 * weight.shape[1]) % (Q4_GROUP if int8 else 16) == 0
            and (scale is None if not int8 else (
                scale is not None and scale.dtype == torch.bfloat16 and scale.is_contiguous()
                and scale.shape == weight.shape[:1]))
            and (bias is None or (bias.is_contiguous() and bias.dtype in bias_dtypes))
        )
    if scale is None:
        kind_fits = supports(weight) and (bias is None or bias.dtype == weight.dtype)
    elif weight.dtype == torch.uint8:
        return (
            weight.device.type == "cpu" and available() and weight.dim() == 2 and weight.is_contiguous()
            and scale.dtype == torch.float32 and scale.is_contiguous()
            and scale.shape == (weight.shape[0], 2 * weight.shape[1] // Q4_GROUP, 2)
            and (2 * weight.shape[1]) % Q4_GROUP == 0
            and (bias is None or (bias.dtype in DTYPES and bias.is_contiguous()))
        )
    else:
        kind_fits = (
            weight.dtype == torch.int8 and weight.device.type == "cpu" and available()
            and scale.dtype == torch.bfloat16 and scale.is_contiguous() and scale.shape == weight.shape[:1]
            and (bias is None or bias.dtype in DTYPES)
        )
    return (
        kind_fits and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 16 == 0
        and (bias is None or bias.is_contiguous())
    )


def q4_dequant(weight: torch.Tensor, scale: torch.Tensor, rows: slice, out: torch.Tensor) -> None:
    """Rows `rows` of a 4-bit weight (uint8 [N, K / 2], float32 group scales and offsets
    [N, K / 32, 2], as `linear` takes them) dequantized into out [rows, K], float32 or bfloat16:
    q * scale + offset, to the bit the torch reference's values (models/quant4.py
    `Int4Weights.dequantize`), rounded to bfloat16 for a bfloat16 out."""
    start, stop, _ = rows.indices(weight.shape[0])
    k = 2 * weight.shape[1]
    if out.dtype not in DTYPES or not out.is_contiguous() or out.shape != (stop - start, k):
        raise ValueError(f"q4_dequant: out {tuple(out.shape)} {out.dtype} is not float32 or bfloat16 "
                         f"[{stop - start}, {k}]")
    _library().ct_q4_dequant(weight.data_ptr(), scale.data_ptr(), out.data_ptr(), DTYPES[out.dtype], start,
                             stop, k, _threads())


@dataclass(frozen=True)
class LayerShape:
    """The sizes ct_decode_layers needs of a decoder: the attention's, and (hybrid models) Gated
    DeltaNet's as `gdn` with its conv kernel width."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    gated: bool = False  # Qwen3.5's attention output gate
    zero_centred: bool = False  # Qwen3.5's norms
    gdn: GdnShape | None = None
    conv_kernel: int = 0

    @cached_property
    def struct(self) -> CtShape:
        """The sizes as ct_decode_layers reads them."""
        g = self.gdn or GdnShape(0, 0, 0, 0, 0.0)
        return CtShape(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            intermediate=self.intermediate, gated=int(self.gated), zero_centred=int(self.zero_centred),
            key_heads=g.key_heads, value_heads=g.value_heads, key_dim=g.key_dim, value_dim=g.value_dim,
            conv_kernel=self.conv_kernel, eps=self.eps, l2_eps=g.eps,
        )


def decode_layers(
    x: torch.Tensor, layers: ctypes.Array[CtLayer], shape: LayerShape, pool_k: torch.Tensor,
    pool_v: torch.Tensor, store_slots: torch.Tensor, key_cos: torch.Tensor, key_sin: torch.Tensor,
    plan: DecodePlan, scale: float, weights: int, linear_io: ctypes.Array[CtLinearIO] | None = None,
    head: CtHead | None = None,
) -> None:
    """Every decoder layer of a decode step in one call, x [T, hidden] (contiguous) updated in place:
    per layer the calls of the per-module path (norm, mixer, norm with the residual, gate/up `linear`,
    `silu_mul`, down `linear`, residual; the mixer an attention of `linear`, `head_rms_norm`,
    `store_kv`, `decode_attention`, `sigmoid_gate`, or a Gated DeltaNet of `linear`, `gdn_gates`,
    `gdn_token`, `gated_rms_norm`), so results are those of that path to the bit. `layers` holds each
    layer's tensors (its linears' weights of storage kind `weights`, `weight_kind`: x's dtype's, int8,
    4-bit, or in pairs); an
    attention layer's keys are pool_k[kv_slot], pool_v[kv_slot] [S, Hkv, D], this step's go to
    `store_slots` rotated by key_cos/key_sin and the items attend as `plan`; a Gated DeltaNet layer
    reads and writes the buffers of its entry of `linear_io`. With a `head`, the same call then writes
    every row's float32 logits as the per-module path makes them (`rms_norm` with the final norm's
    weight, then `linear(..., float_out=True)` with the lm_head). Every tensor they point to must
    outlive the call."""
    keys = CtStepKeys(
        pool_k=pool_k.data_ptr(), pool_v=pool_v.data_ptr(), pool_layer=pool_k.stride(0),
        store_slots=store_slots.data_ptr(), key_cos=key_cos.data_ptr(), key_sin=key_sin.data_ptr(),
        items=plan.items, rows=plan.rows, run_start=plan.run_start,
        key_start=plan.key_start, slots=plan.slots.data_ptr(), cos=plan.cos.data_ptr(),
        sin=plan.sin.data_ptr(), groups=plan.groups, group_start=plan.group_start,
        group_runs=plan.group_runs, shared_of=plan.shared_of, rot=plan.cos.shape[-1],
        scale=scale,
    )
    _library().ct_decode_layers(
        x.data_ptr(), x.shape[0], len(layers), layers, ctypes.byref(shape.struct), ctypes.byref(keys),
        linear_io, None if head is None else ctypes.byref(head), DTYPES[x.dtype], weights, _threads(),
    )


# Keys from which a run several items read (a shared block) is attended once for all of them (native.c
# shared_tasks: the prefill kernel's packing, softmax and bfloat16 P V over the readers' query rows).
# Measured on a 2-core Zen 4 (SmolLM2's heads, bfloat16, ms per layer, per item / shared, two threads):
# 32 readers of 64 keys (16 of their own) 0.069 / 0.062, of 256 (32 of their own) 0.171 / 0.113, of 1024
# 0.554 / 0.280; 4 readers of 128 keys 0.017 / 0.017, of 512 0.043 / 0.040; 2 readers of 256 0.015 /
# 0.016, of 2048 0.077 / 0.080: one chunk of keys and a second reader make it pay.
SHARED_MIN_KEYS = 64


class DecodePlan:
    """The key runs of a step's single-query items in the flat arrays ct_decode_attention reads
    (layer-independent: built once per step). `runs[i]` lists item i's runs as (slots [L], cos, sin)
    with cos/sin [1, 1, rot] prepared tables in the pool's dtype, or (slots, cos, sin, shared): runs of
    several items with the same `shared` key (a block they all read, the same slots) and at least
    `shared_min_keys` keys (default SHARED_MIN_KEYS) form a group that the kernel attends once for all
    its readers (bfloat16 pools where the CPU has AVX-512 BF16: P rounded to bfloat16 for P V, as the
    prefill kernel and torch's flash kernel round it; each output within 2^-9 max|v| of attending the
    run per item, plus float32 rounding)."""

    def __init__(self, rows: list[int], runs: list[list[tuple[Any, ...]]],
                 shared_min_keys: int | None = None):
        flat = [run for item in runs for run in item]
        lengths = [run[0].numel() for run in flat]
        self.items = len(rows)
        # the index arrays in one tensor (a step's planning pays per tensor built)
        run_start = [0, *accumulate(len(item) for item in runs)]
        least = SHARED_MIN_KEYS if shared_min_keys is None else shared_min_keys
        readers: dict[Any, list[int]] = {}
        for r, run in enumerate(flat):
            if len(run) > 3 and run[3] is not None and run[0].numel() >= least:
                readers.setdefault(run[3], []).append(r)
        groups = [group for group in readers.values() if len(group) > 1]
        shared_of = [-1] * len(flat)
        for reader, r in enumerate(r for group in groups for r in group):
            shared_of[r] = reader
        group_start = [0, *accumulate(len(group) for group in groups)]
        self.index = torch.tensor([*rows, *run_start, 0, *accumulate(lengths), *group_start,
                                   *(r for group in groups for r in group), *shared_of], dtype=torch.long)
        # the arrays' addresses in it (what the kernels take: no tensor a part)
        starts = accumulate([len(rows), len(run_start), len(flat) + 1, len(group_start), group_start[-1]],
                            initial=0)
        (self.rows, self.run_start, self.key_start, self.group_start, self.group_runs,
         self.shared_of) = (self.index.data_ptr() + self.index.element_size() * start for start in starts)
        self.groups = len(groups)
        # key reads the grouping saves: each grouped run read once rather than once per reader
        self.grouped_reads = sum((len(group) - 1) * lengths[group[0]] for group in groups)
        self.slots = _joined([run[0] for run in flat]).to(torch.long)  # (the store's slots are long already)
        self.cos = _joined([run[1] for run in flat]).reshape(len(flat), -1)  # a row per run: its query's
        self.sin = _joined([run[2] for run in flat]).reshape(len(flat), -1)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along dim 0, contiguous (one part: itself where it already is)."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

