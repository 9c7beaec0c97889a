"""Kernel inputs from a Workload and a seed, kernel-parameter packing, and output comparison.

Host-side numpy only, so the GPU worker, the stand-in worker in the tests and the tests themselves share it.
numpy has no bfloat16: those buffers are stored as their raw 16-bit patterns (uint16) and decoded to float
for comparison.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from forecaster_mcp.models import BufferArg, Correctness, ScalarArg, Workload

# Storage dtype on the host and the device, per workload dtype.
STORAGE: dict[str, np.dtype[np.generic]] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
# struct format characters for kernel parameters; 16-bit floats travel as their bit patterns.
PARAM_CHARS: dict[str, str] = {
    "float16": "H",
    "bfloat16": "H",
    "float32": "f",
    "float64": "d",
    "int8": "b",
    "int16": "h",
    "int32": "i",
    "int64": "q",
    "uint8": "B",
    "uint16": "H",
    "uint32": "I",
    "uint64": "Q",
    "bool": "?",
}
_FLOATS = {"float16", "bfloat16", "float32", "float64"}
# Random integers stay small so index-like arguments stay in range and int8 does not wrap.
_INT_HIGH = 64

HostArg = np.ndarray | int | float | bool


def is_float(dtype: str) -> bool:
    return dtype in _FLOATS


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16); NaN stays NaN."""
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    bits = f32.view(np.uint32)
    # In place on one uint32 temporary (inputs can be gigabytes). It cannot wrap for a number: only NaNs with
    # the sign bit set lie within 0x8000 of 2**32, and NaNs are set below.
    acc = (bits >> 16) & 1
    acc += 0x7FFF
    acc += bits
    acc >>= 16
    rounded = acc.astype(np.uint16)
    del acc
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _buffer(arg: BufferArg, rng: np.random.Generator) -> np.ndarray:
    storage = STORAGE[arg.dtype]
    shape = tuple(arg.shape)
    n = arg.elements
    if arg.init == "zeros":
        return np.zeros(shape, dtype=storage)
    if arg.init == "ones":
        if arg.dtype == "bfloat16":
            return float32_to_bfloat16_bits(np.ones(shape, dtype=np.float32))
        return np.ones(shape, dtype=storage)
    if arg.init == "arange":
        if arg.dtype == "float16":
            # float16 holds every integer up to 2048 exactly and none past 65504 (inf from there on, and inf
            # matching inf checks nothing): the ramp wraps at 2048.
            return np.resize(np.arange(2048, dtype=np.float16), shape)
        if not is_float(arg.dtype):
            # Integer types wrap modulo their range: an index pattern, not a value range, is what arange is for.
            # One period repeated where it is short, so the ramp costs no wider temporary than the buffer.
            bits = 8 * np.dtype(storage).itemsize
            if arg.dtype != "bool" and bits <= 16 and n > 2**bits:
                return np.resize(np.arange(2**bits, dtype=np.int64).astype(storage), shape)
            return np.arange(n, dtype=np.int64).astype(storage).reshape(shape)
        ramp = np.arange(n, dtype=np.float64 if arg.dtype == "float64" else np.float32).reshape(shape)
        return float32_to_bfloat16_bits(ramp) if arg.dtype == "bfloat16" else ramp.astype(storage, copy=False)
    if arg.dtype == "bool":
        return rng.integers(0, 2, size=shape, dtype=np.bool_)
    if is_float(arg.dtype):
        # Drawn at the precision they are stored in (below float64, float32 draws): a float64 draw then a cast
        # costs ten times as much, and input generation is charged time on large workloads.
        draw = np.float64 if arg.dtype == "float64" else np.float32
        if arg.init == "random_normal":
            values = rng.standard_normal(size=shape, dtype=draw)
        else:
            values = rng.random(size=shape, dtype=draw)
        if arg.dtype == "bfloat16":
            return float32_to_bfloat16_bits(values)
        return values if values.dtype == storage else values.astype(storage)
    if arg.init == "random_normal":
        info = np.iinfo(arg.dtype)
        ints = rng.standard_normal(size=shape, dtype=np.float32)
        ints *= 8.0
        np.rint(ints, out=ints)
        np.clip(ints, info.min, info.max, out=ints)
        return ints.astype(storage)
    return rng.integers(0, _INT_HIGH, size=shape, dtype=storage)


def draw_scratch_bytes(arg: BufferArg) -> int:
    """Bytes `_buffer` needs beside the buffer itself while it draws it (its largest temporaries): a float32
    draw for narrow floats and normal integers, a uint32 accumulator on top for bfloat16, an int64 ramp for
    integer arange. For the host-memory check before a measurement."""
    dtype, init, n = arg.dtype, arg.init, arg.elements
    if init == "zeros" or (init == "ones" and dtype != "bfloat16"):
        per = 0
    elif dtype == "bfloat16":
        per = 10  # float32 values, then a uint32 accumulator beside them
    elif init == "arange":
        short = dtype not in ("bool",) and not is_float(dtype) and np.dtype(STORAGE[dtype]).itemsize <= 2
        per = 0 if is_float(dtype) or short else 8
    elif dtype == "float16" or (init == "random_normal" and not is_float(dtype) and dtype != "bool"):
        per = 4
    else:
        per = 0
    return n * per


def scalar_param(arg: ScalarArg) -> int | float | bool:
    """The value to pack for a scalar kernel parameter (16-bit floats as bit patterns)."""
    if arg.dtype == "float16":
        return int(np.array(arg.value, dtype=np.float16).view(np.uint16))
    if arg.dtype == "bfloat16":
        return int(float32_to_bfloat16_bits(np.array([arg.value], dtype=np.float32))[0])
    if arg.dtype == "bool":
        return bool(arg.value)
    if is_float(arg.dtype):
        return float(arg.value)
    info = np.iinfo(arg.dtype)
    value = int(arg.value)
    if not info.min <= value <= info.max:
        raise ValueError(f"scalar {arg.name}={value} does not fit {arg.dtype}")
    return value


def generate_inputs(workload: Workload, seed: int) -> list[HostArg]:
    """One host value per workload argument: arrays for buffers (every intent), packed values for scalars.

    The same (workload, seed) always gives the same values; each buffer draws from a stream keyed by its
    name, so adding or reordering arguments does not change the others.
    """
    out: list[HostArg] = []
    for arg in workload.args:
        if isinstance(arg, BufferArg):
            rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, zlib.crc32(arg.name.encode())])
            out.append(np.ascontiguousarray(_buffer(arg, rng)))
        else:
            out.append(scalar_param(arg))
    return out


def param_format(workload: Workload) -> str:
    """struct format of the kernel's parameter list: P per buffer pointer, a type char per scalar."""
    return "".join("P" if isinstance(a, BufferArg) else PARAM_CHARS[a.dtype] for a in workload.args)


def param_sizes(workload: Workload) -> list[int]:
    """Expected byte size of each kernel parameter (8 for a device pointer)."""
    from forecaster_mcp.models import DTYPE_BYTES

    return [8 if isinstance(a, BufferArg) else DTYPE_BYTES[a.dtype] for a in workload.args]


def output_names(workload: Workload) -> list[str]:
    return [a.name for a in workload.args if isinstance(a, BufferArg) and a.intent in ("out", "inout")]


def as_float64(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(values).astype(np.float64)
    return np.asarray(values).astype(np.float64)


# ---------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    passed: bool
    max_abs_error: float
    max_rel_error: float
    detail: str | None = None
    buffers: int = 1  # how many buffers were compared (0: there was nothing to compare)


def _fmt_index(flat: int, shape: Sequence[int]) -> str:
    idx = np.unravel_index(flat, tuple(shape))
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


# Buffers are compared a slice at a time: whole-array float64 temporaries of a 64M-element output cost
# seconds of page faults (charged time, since the worker holds the device while it checks).
_COMPARE_CHUNK = 1 << 20


@dataclass
class _Mismatches:
    """Counts and first positions of each kind of disagreement, accumulated over slices."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {"nan": 0, "inf": 0, "tol": 0})
    first: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, offset: int, where: np.ndarray) -> None:
        if where.size:
            self.counts[kind] += int(where.size)
            self.first.setdefault(kind, offset + int(where[0]))


def _compare_slice(
    a: np.ndarray, b: np.ndarray, offset: int, atol: float, rtol: float, m: _Mismatches
) -> None:
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
        scale = np.abs(b)
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        m.add("nan", offset, np.flatnonzero(nan_a != nan_b))
        inf_any = (np.isinf(a) | np.isinf(b)) & ~(nan_a | nan_b)
        m.add("inf", offset, np.flatnonzero(inf_any & (a != b)))
        diff[~finite] = 0.0
        scale[~finite] = 0.0
    rel = np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0)
    m.max_abs = max(m.max_abs, float(diff.max()))  # slices are never empty
    m.max_rel = max(m.max_rel, float(rel.max()))
    m.add("tol", offset, np.flatnonzero(diff > atol + rtol * scale))


def _compare_int_slice(
    a: np.ndarray, b: np.ndarray, offset: int, atol: float, rtol: float, m: _Mismatches
) -> None:
    """Integers compared exactly (through float64, values past 2**53 that differ by one would compare equal),
    within atol alone: a relative tolerance lets a wrong index or count through (123579 for 123456 at 1e-3)."""
    # Signed (or mixed) values as int64: the difference of two of them is exact modulo 2**64, read as unsigned.
    wide = np.uint64 if a.dtype.kind == "u" and b.dtype.kind == "u" else np.int64
    wa, wb = a.astype(wide), b.astype(wide)
    bigger = wa >= wb
    ua, ub = wa.view(np.uint64), wb.view(np.uint64)
    with np.errstate(over="ignore"):
        diff_exact = np.where(bigger, ua - ub, ub - ua)
    differs = diff_exact != 0
    diff = diff_exact.astype(np.float64)
    diff[differs & (diff < 1.0)] = 1.0  # never rounds a real difference to zero
    scale = np.abs(b.astype(np.float64))
    rel = np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0)
    m.max_abs = max(m.max_abs, float(diff.max()))
    m.max_rel = max(m.max_rel, float(rel.max()))
    del rtol
    m.add("tol", offset, np.flatnonzero(differs & (diff > atol)))


# One unit in the last place, relative: bfloat16 keeps 8 significant bits, float16 11.
_RTOL_FLOOR = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def compare_buffer(
    name: str, dtype: str, got: np.ndarray, want: np.ndarray, atol: float, rtol: float
) -> Comparison:
    """|got - want| <= atol + rtol * |want| elementwise; NaN positions must match and infinities must match
    in position and sign. Errors are over elements where both are finite. For a half-precision output an
    rtol below one unit in its last place (the 1e-3 default is below bfloat16's 2^-7) is raised to that unit:
    a correct kernel that rounds once differently would fail otherwise."""
    rtol = max(rtol, _RTOL_FLOOR.get(dtype, 0.0))
    if got.shape != want.shape:
        return Comparison(
            False, np.inf, np.inf, f"{name}: shape {got.shape} differs from reference {want.shape}"
        )
    flat_got, flat_want = np.ravel(got), np.ravel(want)
    m = _Mismatches()
    exact = dtype != "bfloat16" and flat_got.dtype.kind in "iub" and flat_want.dtype.kind in "iub"
    for lo in range(0, flat_got.size, _COMPARE_CHUNK):
        hi = lo + _COMPARE_CHUNK
        if exact:
            _compare_int_slice(flat_got[lo:hi], flat_want[lo:hi], lo, atol, rtol, m)
            continue
        a = as_float64(flat_got[lo:hi], dtype)
        b = as_float64(flat_want[lo:hi], dtype)
        _compare_slice(a, b, lo, atol, rtol, m)
    for kind, why in (
        ("nan", " (NaN positions differ at {n} elements)"),
        ("inf", " (infinities differ at {n} elements)"),
        ("tol", "; {n} of {size} elements outside atol={atol:g} + rtol={rtol:g}*|reference|"),
    ):
        if m.counts[kind]:
            i = m.first[kind]
            if exact:
                shown_a, shown_b = str(int(flat_got[i])), str(int(flat_want[i]))
            else:
                shown_a = f"{float(as_float64(flat_got[i : i + 1], dtype)[0]):.9g}"
                shown_b = f"{float(as_float64(flat_want[i : i + 1], dtype)[0]):.9g}"
            return Comparison(
                False,
                m.max_abs,
                m.max_rel,
                f"{name}{_fmt_index(i, got.shape)}: got {shown_a}, reference {shown_b}"
                + why.format(n=m.counts[kind], size=flat_got.size, atol=atol, rtol=rtol),
            )
    return Comparison(True, m.max_abs, m.max_rel)


def compare_outputs(
    workload: Workload,
    got: Mapping[str, np.ndarray],
    want: Mapping[str, np.ndarray],
    atol: float,
    rtol: float,
) -> Comparison:
    """Compare every out/inout buffer; the first failing buffer's detail is reported."""
    max_abs = 0.0
    max_rel = 0.0
    failure: str | None = None
    buffers = 0
    for arg in workload.args:
        if not isinstance(arg, BufferArg) or arg.intent not in ("out", "inout"):
            continue
        buffers += 1
        c = compare_buffer(arg.name, arg.dtype, got[arg.name], want[arg.name], atol, rtol)
        max_abs = max(max_abs, c.max_abs_error)
        max_rel = max(max_rel, c.max_rel_error)
        if not c.passed and failure is None:
            failure = c.detail
    return Comparison(failure is None, max_abs, max_rel, failure, buffers)


def correctness_of(
    comparisons: Sequence[Comparison], note: str | None = None, seeds: Sequence[int] = ()
) -> Correctness:
    """Merge the comparisons of several input sets into the public Correctness record. Comparisons of no
    buffer at all checked nothing: never reported as a pass. With the input sets' `seeds`, a failure names
    the set and seed it failed on (what a caller needs to reproduce it)."""
    if comparisons and not any(c.buffers for c in comparisons):
        return Correctness(
            checked=False,
            passed=None,
            input_sets=0,
            detail="nothing compared: the workload has no out or inout buffer (mark the kernel's outputs)",
        )
    if not comparisons:
        return Correctness(checked=False, passed=None, input_sets=0, detail=note)
    failed = [i for i, c in enumerate(comparisons) if not c.passed]
    detail = comparisons[failed[0]].detail if failed else note
    if failed and len(seeds) == len(comparisons):
        where = f"input set {failed[0] + 1} of {len(comparisons)}, seed {seeds[failed[0]]}"
        detail = f"{detail} ({where})" if detail else where
    return Correctness(
        checked=True,
        passed=not failed,
        max_abs_error=max(c.max_abs_error for c in comparisons),
        max_rel_error=max(c.max_rel_error for c in comparisons),
        input_sets=len(comparisons),
        detail=detail,
    )
