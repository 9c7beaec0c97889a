"""The local forecaster: an online Gaussian-process model per kernel family, plus a static-feature prior.

Candidates that differ only in tuning parameters (`defines`, launch) are the everyday case of autotuning.
For those, every stored measurement of the family on the same hardware and workload trains a Gaussian
process on log2 runtime over the encoded tuning parameters (`ParamEncoder`: log-scaled numbers, one-hot
strings, alignment indicators such as "power of two", threads per block). Its covariance is a Matern 5/2
over all parameters jointly (interactions) plus an additive part (main effects that carry over to untried
regions), one lengthscale per parameter shared by both, hyperparameters by maximum a-posteriori marginal
likelihood (L-BFGS in numpy; refits only when the family's stored points change, warm-started from the
last fit, hyperparameters on at most MAX_FIT_POINTS points). A pair's log2 speedup is then the
difference of two runtime beliefs: a measured runtime where one exists, else the GP's predictive
distribution, with the GP's covariance between the two kernels (their model errors are correlated, so the
difference is more certain than either runtime). The GP's belief is mixed with that of the same fit at
shorter length scales (a stand-in for uncertainty in the length scales themselves: wider away from the
measured basin, unchanged near it). Predictive spread is rescaled by leave-one-out residuals
and given a heavier tail: on held-out members about one error in ten lies beyond two standard deviations.
The chance that a member fails (compile or launch error) is a kernel-weighted average of stored outcomes.

With too few measurements, or for two unrelated kernels, a heuristic over static features (occupancy,
spills, vector loads, shared-memory tiling, tensor cores, waves) gives a mild shift with wide uncertainty.

Speedup bins are conditional on both kernels running; the chance that the candidate fails to compile or
run is reported separately in `extras["p_fail"]` (a kernel measured as failed puts all its mass on the
slowest bin instead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
import numpy as np
from numpy.typing import NDArray

from forecaster_mcp import bins
from forecaster_mcp.forecast.base import MAX_CONFIDENCE, BinForecast, PairQuery, PartialForecast
from forecaster_mcp.forecast.features import (
    MAX_ANCHORS,
    PYTHON_LANGUAGES,
    SIBLING_MAX_CONFIDENCE,
    StaticFeatures,
    anchored_log2_ms,
    kernel_features,
    kernel_source_features,
    prior_shift,
    sibling_log2_ms,
    sibling_spread,
    with_resources,
)
from forecaster_mcp.forecast.ptxas import PtxasError, PtxasUsage, measured_entry, missing_header
from forecaster_mcp.models import C_INT, C_INT_SUFFIX, Kernel, Launch, c_integer
from forecaster_mcp.store.db import AnchorPoint, FamilyPoint

Array = NDArray[np.float64]

VERSION = "1.0"
# Fewer ok measurements than this and the family model is not trusted; the static prior answers instead.
MIN_FAMILY_POINTS = 4
# Hyperparameters are fitted on at most this many points (the posterior still uses all of them, up to
# MAX_POSTERIOR_POINTS): fitting is O(n^3) per optimiser step, the posterior is one factorisation.
MAX_FIT_POINTS = 200
MAX_POSTERIOR_POINTS = 1500
# Runtimes are clamped to 2**±60 ms, a range no kernel leaves (see fit_family).
LOG2_MS_LIMIT = 60.0
# A measured runtime is still a noisy sample: floor and cap of its log2 standard deviation.
MEASURED_SD_FLOOR_LOG2 = 0.01
MEASURED_SD_CAP_LOG2 = 0.1
# Tail: the predictive distribution is a two-component scale mixture of normals (heavier than a normal).
TAIL_WEIGHT = 0.1
TAIL_SCALE = 2.5
# The prior path compiles with nvcc only when a call brings at most this many kernels it has not seen.
MAX_PTXAS_PER_CALL = 8
# The chance a kernel fails to compile or run when this server's nvcc reported an error in its source, compiled
# for the GPU's own architecture: the measurer compiles with the same nvcc for the same architecture, and an
# error there is all but certain to recur. Not 1: the measurement may be made elsewhere (another toolkit, a
# device other than the one named), and the compile here is device code only.
P_FAIL_COMPILE_ERROR = 0.98
# The same for an error found compiling for a stand-in architecture (an unknown GPU, or one outside this nvcc's
# window, see ptxas.stand_in_arch): a syntax error recurs on any architecture, an intrinsic or instruction that
# one architecture lacks may not. A header this server's nvcc cannot find is no compile error of the kernel's
# at all (`missing_header`).
P_FAIL_COMPILE_ERROR_STAND_IN = 0.9
# The chance a kernel fails that uses tensor-core (matrix) instructions on a GPU without them (Pascal and older,
# the MI50, RDNA2; GpuSpec.tensor_cores): CUDA declares wmma only from sm_70 on (crt/mma.h), mma.sync, ldmatrix,
# wgmma and tcgen05 are PTX of sm_70 and later, and clang refuses MFMA and WMMA builtins on an ISA without them.
# ptxas, run for a stand-in newer than such a GPU (nvcc 13 starts at sm_75), compiles them. Read from the source's
# text, not a compiler's error: as sure as a stand-in's compile error. A source that tests the architecture
# (_ARCH_TEST) may have a path without them, and is not counted.
P_FAIL_NO_MATRIX_UNITS = 0.9
_ARCH_TEST = re.compile(r"__CUDA_ARCH|\b__gfx[0-9a-f]+__\b|__has_builtin")
_SQRT5 = math.sqrt(5.0)
_OK_STATUS = "ok"

log = logging.getLogger(__name__)


class FamilyHistory(Protocol):
    """Where the family model's measurements come from (the Store implements it): the latest per kernel,
    oldest first."""

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]: ...


# ---------------------------------------------------------------- encoding tuning parameters


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range (pydantic accepts 10**400)
            return None
        return number if math.isfinite(number) else None
    if isinstance(value, str):
        # A -D value as C writes it: 16, "16", 0x10, 16u, 2.5f, 1e-3 (suffixes and hex are still numbers, and
        # a tuning parameter read as a category loses its order).
        text = value.strip()
        if C_INT.fullmatch(text) is not None:
            # An integer literal (hex and suffixes included) as C reads it: "016" is octal 14, as in row_key.
            exact = _canonical(text)
            if isinstance(exact, int):
                try:
                    return float(exact)
                except OverflowError:
                    return None
        try:
            number = float(_DEC_SUFFIX.sub("", text))
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


_INT_SUFFIX = C_INT_SUFFIX
_DEC_SUFFIX = re.compile(rf"(?<=[0-9.])(?:{_INT_SUFFIX}|[fF])$")


def _launch_values(launch: dict[str, Any] | None) -> dict[str, float]:
    """Launch shape as numbers the model can use (empty when there is no launch)."""
    if not launch:
        return {}
    grid = list(launch.get("grid") or (1, 1, 1))
    block = list(launch.get("block") or (1, 1, 1))
    out = {
        "@block_x": float(block[0]),
        "@block_y": float(block[1] if len(block) > 1 else 1),
        "@block_z": float(block[2] if len(block) > 2 else 1),
        "@threads": float(math.prod(int(b) for b in block)),
        "@blocks": float(math.prod(int(g) for g in grid)),
        "@dyn_smem": float(launch.get("shared_mem_bytes") or 0) + 1.0,
    }
    return out


def kernel_params(
    defines: dict[str, Any], launch: dict[str, Any] | None, compile_options: Sequence[str] = ()
) -> dict[str, Any]:
    """Everything that varies inside a family: the defines, numeric launch fields, and each nvcc flag as a
    0/1 parameter ("%-use_fast_math", "%-maxrregcount=64"; absent = 0)."""
    params: dict[str, Any] = dict(defines)
    params.update(_launch_values(launch))
    params.update({f"{_FLAG_PREFIX}{opt}": 1 for opt in compile_options})
    return params


_FLAG_PREFIX = "%"


def _canonical(value: Any) -> int | float | str:
    """A parameter value as the compiler reads it, for telling members apart: 16, 16.0, "16", "16u" and "0x10"
    are one value; integers stay exact (2**60 and 2**60 + 1, or two 64-bit masks, are two members, though
    the model's float encoding cannot tell them apart), and "016" is octal 14, as in C."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if C_INT.fullmatch(text) is not None:
            exact = c_integer(text)
            return text if exact is None else exact  # None: "09", not octal, not a number C reads
    number = _as_number(value)
    if number is None:
        return str(value).strip()
    return int(number) if number.is_integer() and abs(number) < 2.0**53 else number


def _category(value: Any) -> str:
    """A categorical column's label of a value: its canonical spelling (`_canonical`)."""
    return str(_canonical(value))


def row_key(row: dict[str, Any]) -> tuple[tuple[str, int | float | str], ...]:
    """Identity of a family member as the model sees it (its parameters, canonical values)."""
    return tuple(sorted((k, _canonical(v)) for k, v in row.items()))


def member_key(kernel: Kernel) -> tuple[str, tuple[tuple[str, int | float | str], ...]]:
    """The kernel as the family model tells members apart: its family and `row_key` of its parameters, so
    that defines spelled otherwise (32, "0x20", "32u", "32.0") are one member, answered by one measurement."""
    row = kernel_params(dict(kernel.defines), _launch_dict(kernel), kernel.compile_options)
    return kernel.family_key(), row_key(row)


def _split_launch(row: dict[str, Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    defines = row_key({k: v for k, v in row.items() if not k.startswith("@")})
    return defines, row_key({k: v for k, v in row.items() if k.startswith("@")})


@dataclass
class _Column:
    name: str
    kind: str  # "num" or "cat"
    log: bool = False
    lo: float = 0.0
    span: float = 1.0
    categories: tuple[str, ...] = ()
    default: float = 0.5  # encoded value used when a kernel lacks this parameter
    offset: float = 0.0  # a log column's shift, log2(x + offset): a range from 0 (unroll 0, 1, 2, 4...)
    # A linear range wider than the largest float (-1.7e308 to 1.7e308): lo and span are halved, as is each value.
    halved: bool = False

    def scaled(self, number: float) -> float:
        """A number's place in the column's range (0 at lo, 1 at its top)."""
        if self.halved:
            return (0.5 * number - self.lo) / self.span
        return (number - self.lo) / self.span


_BLOCK_NAME = re.compile(r"^block_?size_?[xyz]$", re.IGNORECASE)


# Launch fields that count (blocks in the grid, bytes of dynamic shared memory): the problem size over the
# tile decides them, so alignment indicators of their own describe nothing about the kernel and only give a
# small family spurious dimensions to fit.
_COUNT_COLUMNS = frozenset({"@blocks", "@dyn_smem"})
# A launch field's relation to the defines (constant, equal to one) is trusted from this many members on.
_MIN_RELATION_ROWS = 8


_ENCODED_LIMIT = 1e3
# Categories (one-hot dimensions) kept per text parameter (ParamEncoder), and by all text parameters together:
# 64 text defines of 32 values each made 2,044 dimensions, and a fit of 200 members took 27 s and 2.6 GB (64
# numeric defines, 256 dimensions with their flags: 5 s and 0.3 GB).
MAX_CATEGORIES = 32
MAX_CATEGORY_DIMS = 256
# A pair with a member at a value of a parameter the family's runtimes never varied in (FamilyModel.novel):
# its surprise component weighs at least NOVEL_TAIL_WEIGHT and is widened by NOVEL_EFFECT_VAR times the
# family's spread (LocalForecaster._pair_forecast).
NOVEL_TAIL_WEIGHT = 0.1
NOVEL_EFFECT_VAR = 1.0


def _is_pow2(x: float) -> bool:
    if x <= 0 or x != int(x):
        return False
    n = int(x)
    return n & (n - 1) == 0


def _threads(row: dict[str, Any], block_names: Sequence[str]) -> float | None:
    """Threads per block from Kernel Tuner's block_size_x/y/z convention (missing ones count as 1)."""
    total = 1.0
    for name in block_names:
        value = _as_number(row.get(name, 1))
        if value is None or value <= 0:
            return None
        total *= value
    return total if math.isfinite(total) else None


class ParamEncoder:
    """Maps a family member's parameters to a point in [0, 1]^d.

    Numbers are log-scaled when they span a wide positive range, strings are one-hot. Integer parameters
    also get alignment indicators (power of two; multiple of 32 and 64) because GPU runtimes jump at
    those boundaries (whole warps and wavefronts, shifts instead of divisions, bank-conflict-free strides)
    rather than varying smoothly; and Kernel Tuner's block_size_x/y/z give threads per block (with its
    own warp-multiple indicator), an interaction a stationary kernel over the separate sizes misses.
    Built from the training points only, so it is stable between refits; values outside the trained range
    extrapolate beyond [0, 1].
    """

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        names = sorted({k for r in rows for k in r})
        # Launch fields (kernel_params' "@" names) are used only when they tell members apart that the
        # defines do not. A client that derives its launch from the tuning parameters (block = block_size_x,
        # grid = problem / tile) adds nothing the defines do not say, yet the extra columns (a grid size, its
        # alignment flags) cost the model: TUNE spaces of benchmarks/tune_local.py with such a client (option
        # launch), 16 seeds, pnpoly worst seeds 0.95 / 0.99 -> 0.87 / 0.85 while they were used.
        launches: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}
        for r in rows:
            defines, launch = _split_launch(r)
            launches.setdefault(defines, set()).add(launch)
        self.launch_used = any(len(seen) > 1 for seen in launches.values())
        # Unused launches must still be the ones the family was measured with: a member's launch (each set of
        # defines has one), or the relations every measured launch kept (a constant field, a field equal to a
        # define).
        self._launch_of: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._launch_rules: list[tuple[str, str | None, float | None]] = []
        if not self.launch_used:
            self._launch_of = {d: launch for d, (launch,) in launches.items() if launch}
            self._launch_rules = self._launch_relations(rows, names)
            names = [n for n in names if not n.startswith("@")]
        # Parameters every measured member has: a kernel without one cannot be placed.
        self._always = {n for n in names if all(n in r for r in rows)}
        self.columns: list[_Column] = []
        self.flags: list[tuple[str, str]] = []  # (parameter, "pow2" | "mod32" | "mod64")
        texts = sum(
            1
            for name in names
            if not name.startswith(_FLAG_PREFIX)
            and any(_as_number(r[name]) is None for r in rows if name in r)
        )
        per_text = max(2, min(MAX_CATEGORIES, MAX_CATEGORY_DIMS // max(1, texts)))
        for name in names:
            values = [r[name] for r in rows if name in r]
            numbers = [_as_number(v) for v in values]
            if name.startswith(_FLAG_PREFIX):
                # A compile flag: 1 where given, 0 (the default) where not.
                self.columns.append(_Column(name, "num", False, 0.0, 1.0, default=0.0))
            elif values and all(n is not None for n in numbers):
                nums = [float(n) for n in numbers if n is not None]
                lo, hi = min(nums), max(nums)
                use_log = lo > 0 and hi / lo >= 4.0
                positive = [n for n in nums if n > 0]
                offset = 0.0
                if lo == 0 and positive and max(positive) / min(positive) >= 4.0:
                    # 0, 1, 2, 4, ..., 256 (an unroll factor, 0 for none): linear, 1, 2 and 4 sat within one
                    # length scale of 0 and of each other. Log-encoded one smallest step up, 0 keeps its place.
                    use_log, offset = True, min(positive)
                if use_log:
                    lo, hi = math.log2(lo + offset), math.log2(hi + offset)
                span = hi - lo if hi > lo else 1.0
                # hi - lo overflows past the largest float: the top member encoded as inf / inf, NaN, and with
                # it every prediction and P(fail) of the family.
                halved = not math.isfinite(span)
                if halved:
                    lo, span = 0.5 * lo, 0.5 * hi - 0.5 * lo
                col = _Column(name, "num", use_log, lo, span, offset=offset, halved=halved)
                col.default = 0.5 if hi > lo else 0.0
                self.columns.append(col)
                if name not in _COUNT_COLUMNS:
                    self.flags.extend((name, f) for f in self._flags_for(positive if offset else nums))
            else:
                # One category per value as the compiler reads it (16 and 16.0, True and 1 are one member), the
                # MAX_CATEGORIES most measured of them: a define unique to each member (a variant name) made one
                # dimension per member, and a compare of a 1000-member family took 18 s and 1.4 GB. A value
                # beyond them is one the model cannot place (unknown_names), as a value never measured is. Many
                # text parameters share MAX_CATEGORY_DIMS.
                counts = Counter(_category(v) for v in values)
                most = sorted(counts, key=lambda c: (-counts[c], c))[:per_text]
                self.columns.append(_Column(name, "cat", categories=tuple(sorted(most))))
        # A numeric parameter some members lack: absent, it encodes at its column's default (the middle of the
        # range, or the one value measured), where a member that has it may sit. A 0/1 "given" dimension keeps
        # `#ifdef USE_SHMEM` members apart from those without it. (Categories need none: absent is no category;
        # compile flags are 0 where not given already.)
        self.given = [
            c.name for c in self.columns if c.kind == "num" and c.name not in self._always
            and not c.name.startswith(_FLAG_PREFIX)
        ]  # fmt: skip
        self.block_names = [n for n in names if _BLOCK_NAME.match(n)]
        self.threads_col: _Column | None = None
        self.threads_mod32 = False
        if len(self.block_names) >= 2:
            threads = [t for t in (_threads(r, self.block_names) for r in rows) if t is not None]
            if threads and min(threads) > 0 and max(threads) > min(threads):
                lo, hi = math.log2(min(threads)), math.log2(max(threads))
                self.threads_col = _Column("threads", "num", True, lo, hi - lo)
                mods = [t % 32 == 0 for t in threads]
                self.threads_mod32 = any(mods) and not all(mods)
        self.dim_names: list[str] = []
        for c in self.columns:
            if c.kind == "cat":
                self.dim_names.extend(f"{c.name}={v}" for v in c.categories)
            else:
                self.dim_names.append(c.name)
        self.dim_names.extend(f"{n}:{f}" for n, f in self.flags)
        self.dim_names.extend(f"{n}:given" for n in self.given)
        if self.threads_col is not None:
            self.dim_names.append("threads")
        if self.threads_mod32:
            self.dim_names.append("threads:mod32")
        self._width = self.dim = len(self.dim_names)
        self._keep = list(range(self.dim))
        if not self.launch_used:
            return
        # Where launches are used, one that repeats a tuning parameter (block = block_size_x) would make that
        # parameter count twice in the kernel's distance: a launch column (or flag) equal to another column
        # on every training point is left out. (Only launch columns: with few points, two defines can agree
        # by chance and later part.)
        full = self._encode_all(rows)
        kept = [j for j in range(self.dim) if not self.dim_names[j].startswith("@")]
        for j in range(self.dim):
            column = full[:, j]
            if self.dim_names[j].startswith("@") and not (
                np.ptp(column) > 0 and any(np.array_equal(column, full[:, k]) for k in kept)
            ):
                kept.append(j)
        self._keep = sorted(kept)
        self.dim_names = [self.dim_names[j] for j in self._keep]
        self.dim = len(self._keep)

    @staticmethod
    def _launch_relations(
        rows: Sequence[dict[str, Any]], names: Sequence[str]
    ) -> list[tuple[str, str | None, float | None]]:
        """(launch field, define it always equals or None, constant value or None) over the rows."""
        defines = [n for n in names if not n.startswith("@") and all(n in r for r in rows)]
        rules: list[tuple[str, str | None, float | None]] = []
        if len(rows) < _MIN_RELATION_ROWS:
            return rules
        for name in names:
            if not name.startswith("@") or name in _COUNT_COLUMNS or not all(name in r for r in rows):
                continue
            values = [_as_number(r[name]) for r in rows]
            if len(set(values)) == 1 and values[0] is not None:
                rules.append((name, None, values[0]))
                continue
            same = next(
                (d for d in defines if all(_as_number(r[d]) == v for r, v in zip(rows, values, strict=True))),
                None,
            )
            if same is not None:
                rules.append((name, same, None))
        return rules

    def _launch_mismatch(self, row: dict[str, Any]) -> list[str]:
        """Launch fields of `row` (while launches are not used) that no measured member's launch had."""
        if not any(k.startswith("@") for k in row):
            return []
        defines, launch = _split_launch(row)
        seen = self._launch_of.get(defines)
        if seen is not None and seen != launch:
            return ["launch"]
        out = []
        for name, define, constant in self._launch_rules:
            value = _as_number(row.get(name))
            expected = constant if define is None else _as_number(row.get(define))
            if value is None or value != expected:
                out.append(name)
        return out

    @staticmethod
    def _flags_for(nums: list[float]) -> list[str]:
        distinct = sorted(set(nums))
        if len(distinct) < 3 or any(v != int(v) or v <= 0 for v in distinct):
            return []
        out = []
        pow2 = [_is_pow2(v) for v in distinct]
        if any(pow2) and not all(pow2):
            out.append("pow2")
        for m in (32, 64):
            mods = [v % m == 0 for v in distinct]
            if any(mods) and not all(mods) and max(distinct) >= 2 * m:
                out.append(f"mod{m}")
        return out

    def encode(self, rows: Sequence[dict[str, Any]]) -> Array:
        # Clamped far outside [0, 1] (where every correlation is already zero): a value such as 1e160 on a
        # linear column would make the kernel's distances infinite and its predictions NaN.
        return np.clip(self._encode_all(rows)[:, self._keep], -_ENCODED_LIMIT, _ENCODED_LIMIT)

    def _encode_all(self, rows: Sequence[dict[str, Any]]) -> Array:
        """Every column, repeated ones included (the encoder keeps `_keep` of them)."""
        out = np.zeros((len(rows), self._width), dtype=np.float64)
        for i, row in enumerate(rows):
            j = 0
            for c in self.columns:
                if c.kind == "cat":
                    value = row.get(c.name)
                    label = None if value is None else _category(value)
                    if label in c.categories:
                        out[i, j + c.categories.index(label)] = 1.0
                    j += len(c.categories)
                    continue
                number = _as_number(row.get(c.name))
                if number is None:
                    out[i, j] = c.default
                else:
                    if c.log:
                        shifted = number + c.offset
                        number = math.log2(shifted) if shifted > 0 else c.lo - 1.0
                    out[i, j] = c.scaled(number)
                j += 1
            for name, flag in self.flags:
                number = _as_number(row.get(name))
                if number is not None:
                    if flag == "pow2":
                        out[i, j] = float(_is_pow2(number))
                    else:
                        out[i, j] = float(number == int(number) and int(number) % int(flag[3:]) == 0)
                else:
                    out[i, j] = 0.5
                j += 1
            for name in self.given:
                out[i, j] = float(row.get(name) is not None)
                j += 1
            if self.threads_col is not None or self.threads_mod32:
                threads = _threads(row, self.block_names)
                if self.threads_col is not None:
                    col = self.threads_col
                    out[i, j] = 0.5 if threads is None else col.scaled(math.log2(threads))
                    j += 1
                if self.threads_mod32:
                    out[i, j] = 0.5 if threads is None else float(threads % 32 == 0)
                    j += 1
        return out

    def unknown_names(self, row: dict[str, Any]) -> list[str]:
        """Parameters of `row` the model cannot place: one the family was never measured with, one every
        measured member had and `row` lacks, a value of a kind or category never measured (a string where
        numbers were, a new category), and (while launches are not used) a launch no member was run with.
        Encoding those anyway would put the kernel at a made-up point (the middle of the range, no category)
        and forecast it as confidently as a measured neighbour."""
        out = []
        for c in self.columns:
            value = row.get(c.name)
            if value is None:
                if c.name in self._always:
                    out.append(c.name)
            elif (_as_number(value) is None) if c.kind == "num" else (_category(value) not in c.categories):
                out.append(c.name)
        known = {c.name for c in self.columns}
        out.extend(k for k in row if k not in known and (self.launch_used or not k.startswith("@")))
        if not self.launch_used:
            out.extend(self._launch_mismatch(row))
        return out


# ---------------------------------------------------------------- Gaussian process


def _sqdist_per_dim(x1: Array, x2: Array) -> Array:
    """(d, n1, n2) squared differences per dimension."""
    diff = x1.T[:, :, None] - x2.T[:, None, :]
    return np.asarray(diff * diff)


def _matern(r: Array, sf2: float) -> Array:
    s = _SQRT5 * r
    return np.asarray(sf2 * (1.0 + s + s * s / 3.0) * np.exp(-s))


def _scaled_r(x1: Array, x2: Array, ls: Array) -> Array:
    z1 = x1 / ls
    z2 = x2 / ls
    r2 = (z1 * z1).sum(1)[:, None] + (z2 * z2).sum(1)[None, :] - 2.0 * (z1 @ z2.T)
    return np.asarray(np.sqrt(np.maximum(r2, 0.0)))


# A dimension with at most this many distinct values among both point sets goes through a value table.
_TABLE_VALUES = 64


def _additive(x1: Array, x2: Array, ls: Array, sa2: float) -> Array:
    """sa2 * mean over dimensions of a squared-exponential in that dimension alone.

    Tuning parameters take a few values each, so the per-dimension kernels are tables over those values:
    one-hot(x1) @ (table @ one-hot(x2).T) for all such dimensions in one matrix product, instead of an
    n1 x n2 exponential per dimension (about 10x faster at 1,500 points). Dimensions with many distinct
    values are computed directly."""
    n1, n2 = x1.shape[0], x2.shape[0]
    if sa2 <= 0.0:
        return np.zeros((n1, n2))
    total = np.zeros((n1, n2))
    left: list[Array] = []
    right: list[Array] = []
    for j in range(x1.shape[1]):
        values, index = np.unique(np.concatenate([x1[:, j], x2[:, j]]), return_inverse=True)
        if len(values) <= _TABLE_VALUES:
            diff = (values[:, None] - values[None, :]) / ls[j]
            table = np.exp(-0.5 * diff * diff)
            left.append(np.eye(len(values))[index[:n1]])
            right.append(table[:, index[n1:]])
        else:
            diff = (x1[:, j][:, None] - x2[:, j][None, :]) / ls[j]
            total += np.exp(-0.5 * diff * diff)
    if left:
        total += np.hstack(left) @ np.vstack(right)
    return np.asarray(total * (sa2 / max(1, x1.shape[1])))


def kernel_matrix(x1: Array, x2: Array, ls: Array, sf2: float, sa2: float) -> Array:
    """The family model's covariance: a Matern 5/2 over all parameters jointly (interactions) plus an
    additive part (main effects that hold across the rest of the space)."""
    return _matern(_scaled_r(x1, x2, ls), sf2) + _additive(x1, x2, ls, sa2)


def _lbfgs(fg: Any, x0: Array, max_iter: int, memory: int = 8) -> Array:
    """Minimise fg(x) -> (f, grad) with L-BFGS and a backtracking line search (no scipy needed)."""
    x = x0.copy()
    f, g = fg(x)
    if not math.isfinite(f):
        return x0
    s_hist: list[Array] = []
    y_hist: list[Array] = []
    for _ in range(max_iter):
        q = g.copy()
        coefs: list[tuple[float, float]] = []
        for s, y in zip(reversed(s_hist), reversed(y_hist), strict=True):
            rho = 1.0 / float(y @ s)
            a = rho * float(s @ q)
            q -= a * y
            coefs.append((rho, a))
        gamma = float(s_hist[-1] @ y_hist[-1]) / float(y_hist[-1] @ y_hist[-1]) if s_hist else 0.1
        r = gamma * q
        for (rho, a), s, y in zip(reversed(coefs), s_hist, y_hist, strict=True):
            b = rho * float(y @ r)
            r += s * (a - b)
        d = -r
        slope = float(g @ d)
        if slope >= 0:
            d, slope = -g, -float(g @ g)
            s_hist.clear()
            y_hist.clear()
        step_norm = float(np.max(np.abs(d)))
        t = min(1.0, 2.0 / step_norm) if step_norm > 0 else 1.0
        while True:
            xn = x + t * d
            fn, gn = fg(xn)
            if math.isfinite(fn) and fn <= f + 1e-4 * t * slope:
                break
            t *= 0.5
            if t < 1e-6:
                return x
        s_new, y_new = xn - x, gn - g
        if float(s_new @ y_new) > 1e-10:
            s_hist.append(s_new)
            y_hist.append(y_new)
            if len(s_hist) > memory:
                s_hist.pop(0)
                y_hist.pop(0)
        converged = abs(f - fn) < 1e-7 * max(1.0, abs(f))
        x, f, g = xn, fn, gn
        if converged or float(np.max(np.abs(g))) < 1e-5:
            break
    return x


@dataclass
class GPFit:
    """A fitted GP on standardised targets; predictions are returned in the original units."""

    x: Array
    y_mean: float
    y_std: float
    ls: Array
    sf2: float  # joint (interaction) part
    sa2: float  # additive (main-effect) part
    sn2: float
    alpha: Array
    kinv: Array
    loo_scale: float  # predictive standard deviations are multiplied by this (>= 1 typically)
    theta: Array  # log hyperparameters, for warm starts

    def kernel(self, x1: Array, x2: Array) -> Array:
        return kernel_matrix(x1, x2, self.ls, self.sf2, self.sa2)

    def predict(self, xq: Array) -> tuple[Array, Array]:
        """Latent mean and full covariance (original units) of f at xq."""
        ks = self.kernel(xq, self.x)
        mean = ks @ self.alpha
        cov = self.kernel(xq, xq) - ks @ self.kinv @ ks.T
        cov = 0.5 * (cov + cov.T)
        d = np.diag(cov).copy()
        np.fill_diagonal(cov, np.maximum(d, 1e-12))
        return self.y_mean + self.y_std * mean, cov * self.y_std**2

    def predict_marginal(self, xq: Array) -> tuple[Array, Array]:
        """Latent mean and variance only (cheap for many points)."""
        ks = self.kernel(xq, self.x)
        mean = ks @ self.alpha
        var = (self.sf2 + self.sa2) - np.einsum("ij,jk,ik->i", ks, self.kinv, ks)
        return self.y_mean + self.y_std * mean, np.maximum(var, 1e-12) * self.y_std**2

    @property
    def prior_var(self) -> float:
        return (self.sf2 + self.sa2) * self.y_std**2

    @property
    def noise_sd(self) -> float:
        return float(math.sqrt(self.sn2) * self.y_std)


# Hyperpriors on the log hyperparameters, in standardised target units and [0, 1] inputs.
# Tuning spaces are dominated by main effects (each parameter has a trend); with few measurements the fit
# cannot tell a trend from an interaction, so the priors lean to the additive part and to length scales of
# the whole input range. With the earlier priors (additive variance 0.3, length scale 0.5) predictions away
# from 10 measurements were shrunk to the family mean: the true differences between two unmeasured members
# were 2-4x the predicted ones while their signs were mostly right, so forecasts were under-confident (ECE
# 0.12 at 10 points). Chosen on the TUNE spaces of benchmarks/tune_local.py (`model`, history 10 / 30 / 100,
# mean of 8 spaces): pairs of two unmeasured members accuracy 0.675 -> 0.685, ECE 0.124 -> 0.078; against a
# measured baseline 0.735 -> 0.771, ECE 0.104 -> 0.076; at 100 points unchanged or better (0.882 -> 0.884,
# 0.928 -> 0.932); plain-client searches the same within seed noise (mean best-fraction summed over the 8
# spaces, 16 seeds: 7.773 -> 7.782). On the 15 held-out spaces, at 10 points: 0.674 -> 0.700 (ECE 0.117 ->
# 0.071) and 0.765 -> 0.801 (ECE 0.088 -> 0.060); searches 14.65 -> 14.62 summed over 15 spaces.
_LS_PRIOR_MEAN = 0.0
_LS_PRIOR_SD = 1.0
_SF2_PRIOR_MEAN = 0.0
_SF2_PRIOR_SD = 1.0
_SA2_PRIOR_MEAN = math.log(3.0)
_SA2_PRIOR_SD = 1.5
_SN2_PRIOR_MEAN = math.log(0.02)
_SN2_PRIOR_SD = 1.5
_LOG_SN2_MIN = math.log(1e-5)
_LOG_LS_MIN = math.log(0.02)
_LOG_LS_MAX = math.log(50.0)
USE_ADDITIVE = True


def _unpack(theta: Array, d: int) -> tuple[Array, float, float, float]:
    log_ls = np.clip(theta[:d], _LOG_LS_MIN, _LOG_LS_MAX)
    log_sf2 = float(np.clip(theta[d], -6.0, 4.0))
    log_sn2 = float(np.clip(theta[d + 1], _LOG_SN2_MIN, 1.0))
    log_sa2 = float(np.clip(theta[d + 2], -8.0, 4.0)) if len(theta) > d + 2 else -math.inf
    return log_ls, log_sf2, log_sn2, log_sa2


def _neg_log_posterior(theta: Array, sq: Array, y: Array) -> tuple[float, Array]:
    d = sq.shape[0]
    n = y.shape[0]
    log_ls, log_sf2, log_sn2, log_sa2 = _unpack(theta, d)
    additive = len(theta) > d + 2
    ls2 = np.exp(2.0 * log_ls)
    sf2, sn2 = math.exp(log_sf2), math.exp(log_sn2)
    scaled = sq / ls2[:, None, None]
    r = np.sqrt(np.maximum(scaled.sum(axis=0), 0.0))
    s = _SQRT5 * r
    e = np.exp(-s)
    kf = sf2 * (1.0 + s + s * s / 3.0) * e
    k = kf + (sn2 + 1e-8) * np.eye(n)
    if additive:
        sa2 = math.exp(log_sa2)
        per_dim = np.exp(-0.5 * scaled)  # (d, n, n)
        ka = per_dim.sum(axis=0) * (sa2 / d)
        k = k + ka
    try:
        chol = np.linalg.cholesky(k)
    except np.linalg.LinAlgError:
        return math.inf, np.zeros_like(theta)
    linv = np.linalg.inv(chol)
    kinv = linv.T @ linv
    alpha = kinv @ y
    nll = 0.5 * float(y @ alpha) + float(np.log(np.diag(chol)).sum()) + 0.5 * n * math.log(2 * math.pi)
    w = np.outer(alpha, alpha) - kinv
    # dK/dlog(ls_k) = sf2 * 5/3 * (1 + s) * exp(-s) * sq_k / ls_k^2  (+ additive: sa2/d * e_k * sq_k / ls_k^2)
    gmat = sf2 * (5.0 / 3.0) * (1.0 + s) * e
    grad = np.zeros_like(theta)
    grad[:d] = -0.5 * np.tensordot(scaled, w * gmat, axes=([1, 2], [0, 1]))
    grad[d] = -0.5 * float((w * kf).sum())
    grad[d + 1] = -0.5 * sn2 * float(np.trace(w))
    if additive:
        grad[:d] += (
            -0.5 * (sa2 / d) * np.einsum("kij,kij->k", per_dim * scaled, np.broadcast_to(w, scaled.shape))
        )
        grad[d + 2] = -0.5 * float((w * ka).sum())
    # Gaussian hyperpriors (negative log density and its gradient).
    nlp = 0.5 * float((((log_ls - _LS_PRIOR_MEAN) / _LS_PRIOR_SD) ** 2).sum())
    nlp += 0.5 * ((log_sf2 - _SF2_PRIOR_MEAN) / _SF2_PRIOR_SD) ** 2
    nlp += 0.5 * ((log_sn2 - _SN2_PRIOR_MEAN) / _SN2_PRIOR_SD) ** 2
    grad[:d] += (log_ls - _LS_PRIOR_MEAN) / _LS_PRIOR_SD**2
    grad[d] += (log_sf2 - _SF2_PRIOR_MEAN) / _SF2_PRIOR_SD**2
    grad[d + 1] += (log_sn2 - _SN2_PRIOR_MEAN) / _SN2_PRIOR_SD**2
    if additive:
        nlp += 0.5 * ((log_sa2 - _SA2_PRIOR_MEAN) / _SA2_PRIOR_SD) ** 2
        grad[d + 2] += (log_sa2 - _SA2_PRIOR_MEAN) / _SA2_PRIOR_SD**2
    return nll + nlp, grad


def _fit_subset(
    n: int, y: Array, cap: int, rng: np.random.Generator, x: Array | None = None
) -> NDArray[np.intp]:
    """Indices of at most `cap` points: the best quarter always, the rest at random, or, given the points `x`,
    those whose coordinates hash lowest: a stable choice, so one new measurement changes the subset by a
    point or two instead of redrawing it (and every forecast of the family with it)."""
    if n <= cap:
        return np.arange(n, dtype=np.intp)
    order = np.argsort(y, kind="stable")
    keep_best = order[: cap // 4]
    others = order[cap // 4 :]
    if x is None:
        rest = rng.choice(others, size=cap - cap // 4, replace=False)
    else:
        digest = np.array(
            [int.from_bytes(hashlib.blake2b(x[i].tobytes(), digest_size=8).digest(), "big") for i in others],
            dtype=np.uint64,
        )
        rest = others[np.argsort(digest, kind="stable")[: cap - cap // 4]]
    return np.sort(np.concatenate([keep_best, rest]))


Y_STD_FLOOR_LOG2 = 0.1  # about 7%: how far apart untried members of a flat family may still turn out


def fit_gp(
    x: Array,
    y: Array,
    warm: Array | None = None,
    max_iter: int = 60,
    seed: int = 0,
    additive: bool | None = None,
    refit: bool = True,
    previous: GPFit | None = None,
) -> GPFit:
    """Fit hyperparameters (MAP, from defaults and from `warm`) and the posterior.

    `refit=False` with `warm` keeps those hyperparameters and only conditions on the points (one
    factorisation): what a busy server does between full refits. Given the `previous` fit with the same
    hyperparameters, the factorisation is updated for the points added and dropped since (`_updated_inverse`)
    instead of redone."""
    additive = USE_ADDITIVE if additive is None else additive
    n, d = x.shape
    rng = np.random.default_rng(seed)
    y_mean = float(np.mean(y))
    # The prior spread is the family's measured spread, but never below Y_STD_FLOOR_LOG2: a family measured
    # all at 2.00 ms forecast a block size 128x beyond its range at "2 ms (+-1%)" and decided it.
    y_std = max(float(np.std(y)), Y_STD_FLOOR_LOG2)
    ys = (y - y_mean) / y_std
    idx = _fit_subset(n, y, MAX_FIT_POINTS, rng)
    sq = _sqdist_per_dim(x[idx], x[idx])
    default = [*([_LS_PRIOR_MEAN] * d), 0.0, _SN2_PRIOR_MEAN]
    if additive:
        default.append(_SA2_PRIOR_MEAN)
    starts: list[Array] = [np.asarray(default, dtype=np.float64)]
    if warm is not None and warm.shape == starts[0].shape:
        starts.insert(0, warm.copy())
    best_theta, best_f = starts[-1], math.inf
    if not refit and warm is not None and warm.shape == starts[-1].shape:
        best_theta, starts = warm.copy(), []
    for start in starts:
        iters = max_iter // 2 if start is not starts[-1] else max_iter
        theta = _lbfgs(lambda t: _neg_log_posterior(t, sq, ys[idx]), start, iters)
        f, _ = _neg_log_posterior(theta, sq, ys[idx])
        if f < best_f:
            best_theta, best_f = theta, f
    log_ls, log_sf2, log_sn2, log_sa2 = _unpack(best_theta, d)
    ls = np.exp(log_ls)
    sf2, sn2 = math.exp(log_sf2), math.exp(log_sn2)
    sa2 = math.exp(log_sa2) if additive else 0.0
    # Posterior on (a capped subset of) all points.
    post = _fit_subset(n, y, MAX_POSTERIOR_POINTS, rng, x)
    xp, yp = x[post], ys[post]
    theta = np.concatenate([log_ls, best_theta[d:]])
    kinv = None
    if previous is not None and previous.theta.shape == theta.shape and np.array_equal(previous.theta, theta):
        kinv = _updated_inverse(previous, xp)
    if kinv is None:
        kinv = _inverse(kernel_matrix(xp, xp, ls, sf2, sa2) + (sn2 + _JITTER) * np.eye(len(post)))
    alpha = kinv @ yp
    # Leave-one-out standardised residuals: how wrong the predictive spread is on this family.
    diag = np.maximum(np.diag(kinv), 1e-12)
    loo_scale = _loo_scale(alpha / np.sqrt(diag))
    return GPFit(xp, y_mean, y_std, ls, sf2, sa2, sn2, alpha, kinv, loo_scale, theta)


_JITTER = 1e-8


def _inverse(k: Array) -> Array:
    """The inverse of a covariance matrix through its Cholesky factor, with more jitter until it factors."""
    jitter = _JITTER
    while True:
        try:
            chol = np.linalg.cholesky(k)
            break
        except np.linalg.LinAlgError:
            jitter *= 10.0
            k = k + jitter * np.eye(len(k))
    return _inverse_from_cholesky(chol)


def _inverse_from_cholesky(chol: NDArray[np.floating[Any]]) -> Array:
    """K^-1 from K's lower Cholesky factor L: L^-T L^-1."""
    linv = np.linalg.inv(chol)
    return np.asarray(linv.T @ linv)


# An update is worth it while the points that changed are a small part of the family; past this share a new
# factorisation costs about the same and carries no rounding from earlier updates.
_MAX_UPDATE_SHARE = 0.25
_UPDATE_TOLERANCE = 1e-6


def _updated_inverse(previous: GPFit, xp: Array) -> Array | None:
    """The inverse covariance on `xp` from `previous.kinv`, with previous's hyperparameters: points no longer
    in `xp` are removed (a Schur downdate), new ones appended (a Schur complement), and the result put in the
    order of `xp`. About 3n^2 k operations for k changed points instead of the ~4n^3 of `_inverse` (0.3 s at
    1,500 points). Rows are matched by their encoded values: the covariance depends on nothing else, so
    two members with equal rows are interchangeable. None when nothing can be reused, too much changed, the
    new part does not factor, or a check of the result on a few rows fails: the caller factorises anew."""
    old = previous.x
    if old.shape[1] != xp.shape[1] or len(old) == 0:
        return None
    free: dict[bytes, list[int]] = {}
    for i in range(len(old) - 1, -1, -1):
        free.setdefault(old[i].tobytes(), []).append(i)
    kept_at, kept_old, new_at = [], [], []
    for j in range(len(xp)):
        slots = free.get(xp[j].tobytes())
        if slots:
            kept_at.append(j)
            kept_old.append(slots.pop())
        else:
            new_at.append(j)
    removed = sorted(i for slots in free.values() for i in slots)
    if not kept_old or len(removed) + len(new_at) > _MAX_UPDATE_SHARE * len(xp):
        return None
    p = previous.kinv
    ko = np.asarray(kept_old)
    pk = p[np.ix_(ko, ko)]
    if removed:
        r = np.asarray(removed)
        pkr = p[np.ix_(ko, r)]
        try:
            pk = pk - pkr @ np.linalg.solve(p[np.ix_(r, r)], pkr.T)
        except np.linalg.LinAlgError:
            return None
    ls, sf2, sa2, sn2 = previous.ls, previous.sf2, previous.sa2, previous.sn2
    order = np.asarray(kept_at + new_at)
    if new_at:
        xk, xn = xp[np.asarray(kept_at)], xp[np.asarray(new_at)]
        b = kernel_matrix(xk, xn, ls, sf2, sa2)
        c = kernel_matrix(xn, xn, ls, sf2, sa2) + (sn2 + _JITTER) * np.eye(len(new_at))
        e = pk @ b
        try:
            s_inv = _inverse_from_cholesky(np.linalg.cholesky(c - b.T @ e))
        except np.linalg.LinAlgError:
            return None
        es = e @ s_inv
        blocked = np.block([[pk + es @ e.T, -es], [-es.T, s_inv]])
    else:
        blocked = pk
    kinv = np.empty_like(blocked)
    kinv[np.ix_(order, order)] = blocked
    kinv = 0.5 * (kinv + kinv.T)
    # Check K @ kinv = I on a few rows (the new ones first): rounding must not build up unseen.
    rows = np.unique(
        np.concatenate(
            [np.asarray(new_at[:2], dtype=np.intp), np.linspace(0, len(xp) - 1, 3).astype(np.intp)]
        )
    )
    k_rows = kernel_matrix(xp[rows], xp, ls, sf2, sa2)
    k_rows[np.arange(len(rows)), rows] += sn2 + _JITTER
    check = k_rows @ kinv
    check[np.arange(len(rows)), rows] -= 1.0
    if not float(np.max(np.abs(check))) < _UPDATE_TOLERANCE:
        return None
    return np.asarray(kinv, dtype=np.float64)


# With few points the LOO residuals say little; their spread is shrunk towards this prior factor.
LOO_PRIOR_SCALE = 1.0
LOO_PRIOR_WEIGHT_N = 5.0


def _loo_scale(z: Array) -> float:
    """Factor on predictive sd so leave-one-out residuals have unit spread (robust; shrunk for small n)."""
    n = len(z)
    if n < 3:
        return LOO_PRIOR_SCALE
    # A 20%-trimmed second moment resists a few wild points; the tail component covers those.
    zz = np.sort(z * z)
    kept = zz[: max(2, math.ceil(0.8 * n))]
    trimmed = float(kept.mean()) / 0.4377  # E[z^2 | |z| below its 80th percentile] for a standard normal
    w = n / (n + LOO_PRIOR_WEIGHT_N)
    return float(math.sqrt(max(0.25, w * trimmed + (1 - w) * LOO_PRIOR_SCALE**2)))


# ---------------------------------------------------------------- the family model

# Hyperparameter uncertainty. The MAP length scales are learned where the measurements are, and a search
# puts most of them in one basin: a parameter that hardly matters there (power-of-two widths on the
# shared-memory path, say) gets a long length scale, and the model then predicts the rest of the space
# from that basin, confidently and, on rugged spaces, badly wrong (mid-search, the best configurations
# of the convolution spaces were predicted 3-5 sd too slow). Mixing in a posterior with every length
# scale shortened (same data, same variances; one more factorisation per fit) is a cheap stand-in for
# integrating over the length scales: near the measurements the two agree, away from them the mixture
# widens towards the family's spread. Chosen on the TUNE spaces of benchmarks/tune_local.py (plain
# client, 16 seeds, mean best-fraction): conv-A100 0.898 -> 0.909, conv-A4000 0.873 -> 0.891, pnpoly
# 0.996/0.999 -> 0.993/0.993; weight 0.2 explored too much on smooth spaces (pnpoly 0.97), and shortening
# only two-valued switches lost the convolution gains. Pair accuracy and ECE on held-out spaces unchanged.
SHORT_LS_FACTOR = 0.3
SHORT_WEIGHT = 0.1
# How far beyond the measured range (in units of that range) a prediction keeps the model's own spread.
EXTRAPOLATION_SLACK = 0.5
# ... and the spread a flat family's prediction grows towards beyond it (log2 units squared: sd 0.5, a factor
# 1.4 either way): its own spread says nothing of what happens far outside what was measured.
EXTRAPOLATION_VAR_FLOOR_LOG2 = 0.25


def _predict_one(gp: GPFit, xq: Array) -> tuple[Array, Array]:
    mean, cov = gp.predict(xq)
    cov = cov * gp.loo_scale**2
    cov[np.diag_indices_from(cov)] += gp.noise_sd**2
    return mean, cov


def _short_companion(gp: GPFit, x: Array, y: Array, previous: GPFit | None = None) -> GPFit | None:
    """The same fit with every length scale multiplied by SHORT_LS_FACTOR (conditioning only)."""
    if SHORT_WEIGHT <= 0.0 or not 0.0 < SHORT_LS_FACTOR < 1.0:
        return None
    theta = gp.theta.copy()
    theta[: x.shape[1]] += math.log(SHORT_LS_FACTOR)
    return fit_gp(x, y, warm=theta, refit=False, previous=previous)


@dataclass
class Measured:
    """A family member's stored measurement."""

    ok: bool
    log2_ms: float | None
    status: str


@dataclass
class FamilyModel:
    """The fitted state of one (family, hardware, workload): GP on log2 runtime + failure smoother."""

    encoder: ParamEncoder | None
    gp: GPFit | None
    measured: dict[str, Measured]
    x_all: Array  # encoded parameters of every stored point (ok and failed)
    failed_all: Array  # 1.0 where that point failed
    n_ok: int
    n_failed: int
    fail_ls: Array = field(default_factory=lambda: np.zeros(0))
    gp_short: GPFit | None = None
    # The same measurements by parameters (`row_key`): 16 and "16" are one kernel to the model, and a
    # kernel measured under another spelling is answered by its measurement, not a prediction.
    by_row: dict[tuple[Any, ...], Measured] = field(default_factory=dict)
    # Parameters every ok measurement had at one value (canonical): the model never saw them vary.
    constant: dict[str, int | float | str] = field(default_factory=dict)
    # A young family's ok measurements (fewer than MIN_FAMILY_POINTS, no GP): what a configuration of it not
    # yet measured is estimated from against another kernel (LocalForecaster._prior_forecast).
    young: tuple[FamilyPoint, ...] = ()

    def novel(self, row: dict[str, Any]) -> set[tuple[str, int | float | str]]:
        """(parameter, value) of `row` at a value the family's runtimes never varied from (`constant`)."""
        return {
            (n, c) for n, v in row.items() if n in self.constant and (c := _canonical(v)) != self.constant[n]
        }

    def lookup(self, content_key: str, row: dict[str, Any]) -> Measured | None:
        """The stored measurement of this member, by content key or else by its parameters."""
        found = self.measured.get(content_key)
        return found if found is not None else self.by_row.get(row_key(row))

    @property
    def usable(self) -> bool:
        return self.gp is not None and self.encoder is not None

    @property
    def measurement_sd_log2(self) -> float:
        noise = self.gp.noise_sd if self.gp is not None else MEASURED_SD_FLOOR_LOG2
        return min(MEASURED_SD_CAP_LOG2, max(MEASURED_SD_FLOOR_LOG2, noise))

    def predict(self, rows: Sequence[dict[str, Any]]) -> tuple[Array, Array]:
        """Predictive mean and covariance of log2 runtime (ms) for family members with these parameters.

        The covariance includes the LOO spread correction (on the latent part) and the measurement noise
        on the diagonal: it describes the runtime a measurement of each member would report. With a
        short-length-scale companion fit (`gp_short`) the prediction is the moment-matched mixture of the two.
        """
        assert self.gp is not None and self.encoder is not None
        xq = self.encoder.encode(rows)
        mean, cov = _predict_one(self.gp, xq)
        if self.gp_short is not None and SHORT_WEIGHT > 0.0:
            m2, c2 = _predict_one(self.gp_short, xq)
            w = SHORT_WEIGHT
            gap = mean - m2
            cov = (1.0 - w) * cov + w * c2 + (w * (1.0 - w)) * np.outer(gap, gap)
            mean = (1.0 - w) * mean + w * m2
        # Beyond the measured range of a parameter (encoded outside [0, 1]) nothing says a flat family stays
        # flat: where its prior spread is below EXTRAPOLATION_VAR_FLOOR_LOG2, the variance grows towards that
        # floor with the distance out (a whole range past the slack: all of it). A family with a real spread
        # keeps its model's own extrapolation (widening it too cost the searches: TUNE slice 0.94 -> 0.87).
        missing = EXTRAPOLATION_VAR_FLOOR_LOG2 - self.gp.prior_var * max(1.0, self.gp.loo_scale) ** 2
        if missing > 0.0 and xq.size:
            excess = np.max(np.maximum(xq - 1.0, -xq), axis=1)
            far = np.minimum(1.0, np.maximum(excess - EXTRAPOLATION_SLACK, 0.0))
            cov[np.diag_indices_from(cov)] += far * missing
        # A parameter the family was never measured with: its effect is unknown, so the prediction falls
        # back to the family's spread around its mean.
        for i, row in enumerate(rows):
            finite = math.isfinite(mean[i]) and bool(np.isfinite(cov[i]).all())
            if not finite or self.encoder.unknown_names(row):
                cov[i, :] = 0.0
                cov[:, i] = 0.0
                cov[i, i] = self.gp.prior_var * self.gp.loo_scale**2 + self.gp.noise_sd**2
                mean[i] = self.gp.y_mean
        return mean, cov

    def p_fail(self, rows: Sequence[dict[str, Any]]) -> Array:
        """Chance each member fails to compile or run: nearby stored outcomes, weighted by closeness."""
        n = len(self.failed_all)
        if n == 0 or self.encoder is None:
            return np.full(len(rows), 0.02)
        if self.n_failed == 0:
            return np.full(len(rows), 0.5 / (n + 1.0))
        xq = self.encoder.encode(rows)
        return _smoothed_fail(xq, self.x_all, self.failed_all, self.fail_ls)


_FAIL_STRENGTH = 2.0  # pseudo-observations of the family's overall failure rate
_FAIL_SELECT_POINTS = 1000


def _smoothed_fail(xq: Array, x: Array, failed: Array, ls: Array, exclude_self: bool = False) -> Array:
    base = (failed.sum() + 0.5) / (len(failed) + 1.0)
    w = _matern(_scaled_r(xq, x, ls), 1.0)
    if exclude_self:
        np.fill_diagonal(w, 0.0)
    return np.asarray((_FAIL_STRENGTH * base + w @ failed) / (_FAIL_STRENGTH + w.sum(axis=1)))


def _fail_lengthscales(x: Array, failed: Array, gp_ls: Array | None) -> Array:
    """Lengthscales for the failure smoother: the runtime GP's (or 0.3) times the factor with the best
    leave-one-out likelihood of the stored outcomes. Failures are usually sharp resource limits, so the
    runtime's smoothness is only a starting point."""
    base = gp_ls if gp_ls is not None else np.full(x.shape[1], 0.3)
    if len(failed) > _FAIL_SELECT_POINTS:
        # Choosing one of five factors needs no more than this many outcomes (each try is n^2).
        keep = np.linspace(0, len(failed) - 1, _FAIL_SELECT_POINTS).astype(np.intp)
        x, failed = x[keep], failed[keep]
    best, best_ll = base, -math.inf
    for factor in (0.1, 0.2, 0.4, 0.8, 1.6):
        ls = np.maximum(base * factor, 0.02)
        p = np.clip(_smoothed_fail(x, x, failed, ls, exclude_self=True), 1e-3, 1 - 1e-3)
        ll = float(np.sum(failed * np.log(p) + (1 - failed) * np.log(1 - p)))
        if ll > best_ll:
            best, best_ll = ls, ll
    return best


def points_signature(points: Sequence[FamilyPoint]) -> str:
    """Changes whenever the family's stored measurements do (count, keys, statuses or runtimes)."""
    h = hashlib.sha1(usedforsecurity=False)
    for p in points:
        h.update(f"{p.content_key}|{p.status}|{p.runtime_ms!r};".encode())
    return f"{len(points)}:{h.hexdigest()}"


def fit_family(
    points: Sequence[FamilyPoint],
    warm: Array | None = None,
    refit: bool = True,
    previous: FamilyModel | None = None,
) -> FamilyModel:
    """Fit the family model on stored points (the latest measurement per content key). `previous`: the
    family's last model, whose factorisations a fit with the same hyperparameters updates (`fit_gp`)."""
    measured: dict[str, Measured] = {}
    by_row: dict[tuple[Any, ...], Measured] = {}
    rows: list[dict[str, Any]] = []
    ok_rows: list[int] = []
    y: list[float] = []
    failed: list[float] = []
    for p in points:
        if p.status == _OK_STATUS and not (p.runtime_ms is not None and p.runtime_ms > 0):
            # An "ok" of no runtime (a recording's 0 ms): neither a runtime to learn nor a failure.
            continue
        ok = p.status == _OK_STATUS
        # Clamped to a range no kernel leaves (1e-18 to 1e18 ms): a recording may hold any finite runtime,
        # and 1e300 ms would overflow the speedups and rationale built from it.
        log2_ms = (
            min(max(math.log2(p.runtime_ms), -LOG2_MS_LIMIT), LOG2_MS_LIMIT)
            if ok and p.runtime_ms is not None
            else None
        )
        measured[p.content_key] = Measured(ok, log2_ms, p.status)
        rows.append(kernel_params(p.defines, p.launch, p.compile_options))
        key = row_key(rows[-1])
        # Points come oldest first: of spellings of one configuration the newest ok measurement answers, and
        # an ok measurement under any spelling wins over a failed one.
        if ok or key not in by_row:
            by_row[key] = measured[p.content_key]
        failed.append(0.0 if ok else 1.0)
        if ok and log2_ms is not None:
            ok_rows.append(len(rows) - 1)
            y.append(log2_ms)
    if not rows:
        return FamilyModel(None, None, measured, np.zeros((0, 0)), np.zeros(0), 0, 0, by_row=by_row)
    encoder = ParamEncoder(rows)
    x_all = encoder.encode(rows)
    gp = gp_short = None
    if len(ok_rows) >= MIN_FAMILY_POINTS:
        x_ok, y_ok = x_all[ok_rows], np.asarray(y)
        # fit_gp reuses a previous factorisation only under the same hyperparameters: after a refit, not.
        gp = fit_gp(
            x_ok, y_ok, warm=warm, refit=refit, previous=previous.gp if previous is not None else None
        )
        gp_short = _short_companion(gp, x_ok, y_ok, previous.gp_short if previous is not None else None)
    ok_params = [rows[i] for i in ok_rows]
    constant = {
        name: values.pop()
        for name in (c.name for c in encoder.columns)
        if len(values := {_canonical(r[name]) for r in ok_params if name in r}) == 1
        and all(name in r for r in ok_params)
    }
    n_failed = int(sum(failed))
    failed_arr = np.asarray(failed)
    fail_ls = (
        _fail_lengthscales(x_all, failed_arr, gp.ls if gp is not None else None) if n_failed else np.zeros(0)
    )
    young: tuple[FamilyPoint, ...] = ()
    if gp is None:
        # One configuration per parameters: the measurement answering for them (by_row), not each spelling's.
        answering = {id(m) for m in by_row.values()}
        young = tuple(
            p
            for p in points
            if (m := measured.get(p.content_key)) is not None
            and m.ok
            and m.log2_ms is not None
            and id(m) in answering
        )
    return FamilyModel(
        encoder,
        gp,
        measured,
        x_all,
        failed_arr,
        len(ok_rows),
        n_failed,
        fail_ls,
        gp_short,
        by_row,
        constant,
        young,
    )


# ---------------------------------------------------------------- the forecaster


def _tail_sd_factor(weight: float, scale: float = TAIL_SCALE) -> float:
    """Overall sd of the tail mixture over its core sd."""
    return math.sqrt((1.0 - weight) + weight * scale**2)


def _tail_weight(predicted: int) -> float:
    """Chance of a surprise in a pair with this many predicted (not measured) runtimes: each prediction is a
    surprise with probability TAIL_WEIGHT, and the pair is one when either is."""
    return TAIL_WEIGHT * predicted if predicted <= 1 else 1.0 - (1.0 - TAIL_WEIGHT) ** predicted


def _spread(var: float, predicted: int, novel: bool, model: FamilyModel | None) -> tuple[float, float, float]:
    """Core sd, tail weight and tail scale of a log2 speedup of variance `var` with `predicted` runtimes
    predicted (not measured), `novel` when either is at a parameter value the family never varied in."""
    sd = math.sqrt(max(var, 1e-8))
    weight = _tail_weight(predicted)
    scale = TAIL_SCALE
    if novel and model is not None and model.gp is not None:
        # A member at a value of a parameter the family's runtimes never varied in: most such switches
        # change little, some (shared memory on or off) change more than the whole measured spread. The
        # surprise component is widened by the family's spread and weighs more (NOVEL_TAIL_WEIGHT).
        spread = model.gp.prior_var * max(1.0, model.gp.loo_scale) ** 2
        scale = math.sqrt(TAIL_SCALE**2 + NOVEL_EFFECT_VAR * spread / sd**2)
        weight = 1.0 - (1.0 - weight) * (1.0 - NOVEL_TAIL_WEIGHT)
    return sd, weight, scale


def _mixture_bins(
    mean: float, core_sd: float, weight: float, scale: float = TAIL_SCALE
) -> tuple[list[float], list[float]]:
    """8 bins of a normal (weight 0), or of the heavier-tailed scale mixture (1-w) N(mean, sd) + w N(mean, k sd),
    and the mixture's mean within each bin.

    The GP's (LOO-corrected) spread fits the bulk of held-out errors; about one error in ten is a surprise
    two or more sds out, which the wide component carries.
    """
    a, ca = bins.normal_bins(mean, core_sd)
    if weight <= 0.0:
        return a, ca
    b, cb = bins.normal_bins(mean, core_sd * scale)
    core, tail = [(1.0 - weight) * p for p in a], [weight * q for q in b]
    return [p + q for p, q in zip(core, tail, strict=True)], bins.mix_centers([(core, ca), (tail, cb)], ca)


def _fmt_ms(log2_ms: float) -> str:
    ms = 2.0**log2_ms
    return f"{ms:.3g} ms"


@dataclass
class _Belief:
    """What is known about one kernel's log2 runtime in one query."""

    kind: str  # "measured" | "failed" | "model" | "unknown"
    mean: float = 0.0
    var: float = 0.0
    group: tuple[str, str, str] | None = None
    index: int = -1
    p_fail: float = 0.0
    status: str = ""
    cov_row: Array | None = None  # covariance with every kernel predicted in the same batch
    # "name=value" of parameters at a value the family's runtimes never varied from (FamilyModel.novel)
    novel: tuple[str, ...] = ()


# Measurements after the one a background hyperparameter optimisation started on until its result is used.
REFIT_LAG = 2
FAMILY_STATE_VERSION = 1  # of what LocalForecaster saves per family (_state_of)


@dataclass
class _Refit:
    """A hyperparameter optimisation running beside the request path (LocalForecaster._model)."""

    n_ok: int  # successful measurements it was started on
    apply_at: int  # the first fit with at least this many uses its result, waiting for it if need be
    keys: tuple[str, ...] = ()  # content keys of the points it was started on (a restarted process redoes it)
    signature: str = ""  # points_signature of those points
    done: threading.Event = field(default_factory=threading.Event)
    theta: Array | None = None  # its result; None if it had none (or failed)


@dataclass
class _GroupState:
    signature: str
    model: FamilyModel
    nbytes: int


def model_bytes(model: FamilyModel) -> int:
    """About how much memory a fitted family model holds: its arrays (the GP's n x n inverse dominates, once
    per fit and once more for the short-length-scale companion) and a few hundred bytes per measurement."""
    arrays = [model.x_all, model.failed_all, model.fail_ls]
    for gp in (model.gp, model.gp_short):
        if gp is not None:
            arrays.extend((gp.x, gp.alpha, gp.kinv))
    return sum(int(a.nbytes) for a in arrays) + 300 * (len(model.measured) + len(model.by_row))


class LocalForecaster:
    """The default, offline forecaster (see the module doc). Implements `Forecaster`."""

    name = "local"
    version = VERSION

    def __init__(
        self,
        history: FamilyHistory | None,
        nvcc: str | None = None,
        cache_dir: Path | None = None,
        *,
        ptxas_wait_s: float = 10.0,
        max_cached_families: int = 64,
        max_cache_bytes: int = 512 * 2**20,
        max_ptxas_per_call: int = MAX_PTXAS_PER_CALL,
    ) -> None:
        """`history`: the store (None: static prior only). `nvcc`: path or name (None: found on PATH).
        `cache_dir`: where ptxas results are kept between runs (None: memory only). `ptxas_wait_s`: the
        longest a forecast waits for nvcc on kernels it has not seen (0 turns ptxas off). Fitted family
        models are kept for at most `max_cached_families` families and `max_cache_bytes` of memory
        (`model_bytes`), least recently used dropped first; the one just fitted is always kept.
        `max_ptxas_per_call`: a call with more kernels not compiled yet compiles none of them (a screening call;
        an evaluation over a pairs file raises it)."""
        from forecaster_mcp.forecast.ptxas import find_nvcc

        self._history = history
        self._nvcc = find_nvcc(nvcc)
        self._cache_dir = cache_dir
        self._ptxas_wait_s = ptxas_wait_s
        self._max_ptxas_per_call = max_ptxas_per_call
        self._models: OrderedDict[tuple[str, str, str], _GroupState] = OrderedDict()
        self._warm: dict[tuple[str, str, str], Array] = {}
        self._hyper_n: dict[tuple[str, str, str], int] = {}
        # points_signature of the points the hyperparameters were last optimised on: the same points are not
        # optimised again (from a warm start that would move them a little, and differently after a restart).
        self._opt_signature: dict[tuple[str, str, str], str] = {}
        self._restored: set[tuple[str, str, str]] = set()  # families whose saved state was read
        self._refits: dict[tuple[str, str, str], _Refit] = {}
        self._locks: dict[tuple[str, str, str], anyio.Lock] = {}
        self._max_cached = max_cached_families
        self._max_bytes = max_cache_bytes
        self.cached_bytes = 0  # what the kept models hold (model_bytes)
        # (content key, GPU, workload key) -> features: blocks, waves and occupancy depend on all three.
        # With them, the source's compile error when nvcc found one (ptxas.PtxasError), else None.
        self._features: OrderedDict[tuple[str, str, str], tuple[StaticFeatures, PtxasError | None]] = (
            OrderedDict()
        )
        self.fits = 0  # how many family models were fitted (tests and benchmarks read it)
        # Content keys of stored anchors whose kernel_json this version refuses (_anchor_features): not parsed
        # again on every forecast of their workload.
        self._refused_anchors: OrderedDict[str, None] = OrderedDict()

    # ---- family models

    @staticmethod
    def _refit_hyperparameters(refit: _Refit, points: Sequence[FamilyPoint], warm: Array | None) -> None:
        try:
            model = fit_family(points, warm, True)
            if model.gp is not None:
                refit.theta = model.gp.theta
        finally:
            refit.done.set()

    async def _model(self, key: tuple[str, str, str]) -> FamilyModel | None:
        if self._history is None:
            return None
        points = await self._history.family_points(*key)
        if not points:
            return None
        signature = points_signature(points)
        state = self._models.get(key)
        if state is not None and state.signature == signature:
            self._models.move_to_end(key)
            return state.model
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            # Read again under the lock: a call that waited here must fit what is stored now, or a fit of
            # older points could replace the model another call just made of newer ones.
            points = await self._history.family_points(*key)
            signature = points_signature(points)
            state = self._models.get(key)
            if state is not None and state.signature == signature:
                return state.model
            if key not in self._restored:
                self._restored.add(key)
                await self._restore(key, points)
            saved = self._state_of(key)
            warm = self._warm.get(key)
            n_ok = sum(1 for p in points if p.status == _OK_STATUS)
            # Past 100 points, hyperparameters are re-optimised once the family has grown by 10% since the
            # last optimisation; in between, new points only update the posterior of the fit and of its
            # short-length-scale companion, from the cached model's (`_updated_inverse`; a forecast after one
            # new measurement: 0.09-0.13 s at 1,000 points, 0.15-0.18 s at 1,500, was 0.36-0.42 s and 1.0 s).
            # The optimisation runs beside the request path, and its result is used from the fit that has
            # REFIT_LAG more measurements on: always that one, waiting for it if need be, so that the same
            # measurements in the same order give the same forecasts however fast the machine is.
            pending = self._refits.get(key)
            if pending is not None and n_ok >= pending.apply_at:
                if not pending.done.is_set():
                    await anyio.to_thread.run_sync(pending.done.wait)
                # Another family's eviction may have forgotten this one meanwhile.
                self._refits.pop(key, None)
                if pending.theta is not None:
                    warm = self._warm[key] = pending.theta
                    self._hyper_n[key] = pending.n_ok
                    self._opt_signature[key] = pending.signature
            last = self._hyper_n.get(key, 0)
            refit = (warm is None or n_ok < 100) and self._opt_signature.get(key) != signature
            if warm is not None and n_ok >= 100 and n_ok >= last + last // 10 and key not in self._refits:
                pending = self._refits[key] = _Refit(
                    n_ok, n_ok + REFIT_LAG, tuple(p.content_key for p in points), signature
                )
                self._start_refit(pending, points, warm)
            previous = state.model if state is not None else None
            if len(points) > 40:
                # Big fits take tens of milliseconds or more: keep the event loop free meanwhile. Failed
                # points count too: they are encoded and fit the failure model (2,000 of them took 0.5 s).
                model = await anyio.to_thread.run_sync(fit_family, points, warm, refit, previous)
            else:
                model = fit_family(points, warm, refit, previous)
            self.fits += 1
            # A warm start of another shape (a define new to the family adds a dimension) is not used: fit_gp
            # optimised from the defaults, and that result must be kept, or every call until the next
            # background refit (100 measurements later at 1,000 points) optimised again (0.45 s, not 0.12 s).
            reshaped = warm is not None and model.gp is not None and model.gp.theta.shape != warm.shape
            if model.gp is not None and (refit or reshaped):
                # Only an optimisation writes hyperparameters back (a posterior-only fit kept `warm` as it was).
                self._warm[key] = model.gp.theta
                self._hyper_n[key] = n_ok
                self._opt_signature[key] = signature
            self._keep(key, _GroupState(signature, model, model_bytes(model)))
            if (now := self._state_of(key)) is not None and now != saved:
                await self._save(key, now)
        return model

    # ---- what a family's model keeps between processes (Store.save_family_state)

    def _start_refit(self, pending: _Refit, points: Sequence[FamilyPoint], warm: Array) -> None:
        threading.Thread(
            target=self._refit_hyperparameters, args=(pending, points, warm), daemon=True
        ).start()

    def _state_of(self, key: tuple[str, str, str]) -> str | None:
        """The family's hyperparameters, where they were optimised and the optimisation pending, as JSON."""
        warm = self._warm.get(key)
        if warm is None:
            return None
        pending = self._refits.get(key)
        return json.dumps(
            {
                "version": FAMILY_STATE_VERSION,
                "theta": [float(v) for v in warm],
                "n_ok": self._hyper_n.get(key, 0),
                "signature": self._opt_signature.get(key, ""),
                "pending": None
                if pending is None
                else {"n_ok": pending.n_ok, "apply_at": pending.apply_at, "keys": list(pending.keys),
                      "signature": pending.signature},
            }
        )  # fmt: skip

    async def _save(self, key: tuple[str, str, str], state: str) -> None:
        save = getattr(self._history, "save_family_state", None)
        if save is None:
            return
        try:
            await save(*key, state)
        except Exception:  # a store hiccup costs the restart's reproducibility, not the forecast
            log.warning("saving the family model's state failed", exc_info=True)

    async def _restore(self, key: tuple[str, str, str], points: Sequence[FamilyPoint]) -> None:
        """Start from what an earlier process kept of this family, so that the same measurements give the
        same forecasts across a restart; a pending optimisation is redone on the points it was started on."""
        load = getattr(self._history, "load_family_state", None)
        if load is None or key in self._warm:
            return
        try:
            text = await load(*key)
            if text is None:
                return
            d = json.loads(text)
            if d.get("version") != FAMILY_STATE_VERSION:
                raise ValueError(f"unknown version {d.get('version')!r}")
            theta = np.array([float(v) for v in d["theta"]], dtype=np.float64)
            if theta.ndim != 1 or not theta.size or not np.all(np.isfinite(theta)):
                raise ValueError("theta is not a vector of finite numbers")
            n_ok, signature, pending = int(d["n_ok"]), str(d["signature"]), d.get("pending")
            if pending is not None:
                keys = {str(k) for k in pending["keys"]}
                refit = _Refit(int(pending["n_ok"]), int(pending["apply_at"]), tuple(sorted(keys)),
                               str(pending.get("signature", "")))  # fmt: skip
        except Exception as exc:  # unreadable: fitted afresh, as before states were kept
            log.warning("ignoring the unreadable saved state of a kernel family: %s", exc)
            return
        self._warm[key], self._hyper_n[key], self._opt_signature[key] = theta, n_ok, signature
        if pending is not None and key not in self._refits:
            subset = [p for p in points if p.content_key in keys]
            if keys and len(subset) == len(keys):
                self._refits[key] = refit
                self._start_refit(refit, subset, theta)

    def _keep(self, key: tuple[str, str, str], state: _GroupState) -> None:
        """Cache a family's model, dropping the least recently used past the family and memory bounds. A
        model dropped for memory alone keeps its hyperparameters (a few numbers): its refit starts warm."""
        replaced = self._models.pop(key, None)
        if replaced is not None:
            self.cached_bytes -= replaced.nbytes
        self._models[key] = state
        self.cached_bytes += state.nbytes
        while len(self._models) > 1 and (
            len(self._models) > self._max_cached or self.cached_bytes > self._max_bytes
        ):
            old, dropped = self._models.popitem(last=False)
            self.cached_bytes -= dropped.nbytes
            # Dropped for memory alone, a family keeps its hyperparameters: its next fit starts warm.
            self._forget(old, hyperparameters=len(self._models) >= self._max_cached)
        # Hyperparameters of families dropped for memory are kept, within bounds too (never those of a family
        # being fitted now: it holds its lock).
        excess = len(self._warm) - 4 * self._max_cached
        for old in list(self._warm):  # a copy: _forget changes the dict
            if excess <= 0:
                break
            lock = self._locks.get(old)
            if old not in self._models and (lock is None or not lock.locked()):
                self._forget(old)
                excess -= 1

    def _forget(self, key: tuple[str, str, str], hyperparameters: bool = True) -> None:
        """Drop what is kept of a family: its lock unless a fit holds it, and (by default) its hyperparameters."""
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]
        if hyperparameters:
            self._warm.pop(key, None)
            self._hyper_n.pop(key, None)
            self._opt_signature.pop(key, None)
            self._restored.discard(key)  # read again from the store when the family comes back
            self._refits.pop(key, None)  # a running optimisation finishes unheard

    # ---- static features (prior path)

    def _static(
        self,
        kernels: Sequence[Kernel],
        q: PairQuery,
        usage: Mapping[tuple[str, str], PtxasUsage | PtxasError],
        skipped: frozenset[str] = frozenset(),
        feature_key: Callable[[Kernel, PairQuery], tuple[str, str, str]] | None = None,
    ) -> list[tuple[StaticFeatures, PtxasError | None]]:
        """Static features of `kernels` (in order) for the pair `q` (its GPU and workload), each with its compile
        error, from the ptxas results in `usage` (by content key and architecture; see `_ptxas_for`). Kept per
        kernel, GPU and workload (`_feature_key`, or the call's memoised `feature_key`), with or without ptxas (the same
        question gets the same answer, and a compile that timed out is not retried on every call), except for
        kernels in `skipped` (content keys a crowded call, or a server busy compiling, did not compile): a later
        call compiles them."""
        arch = _arch_of(q)
        key_of = feature_key or _feature_key
        out: list[tuple[StaticFeatures, PtxasError | None]] = []
        for k in kernels:
            key = key_of(k, q)
            cached = self._features.get(key)
            if cached is None:
                u = usage.get((key[0], arch))
                entry = u.for_entry(k.entry) if isinstance(u, PtxasUsage) else None
                error = u if isinstance(u, PtxasError) else None
                feats = kernel_features(k, q.workload, q.hardware, entry)
                if entry is not None and isinstance(u, PtxasUsage) and u.without_headers:
                    feats = replace(feats, compiled_without=u.without_headers)
                cached = (feats, error)
                if key[0] not in skipped:
                    self._keep_features(key, cached)
            out.append(cached)
        return out

    def _keep_features(
        self, key: tuple[str, str, str], features: tuple[StaticFeatures, PtxasError | None]
    ) -> None:
        """Cache a kernel's static features (by content key, GPU and workload), the oldest dropped past 4,096."""
        self._features[key] = features
        while len(self._features) > 4096:
            self._features.popitem(last=False)

    async def _anchor_points(self, hardware: str, workload_key: str) -> list[AnchorPoint]:
        """The latest measured kernels of MAX_ANCHORS + 2 families on this workload and GPU (two more: a pair's
        own two families are left out of its anchors); none from a history that keeps no anchors (a
        benchmark's). Their kernels are parsed by `_anchor_features`, off the event loop."""
        fetch = getattr(self._history, "workload_anchors", None)
        if fetch is None:
            return []
        points: list[AnchorPoint] = await fetch(hardware, workload_key, MAX_ANCHORS + 2)
        return points

    def _anchor_features(
        self,
        points: Sequence[AnchorPoint],
        families: tuple[str, str],
        q: PairQuery,
        workload_key: str,
    ) -> list[tuple[StaticFeatures, StaticFeatures, float]]:
        """Static features and log2 runtime of the anchors of pair `q` (kernels of the pair's own families left
        out), at most MAX_ANCHORS: with the registers and shared memory as measured (`MeasureResult.resources`),
        and without (to set beside a kernel ptxas did not compile: `_prior_forecast`). Run in a worker thread: a
        kernel not yet in the feature cache is parsed here (its validation reads a source of up to 1 MB, about
        0.1 s), and only its features are kept. An anchor whose features cannot be made is left out."""
        out = []
        for p in points:
            if p.family_key in families:
                continue
            key = (p.content_key, q.hardware_name, workload_key)
            bare_key = (f"{p.content_key}{_NO_RESOURCES}", q.hardware_name, workload_key)
            cached, bare = self._features.get(key), self._features.get(bare_key)
            if cached is None or bare is None:
                if p.content_key in self._refused_anchors:
                    continue
                try:
                    kernel = Kernel.model_validate_json(p.kernel_json)
                    src = kernel_source_features(kernel, q.hardware)
                    cached = (
                        with_resources(
                            src, kernel, q.hardware, measured_entry(kernel, p.resources), q.workload
                        ),
                        None,
                    )
                    bare = (with_resources(src, kernel, q.hardware, None, q.workload), None)
                except Exception:
                    # Stored by an older version under rules this one refuses, or features this version cannot
                    # make of it: not an anchor (the pair is forecast from the others).
                    log.debug("anchor %s left out", p.content_key, exc_info=True)
                    self._refused_anchors[p.content_key] = None
                    while len(self._refused_anchors) > 256:
                        self._refused_anchors.popitem(last=False)
                    continue
                self._keep_features(key, cached)
                self._keep_features(bare_key, bare)
            out.append((cached[0], bare[0], math.log2(p.runtime_ms)))
            if len(out) >= MAX_ANCHORS:
                break
        return out

    def _sibling_features(
        self, target: Kernel, points: Sequence[FamilyPoint], q: PairQuery, workload_key: str
    ) -> list[tuple[StaticFeatures, float]]:
        """Static features (without ptxas's resources: most were never compiled here) and log2 runtime of the
        measured configurations of `target`'s young family: `target` under each one's defines, launch and
        flags. Run in a worker thread, as `_anchor_features`; cached under the anchors' keys. A configuration
        whose features cannot be made (a launch stored by an older version under rules this one refuses) is left
        out, as such an anchor is: the pair is estimated from the others, or forecast as before without them."""
        out = []
        for p in points:
            if p.runtime_ms is None or p.runtime_ms <= 0:
                continue
            key = (f"{p.content_key}{_NO_RESOURCES}", q.hardware_name, workload_key)
            cached = self._features.get(key)
            if cached is None:
                try:
                    launch = Launch.model_validate(p.launch) if p.launch is not None else None
                    sibling = target.model_copy(
                        update={
                            "defines": dict(p.defines),
                            "launch": launch,
                            "compile_options": p.compile_options,
                        }
                    )
                    features = with_resources(
                        kernel_source_features(sibling, q.hardware), sibling, q.hardware, None, q.workload
                    )
                except Exception:
                    log.debug("measured configuration %s left out", p.content_key, exc_info=True)
                    continue
                cached = (features, None)
                self._keep_features(key, cached)
            out.append((cached[0], math.log2(p.runtime_ms)))
        return out

    def _compilable(self, k: Kernel) -> bool:
        return (
            self._nvcc is not None
            and self._ptxas_wait_s > 0
            # Not the CUDA in a Python kernel's strings (features.embedded_cuda): CuPy compiles it with NVRTC and
            # its own headers, torch with its headers and flags, neither as this nvcc would, so its error would not
            # be the kernel's; and its text, unescaped, never passed the Kernel's source checks as written.
            and k.language == "cuda"
            # A source of comments only (a replay's stand-in for a recorded kernel) has nothing to compile.
            and ("__global__" in k.source or _CODE.search(_COMMENTS.sub(" ", k.source)) is not None)
        )

    async def _ptxas_for(
        self,
        queries: Sequence[PairQuery],
        feature_key: Callable[[Kernel, PairQuery], tuple[str, str, str]] | None = None,
    ) -> tuple[dict[tuple[str, str], PtxasUsage | PtxasError], frozenset[str]]:
        """ptxas results (by content key and architecture) for the kernels of these prior-path pairs whose
        features are not cached, compiled for the whole call at once, two at a time, within one wait of
        ptxas_wait_s (+1 s), or their compile errors; and the content keys left uncompiled because the call had
        more than MAX_PTXAS_PER_CALL of them (a screening call: those are compiled when asked about in a smaller
        one) or because no compile slot of the server came free within the wait (compiled on a later call)."""
        from forecaster_mcp.forecast.ptxas import ptxas_results

        key_of = feature_key or _feature_key
        todo: dict[tuple[str, str], Kernel] = {}  # (content key, arch) -> kernel
        for q in queries:
            arch = _arch_of(q)
            for k in (q.baseline, q.candidate):
                key = key_of(k, q)
                if key not in self._features and self._compilable(k):
                    todo.setdefault((key[0], arch), k)
        usage: dict[tuple[str, str], PtxasUsage | PtxasError] = {}
        # nvcc takes a second or two per kernel: worth it for the few kernels of an agent's question, not
        # for a screening call over dozens of configurations (those have the family model, or nothing).
        if not todo:
            return usage, frozenset()
        if len(todo) > self._max_ptxas_per_call:
            return usage, frozenset(ck for ck, _ in todo)
        assert self._nvcc is not None
        jobs = {key: (k, key[1]) for key, k in todo.items()}
        unstarted: set[tuple[str, str]] = set()
        found = await ptxas_results(
            jobs, self._nvcc, self._cache_dir, self._ptxas_wait_s, unstarted=unstarted
        )
        # A compile that never got a compile slot (a busy server) says nothing of the kernel: not kept, as a
        # crowded call's kernels are not, so the next call compiles it.
        return found, frozenset(ck for ck, _ in unstarted)

    # ---- forecasting

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        """One BinForecast per query (bins conditional on both kernels running; see module doc)."""
        # Hashing a kernel is not free (its source is hashed): once per kernel object per call.
        keys: dict[int, tuple[str, str]] = {}
        workload_keys: dict[int, str] = {}
        for q in queries:
            for k in (q.baseline, q.candidate):
                if id(k) not in keys:
                    keys[id(k)] = (k.family_key(), k.content_key())
            if id(q.workload) not in workload_keys:
                workload_keys[id(q.workload)] = q.workload.history_key()

        def group_of(k: Kernel, q: PairQuery) -> tuple[str, str, str]:
            return (keys[id(k)][0], q.hardware_name, workload_keys[id(q.workload)])

        def feature_key(
            k: Kernel, q: PairQuery
        ) -> tuple[str, str, str]:  # _feature_key, from the hashes above
            return (keys[id(k)][1], q.hardware_name, workload_keys[id(q.workload)])

        # A family whose model cannot be built or queried costs only its own pairs (PartialForecast).
        broken: dict[tuple[str, str, str], Exception] = {}
        groups: dict[tuple[str, str, str], FamilyModel | None] = {}
        for q in queries:
            for k in (q.baseline, q.candidate):
                key = group_of(k, q)
                if key not in groups:
                    try:
                        groups[key] = await self._model(key)
                    except Exception as exc:
                        groups[key], broken[key] = None, exc

        # Batch every unmeasured kernel of a usable family into one joint prediction.
        wanted: dict[tuple[str, str, str], dict[str, tuple[int, dict[str, Any]]]] = {}
        for q in queries:
            for k in (q.baseline, q.candidate):
                key = group_of(k, q)
                model = groups[key]
                ck = keys[id(k)][1]
                if model is None or not model.usable or key in broken:
                    continue
                try:
                    row = kernel_params(dict(k.defines), _launch_dict(k), k.compile_options)
                    if model.lookup(ck, row) is not None:  # measured (under this spelling or another)
                        continue
                except Exception as exc:
                    broken[key] = exc
                    continue
                slots = wanted.setdefault(key, {})
                if ck not in slots:
                    slots[ck] = (len(slots), row)
        predictions: dict[tuple[str, str, str], tuple[Array, Array, Array]] = {}
        for key, slots in wanted.items():
            model = groups[key]
            assert model is not None
            if key in broken:
                continue
            rows = [row for _, row in sorted(slots.values(), key=lambda s: s[0])]
            try:
                mean, cov = model.predict(rows)
                predictions[key] = (mean, cov, model.p_fail(rows))
            except Exception as exc:
                broken[key] = exc

        beliefs: list[tuple[_Belief, _Belief] | Exception] = []
        for q in queries:
            kb, kc = group_of(q.baseline, q), group_of(q.candidate, q)
            if kb in broken or kc in broken:
                beliefs.append(broken.get(kb) or broken[kc])
                continue
            try:
                b = self._belief(
                    q.baseline, keys[id(q.baseline)][1], kb, groups[kb], wanted.get(kb), predictions.get(kb)
                )
                c = self._belief(
                    q.candidate, keys[id(q.candidate)][1], kc, groups[kc], wanted.get(kc), predictions.get(kc)
                )
                beliefs.append((b, c))
            except Exception as exc:
                beliefs.append(exc)

        def prior_path(belief: tuple[_Belief, _Belief] | Exception) -> bool:
            # A kernel measured as failed is certain whatever is known of the other one.
            if isinstance(belief, Exception):
                return False
            kinds = (belief[0].kind, belief[1].kind)
            return "failed" not in kinds and "unknown" in kinds

        # ptxas for the whole call at once: its per-call cap applies to the call, not to each pair in turn.
        usage, skipped = await self._ptxas_for(
            [q for q, bc in zip(queries, beliefs, strict=True) if prior_path(bc)], feature_key
        )

        # Pairs of different kernels, one measured and one not: the measured kernels of their workload anchor the
        # unmeasured one's runtime (features.anchored_log2_ms), fetched once per workload and GPU. Those whose
        # unknown kernel is a configuration of a young family (some of its configurations measured, too few for its
        # model) and whose other one is measured or modelled: the family's measured configurations estimate it
        # (features.sibling_log2_ms), in place of the anchors.
        anchored: dict[int, tuple[str, str]] = {}
        young: dict[int, tuple[bool, FamilyModel]] = {}
        for i, (q, belief) in enumerate(zip(queries, beliefs, strict=True)):
            if not prior_path(belief) or isinstance(belief, Exception):
                continue
            if keys[id(q.baseline)][0] == keys[id(q.candidate)][0]:
                continue
            b, c = belief
            if {b.kind, c.kind} == {"measured", "unknown"}:
                anchored[i] = (q.hardware_name, workload_keys[id(q.workload)])
            for target_is_candidate, (known, unknown, k) in (
                (True, (b, c, q.candidate)),
                (False, (c, b, q.baseline)),
            ):
                model = groups[group_of(k, q)]
                if (
                    unknown.kind == "unknown"
                    and known.kind in ("measured", "model")
                    and model
                    and model.young
                ):
                    young[i] = (target_is_candidate, model)
        anchor_points = {where: await self._anchor_points(*where) for where in set(anchored.values())}

        def statics() -> tuple[
            dict[int, list[tuple[StaticFeatures, PtxasError | None]] | Exception],
            dict[int, list[tuple[StaticFeatures, StaticFeatures, float]]],
            dict[int, list[tuple[StaticFeatures, float]]],
        ]:
            found: dict[int, list[tuple[StaticFeatures, PtxasError | None]] | Exception] = {}
            anchors: dict[int, list[tuple[StaticFeatures, StaticFeatures, float]]] = {}
            siblings: dict[int, list[tuple[StaticFeatures, float]]] = {}
            for i, (q, belief) in enumerate(zip(queries, beliefs, strict=True)):
                if prior_path(belief):
                    try:
                        found[i] = self._static([q.baseline, q.candidate], q, usage, skipped, feature_key)
                        if i in young:
                            target_is_candidate, model = young[i]
                            target = q.candidate if target_is_candidate else q.baseline
                            siblings[i] = self._sibling_features(
                                target, model.young, q, workload_keys[id(q.workload)]
                            )
                        # Anchors are not used beside a young family's configurations (_prior_forecast).
                        if i in anchored and not siblings.get(i):
                            families = (keys[id(q.baseline)][0], keys[id(q.candidate)][0])
                            where = anchored[i]
                            anchors[i] = self._anchor_features(anchor_points[where], families, q, where[1])
                    except Exception as exc:
                        found[i] = exc
            return found, anchors, siblings

        # Reading sources (agent-written, up to 1 MB each) off the event loop: other calls go on meanwhile.
        static_of, anchors_of, siblings_of = (
            await anyio.to_thread.run_sync(statics) if any(map(prior_path, beliefs)) else ({}, {}, {})
        )
        out: list[BinForecast | None] = []
        errors: list[Exception] = []
        for i, (q, belief) in enumerate(zip(queries, beliefs, strict=True)):
            if isinstance(belief, Exception):
                out.append(None)
                errors.append(belief)
                continue
            b, c = belief
            kc = group_of(q.candidate, q)
            try:
                if prior_path(belief):
                    feats = static_of[i]
                    if isinstance(feats, Exception):
                        raise feats
                    (fb, eb), (fc, ec) = feats
                    out.append(
                        self._prior_forecast(
                            q, b, c, groups[kc], fb, fc, eb, ec, anchors_of.get(i, []), siblings_of.get(i, [])
                        )
                    )
                else:
                    out.append(self._pair_forecast(b, c, groups[group_of(q.baseline, q)], groups[kc]))
            except Exception as exc:
                out.append(None)
                errors.append(exc)
        if errors:
            first = errors[0]
            raise PartialForecast(
                f"failed on {len(errors)} of {len(queries)} pairs ({type(first).__name__}: {first})", out
            ) from first
        return [f for f in out if f is not None]

    def _belief(
        self,
        kernel: Kernel,
        ck: str,
        key: tuple[str, str, str],
        model: FamilyModel | None,
        slots: dict[str, tuple[int, dict[str, Any]]] | None,
        prediction: tuple[Array, Array, Array] | None,
    ) -> _Belief:
        if model is None:
            return _Belief("unknown")
        row = kernel_params(dict(kernel.defines), _launch_dict(kernel), kernel.compile_options)
        m = model.lookup(ck, row)
        if m is not None:
            if m.ok and m.log2_ms is not None:
                return _Belief("measured", m.log2_ms, model.measurement_sd_log2**2, status=m.status)
            return _Belief("failed", p_fail=1.0, status=m.status)
        if slots is None or prediction is None or ck not in slots:
            return _Belief("unknown", p_fail=float(model.p_fail([row])[0]))
        i = slots[ck][0]
        mean, cov, pf = prediction
        return _Belief(
            "model", float(mean[i]), float(cov[i, i]), key, i, float(pf[i]), cov_row=cov[i],
            novel=tuple(sorted(f"{n}={v}" for n, v in model.novel(row))),
        )  # fmt: skip

    def _pair_forecast(
        self, b: _Belief, c: _Belief, base_model: FamilyModel | None, cand_model: FamilyModel | None
    ) -> BinForecast:
        model = cand_model or base_model
        n_points = float(len(model.measured)) if model is not None else 0.0
        n_ok = float(model.n_ok) if model is not None else 0.0
        extras = {
            "n_family_points": n_points,
            "n_family_ok": n_ok,
            "p_fail": c.p_fail,
            "p_fail_baseline": b.p_fail,
            "measured": 1.0 if c.kind in ("measured", "failed") else 0.0,
            "baseline_measured": 1.0 if b.kind in ("measured", "failed") else 0.0,
        }
        if c.kind == "model" and model is not None:
            # The candidate against a measured kernel of its family, its predicted runtime alone: what measure_next
            # values it by against the family's best measured kernel when the baseline has no measured runtime
            # (not measured, or failed; acquisition.against_best). The spread is what a measured baseline gives.
            c_sd, c_weight, c_scale = _spread(model.measurement_sd_log2**2 + c.var, 1, bool(c.novel), model)
            extras.update(
                cand_log2_ms=c.mean,
                cand_sd_log2=c_sd * _tail_sd_factor(c_weight, c_scale),
                cand_tail_weight=c_weight,
                cand_tail_scale=c_scale,
            )
        if c.kind == "failed":
            extras.update(mu_log2=-4.0, sd_log2=0.0)
            return BinForecast(bins.one_hot(2.0**-4), f"candidate failed when measured ({c.status})", extras)
        if b.kind == "failed":
            extras.update(mu_log2=4.0, sd_log2=0.0)
            return BinForecast(bins.one_hot(16.0), f"baseline failed when measured ({b.status})", extras)
        mean = b.mean - c.mean
        var = b.var + c.var
        if b.kind == "model" and c.kind == "model" and b.group == c.group and b.cov_row is not None:
            # Model errors of two members of one family are correlated: the GP's joint posterior says how much.
            var -= 2.0 * float(b.cov_row[c.index])
        predicted = int(b.kind == "model") + int(c.kind == "model")
        sd, weight, scale = _spread(var, predicted, bool(b.novel or c.novel), model)
        # sd_log2 is the overall spread; acquisition recovers the core from it and the tail shape.
        extras.update(mu_log2=mean, sd_log2=sd * _tail_sd_factor(weight, scale))
        if weight > 0.0:
            extras.update(tail_weight=weight, tail_scale=scale)
        probs, centers = _mixture_bins(mean, sd, weight, scale)
        return BinForecast(probs, self._rationale(b, c, mean, sd, n_points, model), extras, centers)

    def _rationale(
        self, b: _Belief, c: _Belief, mean: float, sd: float, n_points: float, model: FamilyModel | None
    ) -> str:
        speed = 2.0**mean
        if b.kind == "measured" and c.kind == "measured":
            return f"both measured: {_fmt_ms(c.mean)} vs baseline {_fmt_ms(b.mean)}"
        n_ok = model.n_ok if model is not None else 0
        fails = f" (and {model.n_failed} that failed)" if model is not None and model.n_failed else ""
        parts = [f"family model on {n_ok} measurements{fails}"]
        if c.kind == "model":
            parts.append(
                f"candidate predicted {_fmt_ms(c.mean)} (±{(2.0 ** math.sqrt(c.var) - 1) * 100:.0f}%)"
            )
        else:
            parts.append(f"candidate measured {_fmt_ms(c.mean)}")
        if b.kind == "measured":
            parts.append(f"baseline measured {_fmt_ms(b.mean)}")
        else:
            parts.append(f"baseline predicted {_fmt_ms(b.mean)}")
        parts.append(f"speedup ~{bins.speedup_text(speed)}x (log2 sd {sd:.2f})")
        if c.p_fail >= 0.2:
            parts.append(f"P(candidate fails) {c.p_fail:.2f}")
        novel = sorted(set(b.novel) | set(c.novel))
        if novel:
            parts.append(f"{', '.join(novel[:3])} never measured in this family: its effect is a guess")
        return "; ".join(parts)

    def _prior_forecast(
        self,
        q: PairQuery,
        b: _Belief,
        c: _Belief,
        cand_model: FamilyModel | None,
        fb: StaticFeatures,
        fc: StaticFeatures,
        eb: PtxasError | None = None,
        ec: PtxasError | None = None,
        anchors: Sequence[tuple[StaticFeatures, StaticFeatures, float]] = (),
        siblings: Sequence[tuple[StaticFeatures, float]] = (),
    ) -> BinForecast:
        """The static prior of a pair, from both kernels' static features and compile errors (`_static`). Its
        bins are conditional on both kernels running, as every forecast's are; a compile error raises the
        kernel's chance of failing (`_compile_p_fail`) and leads the rationale. `anchors`: measured kernels of
        other families on the pair's workload and GPU (features, log2 ms), when one kernel of the pair is
        measured and the other not: with them the unmeasured one's runtime is anchored on all the measured
        ones (features.anchored_log2_ms), not on the pair's other kernel alone. `siblings`: measured
        configurations of the unknown kernel's young family (features, log2 ms), when the other kernel is
        measured or modelled: they estimate it (features.sibling_log2_ms), in place of the static prior and its
        anchors, whose error they share."""
        # A kernel measured running compiled where it was measured, whatever this nvcc says.
        eb = eb if b.kind != "measured" else None
        ec = ec if c.kind != "measured" else None
        # A header this server lacks (a PyTorch extension's torch/extension.h, CUTLASS) says nothing of the
        # kernel: read without ptxas's figures, as a kernel of another language is, and the rationale says so.
        hb = missing_header(eb) if eb is not None else None
        hc = missing_header(ec) if ec is not None else None
        unbuilt = [(who, h) for who, h in (("candidate", hc), ("baseline", hb)) if h is not None]
        eb = None if hb is not None else eb
        ec = None if hc is not None else ec
        fb, fc = _like_for_like(fb, fc, q)
        # A kernel measured running ran, whatever its source says.
        lacks_b = _without_matrix_units(q.baseline, fb, q) if b.kind != "measured" else None
        lacks_c = _without_matrix_units(q.candidate, fc, q) if c.kind != "measured" else None
        same_family = q.baseline.family_key() == q.candidate.family_key()
        shift = prior_shift(fb, fc, same_family=same_family)
        n_points = float(len(cand_model.measured)) if cand_model is not None else 0.0
        extras = {
            "mu_log2": shift.mean_log2,
            "sd_log2": shift.sd_log2,
            "p_fail": max(c.p_fail, _compile_p_fail(ec, q), P_FAIL_NO_MATRIX_UNITS if lacks_c else 0.0),
            "p_fail_baseline": max(
                b.p_fail, _compile_p_fail(eb, q), P_FAIL_NO_MATRIX_UNITS if lacks_b else 0.0
            ),
            "n_family_points": n_points,
            "n_family_ok": float(cand_model.n_ok) if cand_model is not None else 0.0,
            "measured": 1.0 if c.kind == "measured" else 0.0,
            "baseline_measured": 1.0 if b.kind == "measured" else 0.0,
            "prior": 1.0,
        }
        if same_family:
            n_ok = int(extras["n_family_ok"])
            # "only 0 measurements" read as if a count had been expected, on every first call of a tuning space.
            why = (
                f"no measurement of this family yet (need {MIN_FAMILY_POINTS})"
                if n_ok == 0
                else f"only {n_ok} measurement{'' if n_ok == 1 else 's'} of this family (need {MIN_FAMILY_POINTS})"
            )
        else:
            why = "different kernels, not both measured or modelled"
        mean, sd = shift.mean_log2, shift.sd_log2
        what = "static prior"
        if anchors and not siblings and {b.kind, c.kind} == {"measured", "unknown"}:
            # Registers as measured beside a kernel ptxas did not compile would tilt the occupancy term towards it.
            target = fc if c.kind == "unknown" else fb
            used = [(f if target.registers is not None else bare, t) for f, bare, t in anchors]
            if c.kind == "unknown":
                est = anchored_log2_ms(fc, [(fb, b.mean), *used], target_is_candidate=True)
                anchored_mean, who = b.mean - est.log2_ms, "candidate"
            else:
                est = anchored_log2_ms(fb, [(fc, c.mean), *used], target_is_candidate=False)
                anchored_mean, who = est.log2_ms - c.mean, "baseline"
            if est.used > 1:  # else none was near enough: the pair's own kernel alone, the plain prior
                mean, sd = anchored_mean, est.sd_log2
                extras.update(mu_log2=mean, sd_log2=sd, anchors=float(est.used))
                what = (
                    f"static prior anchored on {est.used} measured kernels of this workload ({who} estimated "
                    f"{_fmt_ms(est.log2_ms)})"
                )
        if siblings:
            target_is_candidate = c.kind == "unknown"
            target = fc if target_is_candidate else fb
            target = with_resources(
                target.source,
                q.candidate if target_is_candidate else q.baseline,
                q.hardware,
                None,
                q.workload,
            )
            est = sibling_log2_ms(target, siblings, target_is_candidate)
            known = b if target_is_candidate else c
            mean = known.mean - est.log2_ms if target_is_candidate else est.log2_ms - known.mean
            spread = math.sqrt(est.sd_log2**2 + known.var)
            sd = sibling_spread(mean, spread)
            extras.update(mu_log2=mean, sd_log2=sd, siblings=float(est.used))
            extras[MAX_CONFIDENCE] = SIBLING_MAX_CONFIDENCE
            who = "candidate" if target_is_candidate else "baseline"
            n = est.used
            rationale = (
                f"{who} estimated from {n} measured configuration{'' if n == 1 else 's'} of its own kernel "
                f"(same source, other defines or launch): {_fmt_ms(est.log2_ms)} against "
                f"{'measured' if known.kind == 'measured' else 'modelled'} {_fmt_ms(known.mean)}"
            )
            if sd > spread:
                rationale += f" (at most {SIBLING_MAX_CONFIDENCE:.0%} sure from so few)"
        elif shift.reasons:
            rationale = f"{what} ({why}): " + ", ".join(shift.reasons[:4])
        else:
            # Anchored, the two may still differ: what the measured kernels say of this workload decides.
            same = "no informative static difference" + (", near 50/50" if what == "static prior" else "")
            rationale = f"{what} ({why}): {same}"
        # Python sources say little (features.PYTHON_LANGUAGES) unless their strings hold the kernel's CUDA
        # (features.embedded_cuda): the rationale says what was read.
        pair = ((q.baseline, fb), (q.candidate, fc))
        unread = sorted(
            {k.language for k, f in pair if k.language in PYTHON_LANGUAGES and not f.source.embedded_cuda}
        )
        embedded = sorted({k.language for k, f in pair if f.source.embedded_cuda})
        if unread:
            rationale += (
                f"; {' and '.join(unread)} source read for tl.dot and fp64 only, not its memory access"
            )
        if embedded:
            rationale += f"; {' and '.join(embedded)} source read for the CUDA in its string literals"
        read = [
            f"{who}'s {f.launch_from_source}"
            for who, f in (("baseline", fb), ("candidate", fc))
            if f.launch_from_source
        ]
        if read:
            rationale += f"; launch read from the source's host code: {'; '.join(read)}"
        alone = [
            (who, f.compiled_without)
            for who, f in (("candidate", fc), ("baseline", fb))
            if f.compiled_without
        ]
        if alone:
            who, headers = _who_lacks(alone)
            rationale += f"; {who}: device code compiled here alone, without host code (this server's nvcc has no {headers})"
        if unbuilt:
            who, headers = _who_lacks([(w, (h,)) for w, h in unbuilt])
            rationale += f"; {who} not compiled here (this server's nvcc has no {headers}): read without register counts"
        lacking = [
            (who, why) for who, why in (("candidate", lacks_c), ("baseline", lacks_b)) if why is not None
        ]
        failing = [(who, e) for who, e in (("candidate", ec), ("baseline", eb)) if e is not None]
        if ec is not None:
            extras["compile_error"] = 1.0
        if eb is not None:
            extras["compile_error_baseline"] = 1.0
        if failing or lacking:
            said = "; ".join(
                [f"{who} {_compile_error_text(e, q)}" for who, e in failing]
                + [f"{who} {why}" for who, why in lacking if who not in dict(failing)]
            )
            rationale = f"{said}; if both ran, {rationale}"
        probs, centers = bins.normal_bins(mean, sd)
        return BinForecast(probs, rationale, extras, centers)


def _who_lacks(found: Sequence[tuple[str, Sequence[str]]]) -> tuple[str, str]:
    """("candidate and baseline", "ATen/ATen.h, torch/extension.h"): the kernels named, and the headers this
    server's nvcc lacks for them, each once."""
    return " and ".join(w for w, _ in found), ", ".join(sorted({h for _, hs in found for h in hs}))


def _like_for_like(
    fb: StaticFeatures, fc: StaticFeatures, q: PairQuery
) -> tuple[StaticFeatures, StaticFeatures]:
    """The pair's features with ptxas's resources on both sides or on neither. A kernel ptxas did not compile (a
    HIP, OpenCL or Python source, a crowded call's kernels past MAX_PTXAS_PER_CALL, a timeout, a compile error)
    has no registers or static shared memory, and its occupancy counts none: set beside a compiled kernel's
    figures, the occupancy term leaned its way, up to 0.5 log2 against a kernel of 255 registers a thread at 256
    threads (a CUDA kernel against its own HIP twin gave the twin p_faster 0.66). Except a compiled kernel whose
    resources leave it no block on an SM at its block size (occupancy 0): that it cannot launch is its own fact,
    not a comparison, and read without them it was judged as a kernel that runs (against a Triton kernel, a CUDA
    kernel of 255 registers a thread at 1024 threads went from 'candidate cannot launch' to favoured)."""
    if (fb.registers is None) == (fc.registers is None):
        return fb, fc
    if fb.occupancy == 0.0 or fc.occupancy == 0.0:
        return fb, fc
    if fb.registers is not None:
        return with_resources(fb.source, q.baseline, q.hardware, None, q.workload), fc
    return fb, with_resources(fc.source, q.candidate, q.hardware, None, q.workload)


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?(?:\*/|\Z)", re.DOTALL)
_CODE = re.compile(r"\S")


def _on_own_arch(e: PtxasError, q: PairQuery) -> bool:
    """Whether `e` was found compiling for the pair's GPU's own architecture (not a stand-in)."""
    spec = q.hardware
    return spec is not None and spec.vendor == "nvidia" and e.arch == spec.arch


def _without_matrix_units(kernel: Kernel, f: StaticFeatures, q: PairQuery) -> str | None:
    """Why `kernel` cannot compile for the pair's GPU, when it uses tensor-core (matrix) instructions the GPU has
    not (see P_FAIL_NO_MATRIX_UNITS); None when it may."""
    spec = q.hardware
    if spec is None or spec.tensor_cores or f.source.tensor_core == 0:
        return None
    if (spec.vendor, kernel.language) not in (("nvidia", "cuda"), ("amd", "hip")):
        return None
    if _ARCH_TEST.search(kernel.source):
        return None
    if spec.vendor == "nvidia":
        return (
            f"uses tensor-core instructions (wmma, mma, ldmatrix...), which {spec.arch} lacks (tensor cores from "
            "sm_70 on): it cannot compile there"
        )
    return f"uses matrix instructions (MFMA, WMMA), which {spec.arch} lacks: it cannot compile there"


def _compile_p_fail(e: PtxasError | None, q: PairQuery) -> float:
    """A kernel's chance of failing for its compile error (0 without one): see P_FAIL_COMPILE_ERROR."""
    if e is None:
        return 0.0
    return P_FAIL_COMPILE_ERROR if _on_own_arch(e, q) else P_FAIL_COMPILE_ERROR_STAND_IN


def _compile_error_text(e: PtxasError, q: PairQuery) -> str:
    """'does not compile (...): <first error line>', saying which architecture the error was found for."""
    if _on_own_arch(e, q):
        where = f"this server's nvcc for {e.arch}"
    else:
        target = (
            q.hardware.arch if q.hardware is not None and q.hardware.vendor == "nvidia" else "an unknown GPU"
        )
        where = (
            f"this server's nvcc for {e.arch}, a stand-in for {target}: an error tied to the architecture may not "
            "recur there"
        )
    return f"does not compile ({where}): {e.message}"


def _feature_key(k: Kernel, q: PairQuery) -> tuple[str, str, str]:
    """What a kernel's static features depend on: its content, the GPU and the workload."""
    return (k.content_key(), q.hardware_name, q.workload.key())


def _arch_of(q: PairQuery) -> str:
    """The architecture a pair's kernels are compiled for by ptxas: its NVIDIA GPU's, else sm_80."""
    spec = q.hardware
    return spec.arch if spec is not None and spec.vendor == "nvidia" else "sm_80"


# Marks the feature-cache key of an anchor's features made without its measured resources (_anchor_features).
_NO_RESOURCES = "#without-resources"


def _launch_dict(kernel: Kernel) -> dict[str, Any] | None:
    return kernel.launch.model_dump() if kernel.launch is not None else None
