"""Static features of a kernel: launch shape, source constructs, ptxas resources, and a prior from them.

Source features are counted on the comment-stripped source after conditional compilation with the
kernel's `defines` (so `#if USE_SHMEM` blocks count only when enabled). Counts are regex-based: they say
"this kernel uses vector loads / tensor cores / shared memory", not how often at run time. A HIP or OpenCL kernel
gets the features of its CUDA twin (`_as_cuda`, _DIALECT_PATTERNS); a Python one holding CUDA C in its string
literals (CuPy's RawKernel, PyCUDA's SourceModule, torch's load_inline) those of that CUDA (`embedded_cuda`); a
Triton or other Python one only those its source states plainly (PYTHON_LANGUAGES).

`prior_shift` turns the differences between two kernels' features into a log2-speedup shift with a wide
spread: mild hand-set heuristics (occupancy, waves, spills, tensor cores) plus a few terms fitted on measured
pairs of different kernels (uncoalesced row-strided access, one global atomic per element, shared-memory
tiling, vector loads, warp shuffles, and the work each thread does: how many threads the launch starts for the
same workload). Two small data-flow passes find the first two: a "lane-fast" index
(derived from threadIdx.x without a division) multiplied by a run-time size, and global atomics that every
thread issues.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import math
import operator
import re
import statistics
import string
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from forecaster_mcp.forecast.ptxas import PtxasEntry
from forecaster_mcp.hardware.specs import GpuSpec
from forecaster_mcp.models import Kernel, Language, Workload

# ---------------------------------------------------------------- comments and the preprocessor

# A literal left open at the end of its line ends there (as the compiler's error would): otherwise every quote
# of `"\"\"\"...` started a scan to the line's end and found no close, quadratic (80 KB took 32 s). Numbers
# are read whole first: the quote of a digit separator (1'024, 0xFF'FF) starts no character literal (it made
# the rest of the line a literal, and a comment opened there count as code).
_COMMENT_OR_STRING = re.compile(
    r"\b\d(?:[eEpP][+-]|'?[0-9A-Za-z_.])*"
    r'|//[^\n]*|/\*.*?(?:\*/|\Z)|"(?:\\.|[^"\\\n])*(?:"|\\?$)|\'(?:\\.|[^\'\\\n])*(?:\'|\\?$)',
    re.DOTALL | re.MULTILINE,
)


def strip_comments(source: str) -> str:
    """Remove // and /* */ comments (keeping line breaks and string literals)."""

    def repl(m: re.Match[str]) -> str:
        text = m.group(0)
        if text.startswith("/"):
            return "\n" * text.count("\n") if text.startswith("/*") else ""
        return text

    return _COMMENT_OR_STRING.sub(repl, source)


_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)\s*(.*)$")
_DEFINE = re.compile(r"^([A-Za-z_]\w*)(?:\s+(.*))?$")
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")
_ALLOWED_NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.Constant,
    ast.IfExp,
    ast.And,
    ast.Or,
    ast.Not,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Mod,
    ast.USub,
    ast.UAdd,
    ast.Invert,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.BitAnd,
    ast.BitOr,
    ast.BitXor,
    ast.LShift,
    ast.RShift,
)


# A #if condition longer than this, as written or while its macros expand, is left undecided: `#define A
# A+A+A+A+A+A` then `#if A` grows sixfold per level (6^8 terms), and held the event loop for 30 s.
MAX_CONDITION_CHARS = 4096


MAX_CONDITIONS = 2000  # #if / #elif conditions evaluated per source (preprocess)


def parse_c_expression(text: str) -> ast.Expression | None:
    """A C expression rewritten in Python's spelling (a #if condition, a launch size) parsed by Python, or None
    where Python cannot read it. Quietly: `256and` made the parser print "SyntaxWarning: invalid decimal literal"
    to the server's stderr, a sender's typo logged as if it were the server's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # RecursionError: `- - - ... 1`
        return None


def _eval_condition(expr: str, macros: dict[str, str]) -> bool | None:
    """Evaluate a #if expression; None when it cannot be evaluated safely (then both branches count)."""
    if len(expr) > MAX_CONDITION_CHARS:
        return None
    expr = re.sub(r"\bdefined\s*\(\s*(\w+)\s*\)", lambda m: "1" if m.group(1) in macros else "0", expr)
    expr = re.sub(r"\bdefined\s+(\w+)", lambda m: "1" if m.group(1) in macros else "0", expr)
    for _ in range(8):  # macros expanding to macros, a few levels deep
        new = _IDENT.sub(
            lambda m: f"({macros[m.group(0)]})" if macros.get(m.group(0), "") != "" else m.group(0), expr
        )
        if new == expr:
            break
        if len(new) > MAX_CONDITION_CHARS:
            return None
        expr = new
    expr = _INT_SUFFIX.sub(r"\1", expr)
    expr = _IDENT.sub("0", expr)  # C: identifiers left after expansion are 0
    # The C ternary `a ? b : c` has no direct Python spelling; such conditions are left undecided.
    if "?" in expr:
        return None
    expr = expr.replace("&&", " and ").replace("||", " or ").replace("/", "//")
    expr = re.sub(r"!(?!=)", " not ", expr)
    tree = parse_c_expression(expr)
    if tree is None:
        return None
    if not all(isinstance(node, _ALLOWED_NODES) for node in ast.walk(tree)):
        return None
    try:
        return bool(_cpp_value(tree.body))
    except (ArithmeticError, ValueError, TypeError, RecursionError):
        return None


def _c_div(a: int, b: int) -> int:
    """C's `/` on integers: the quotient truncated toward zero (Python's `//` floors: -7 // 2 == -4)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _c_mod(a: int, b: int) -> int:
    """C's `%`: the remainder takes the dividend's sign, so that (a / b) * b + a % b == a."""
    return a - b * _c_div(a, b)


_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: _c_div,  # the condition's `/` is parsed as `//`, then computed as C does
    ast.Mod: _c_mod,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
}
_COMPARE: dict[type, Callable[[int, int], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_CPP_LIMIT = 2**64  # the preprocessor computes in intmax_t: anything beyond is not a condition anyone means


def _cpp_value(node: ast.AST) -> int:
    """Value of an allowed #if expression node, in 64-bit range (ArithmeticError beyond it).

    Not Python's eval: `1 << 1099511627776` in an agent's source would try to allocate 128 GB."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise TypeError("only integer constants")
        value = node.value
    elif isinstance(node, ast.UnaryOp):
        inner = _cpp_value(node.operand)
        value = {ast.USub: -inner, ast.UAdd: inner, ast.Invert: ~inner, ast.Not: int(not inner)}[
            type(node.op)
        ]
    elif isinstance(node, ast.BinOp):
        a, b = _cpp_value(node.left), _cpp_value(node.right)
        if isinstance(node.op, ast.LShift | ast.RShift) and not 0 <= b < 64:
            raise ArithmeticError("shift out of range")
        value = _BINARY[type(node.op)](a, b)
    elif isinstance(node, ast.BoolOp):
        values = [_cpp_value(v) for v in node.values]
        value = int(all(values)) if isinstance(node.op, ast.And) else int(any(values))
    elif isinstance(node, ast.Compare):
        # C has no chained comparisons: `1 < A < 3` is `(1 < A) < 3`, true for every A.
        value = _cpp_value(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            value = int(_COMPARE[type(op)](value, _cpp_value(right_node)))
    elif isinstance(node, ast.IfExp):
        value = _cpp_value(node.body) if _cpp_value(node.test) else _cpp_value(node.orelse)
    else:
        raise TypeError(f"unsupported node {type(node).__name__}")
    if not -_CPP_LIMIT <= value < _CPP_LIMIT:
        raise ArithmeticError("beyond 64 bits")
    return value


def preprocess(source: str, defines: dict[str, Any]) -> str:
    """Comment-stripped source with inactive #if/#ifdef branches removed, under `defines`.

    Object-like #defines in the source count too. Conditions that cannot be evaluated keep their text.
    """
    macros: dict[str, str] = {k: str(int(v) if isinstance(v, bool) else v) for k, v in defines.items()}
    out: list[str] = []
    # Stack of (parent_active, this_branch_active, a_branch_surely_taken). A condition that cannot be
    # evaluated makes its branch active without closing the others, so every branch then counts.
    stack: list[tuple[bool, bool, bool]] = []
    active = True
    # Each condition costs up to MAX_CONDITION_CHARS of expansion and a parse: past this many in one source
    # (a crafted 1 MB of `#if A` lines took 43 s), the rest count as undecided (both branches kept).
    evaluations = 0

    def evaluate(expr: str) -> bool | None:
        nonlocal evaluations
        evaluations += 1
        return _eval_condition(expr, macros) if evaluations <= MAX_CONDITIONS else None

    text = strip_comments(source).replace("\\\n", " ")
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        if not m:
            if active:
                out.append(line)
            continue
        name, rest = m.group(1), m.group(2).strip()
        if name in ("if", "ifdef", "ifndef"):
            if name == "if":
                cond = evaluate(rest)
            else:
                word = rest.split()[0] if rest.split() else ""
                cond = (word in macros) == (name == "ifdef")
            taken = True if cond is None else cond
            stack.append((active, taken, cond is True))
            active = active and taken
        elif name == "elif" and stack:
            parent, _, done = stack[-1]
            cond = evaluate(rest)
            branch = (not done) and (True if cond is None else cond)
            stack[-1] = (parent, branch, done or (branch and cond is True))
            active = parent and branch
        elif name == "else" and stack:
            parent, _, done = stack[-1]
            stack[-1] = (parent, not done, True)
            active = parent and not done
        elif name == "endif" and stack:
            parent, _, _ = stack.pop()
            active = parent
        elif name == "define" and active:
            d = _DEFINE.match(rest)
            if d and "(" not in d.group(1):
                macros.setdefault(d.group(1), (d.group(2) or "").strip())
            out.append(line)
        elif name == "undef" and active:
            macros.pop(rest.split()[0] if rest.split() else "", None)
        elif active:
            out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------- source features

_PATTERNS: dict[str, re.Pattern[str]] = {
    "shared": re.compile(r"__shared__"),
    "vector_types": re.compile(
        r"\b(?:float[24]|double2|int[24]|uint[24]|longlong2|half2|__half2|nv_bfloat162|__nv_bfloat162|short4|char4|uchar4)\b"
    ),
    # `#pragma unroll 1` is how a loop is kept rolled: it is no unrolling.
    "unroll_pragmas": re.compile(
        r"#\s*pragma\s+unroll\b(?![ \t]*\(?[ \t]*1[uUlL]*[ \t]*\)?[ \t]*$)", re.MULTILINE
    ),
    "loops": re.compile(r"\b(?:for|while)\s*\("),
    "tensor_core": re.compile(r"\b(?:wmma::|mma_sync|mma\.sync|wgmma|ldmatrix|__hmma|nvcuda::wmma|tcgen05)"),
    "async_copy": re.compile(
        r"\b(?:cp\.async|memcpy_async|__pipeline_memcpy_async|cp_async|cuda::pipeline|tma|cp\.async\.bulk|"
        r"cuTensorMap|CUtensorMap)\b"
    ),
    "atomics": re.compile(r"\batomic\w*\s*\(|\bred\.\w+"),
    "barriers": re.compile(
        r"__syncthreads(?:_count|_and|_or)?\s*\(|__syncwarp\s*\(|\bbar\.sync\b|\.sync\s*\(\s*\)|__barrier"
    ),
    "readonly": re.compile(r"__ldg\s*\(|\bconst\s+[\w:<>]+\s*\*\s*(?:const\s+)?__restrict__"),
    # Intrinsics, and the library calls agents write instead (cooperative-groups tiles and reduce, CUB's warp
    # and block reductions), which compile to the same shuffles. From a name's start only: tried from every
    # `__shfl` inside one long identifier, each try read to its end (1 MB of `__shfl_`: hours).
    "warp_shuffles": re.compile(
        r"\b__shfl\w*+\s*\(|\b__reduce_\w+_sync\s*\(|\.shfl(?:_down|_up|_xor)?\s*\(|"
        r"\b(?:cg|cooperative_groups)::reduce\s*\(|\bcub::(?:WarpReduce|BlockReduce)\b"
    ),
    "divisions": re.compile(r"[^/*]/(?![/*=])|%(?!=)"),
    "transcendentals": re.compile(
        r"\b(?:__)?(?:exp|exp2|expf|exp2f|__expf|log|logf|log2f|__logf|pow|powf|__powf|sin|sinf|__sinf|cos|cosf|"
        r"__cosf|tanh|tanhf|sqrt|sqrtf|rsqrtf|erf|erff)\s*\("
    ),
    "fp64": re.compile(r"\bdouble\b"),
    "half": re.compile(r"\b(?:__half|half|__nv_bfloat16|nv_bfloat16|bfloat16)\b"),
}


# ---------------------------------------------------------------- HIP and OpenCL, read as their CUDA twins

# A HIP or OpenCL kernel is read as the CUDA kernel it spells otherwise: first the names the data-flow passes
# and entry_text look for are rewritten to CUDA's (thread and block indices, the kernel qualifier, local memory,
# atomics), then each count takes the dialect's own spellings beside CUDA's (_DIALECT_PATTERNS). CUDA sources
# are read as before. Only spellings that mean the same are taken: AMD's matrix instructions are tensor cores,
# its lane permutes are shuffles; a sub-group barrier is a warp's (__syncwarp counts too).
_AXIS = {"0": "x", "1": "y", "2": "z"}
_HIP_REWRITES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    # Older HIP spellings of threadIdx.x and the rest, and the builtins behind them.
    (
        re.compile(r"\bhip(Thread|Block)Idx_([xyz])\b"),
        lambda m: f"{m.group(1).lower()}Idx.{m.group(2)}",
    ),
    (re.compile(r"\bhip(Block|Grid)Dim_([xyz])\b"), lambda m: f"{m.group(1).lower()}Dim.{m.group(2)}"),
    (re.compile(r"\b__builtin_amdgcn_workitem_id_([xyz])\s*\(\s*\)"), r"threadIdx.\1"),
    (re.compile(r"\b__builtin_amdgcn_workgroup_id_([xyz])\s*\(\s*\)"), r"blockIdx.\1"),
    # Float atomics as HIP spells them, and clang's builtins (`__hip_atomic_fetch_add(p, v, order, scope)`).
    (re.compile(r"\b(?:unsafe|safe)AtomicAdd\s*\("), "atomicAdd("),
    (re.compile(r"\b__hip_atomic_(\w+)\s*\("), r"atomic_\1("),
)
_OPENCL_REWRITES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"\b(?:__kernel|kernel)\b"), "__global__"),
    (re.compile(r"\b(?:__local|local)\b"), "__shared__"),
    (re.compile(r"\bget_local_id\s*\(\s*([012])[uU]?\s*\)"), lambda m: f"threadIdx.{_AXIS[m.group(1)]}"),
    (re.compile(r"\bget_group_id\s*\(\s*([012])[uU]?\s*\)"), lambda m: f"blockIdx.{_AXIS[m.group(1)]}"),
    (re.compile(r"\bget_local_size\s*\(\s*([012])[uU]?\s*\)"), lambda m: f"blockDim.{_AXIS[m.group(1)]}"),
    (re.compile(r"\bget_num_groups\s*\(\s*([012])[uU]?\s*\)"), lambda m: f"gridDim.{_AXIS[m.group(1)]}"),
    (
        re.compile(r"\bget_global_id\s*\(\s*([012])[uU]?\s*\)"),
        lambda m: "(blockIdx.{0} * blockDim.{0} + threadIdx.{0})".format(_AXIS[m.group(1)]),
    ),
    (
        re.compile(r"\bget_global_size\s*\(\s*([012])[uU]?\s*\)"),
        lambda m: "(gridDim.{0} * blockDim.{0})".format(_AXIS[m.group(1)]),
    ),
    # OpenCL 1.0's atom_add; a fence named like an atomic is none.
    (re.compile(r"\batom_(\w+)\s*\("), r"atomic_\1("),
    (re.compile(r"\batomic_work_item_fence\s*\("), "mem_fence("),
    # The integer types the declaration patterns (_INT_ASSIGN) know under their C names.
    (re.compile(r"\buint\b"), "unsigned int"),
    (re.compile(r"\bulong\b"), "unsigned long"),
)
_DIALECT_PATTERNS: dict[str, dict[str, re.Pattern[str]]] = {
    "hip": {
        "vector_types": re.compile(r"\b(?:__hip_bfloat162|hip_bfloat162)\b"),
        # MFMA (CDNA) and WMMA (RDNA3) builtins, and rocWMMA's fragments.
        "tensor_core": re.compile(r"\b__builtin_amdgcn_(?:mfma|smfmac|wmma|swmmac)\w*\s*\(|\brocwmma::"),
        "async_copy": re.compile(r"\b__builtin_amdgcn_global_load_lds\s*\("),
        "barriers": re.compile(r"\b__builtin_amdgcn_(?:s_barrier|wave_barrier)\s*\("),
        "warp_shuffles": re.compile(
            r"\b__builtin_amdgcn_(?:ds_bpermute|ds_permute|ds_swizzle|mov_dpp8?|update_dpp|permlane\w*|readlane)"
            r"\s*\(|\bhipcub::(?:WarpReduce|BlockReduce)\b|\brocprim::(?:warp_reduce|block_reduce)\b"
        ),
        "half": re.compile(r"\b(?:__hip_bfloat16|hip_bfloat16)\b"),
    },
    "opencl": {
        # OpenCL's vectors beyond those CUDA names (CUDA's float3 is no vector load, nor OpenCL's), and the
        # vector loads and stores of scalar pointers.
        "vector_types": re.compile(
            r"\b(?:double|half|u?char|u?short|u?long)[24]\b|\b(?:float|double|half|u?char|u?short|u?int|u?long)"
            r"(?:8|16)\b|\bv(?:load|store)a?(?:_half)?(?:2|4|8|16)\s*\("
        ),
        "unroll_pragmas": re.compile(r"\b__attribute__\s*\(\(\s*opencl_unroll_hint\b(?!\s*\(\s*1[uU]?\s*\))"),
        "async_copy": re.compile(r"\basync_work_group(?:_strided)?_copy\s*\("),
        "barriers": re.compile(r"\b(?:work_group_barrier|sub_group_barrier|barrier)\s*\("),
        "readonly": re.compile(
            r"\bconst\s+(?:__global\s+|global\s+)?\w+\s*\*\s*(?:const\s+)?(?:restrict|__restrict)\b|"
            r"\b(?:__global|global)\s+const\s+\w+\s*\*\s*(?:const\s+)?(?:restrict|__restrict)\b"
        ),
        "warp_shuffles": re.compile(
            r"\b(?:intel_)?sub_group_(?:reduce_\w+|scan_\w+|shuffle\w*|broadcast)\s*\(|"
            r"\bwork_group_(?:reduce|scan_inclusive|scan_exclusive)_\w+\s*\("
        ),
        "transcendentals": re.compile(
            r"\b(?:native|half)_(?:exp|exp2|exp10|log|log2|log10|powr|sin|cos|tan|sqrt|rsqrt)\s*\(|"
            r"\b(?:rsqrt|exp10)\s*\("
        ),
    },
}


def _with_dialect(language: str) -> dict[str, re.Pattern[str]]:
    """_PATTERNS with each count also taking `language`'s spellings: one pattern per count (alternatives, not
    two patterns summed), so a token both spell alike (`double2`) counts once."""
    extra = _DIALECT_PATTERNS.get(language, {})
    return {
        name: re.compile(f"(?:{p.pattern})|(?:{extra[name].pattern})", p.flags) if name in extra else p
        for name, p in _PATTERNS.items()
    }


_LANGUAGE_PATTERNS = {language: _with_dialect(language) for language in ("cuda", *_DIALECT_PATTERNS)}


def _as_cuda(text: str, language: str) -> str:
    """`text` (preprocessed) with the HIP or OpenCL names the passes read rewritten to CUDA's."""
    rewrites = _HIP_REWRITES if language == "hip" else _OPENCL_REWRITES if language == "opencl" else ()
    for pattern, replacement in rewrites:
        text = pattern.sub(replacement, text)
    return text


# ---------------------------------------------------------------- access patterns (a small data-flow pass)

# Agent-written sources are untrusted and analysed on the server's event loop: every pattern here is linear in
# the text (spans bounded, no repeat over characters a neighbouring repeat also takes), the line-based passes
# skip lines longer than anyone writes, and the lane-fast names are propagated once, not to a fixed point. A
# crafted 75 KB source held the loop for 45 s before (`tests/test_features.py`).
_MAX_LINE = 2000
_MAX_FAST_NAMES = 256
# The data-flow passes read this much of a kernel's text: a single regular-expression call holds the GIL, so
# a pass over a 1 MB paste would stall the event loop even from a worker thread.
_MAX_FLOW_TEXT = 256 * 1024

# Integer declarations and for-loop initialisers: `int row = blockIdx.x * blockDim.x + threadIdx.x;`.
_INT_ASSIGN = re.compile(
    r"\b(?:const\s+)?(?:unsigned\s+|signed\s+)?(?:int|long\s+long|long|size_t|unsigned|int64_t|uint32_t|"
    r"uint64_t|auto)\s+([A-Za-z_]\w*)\s*=\s*([^;]{1,400});"
)
_FOR_INIT = re.compile(r"\bfor\s*\(\s*(?:[\w:]+\s+)?([A-Za-z_]\w*)\s*=\s*([^;]{1,200});")
# A __shared__ declaration up to its ";": arrays, scalars (`__shared__ unsigned int count;`), several names in
# one (`__shared__ float a[64], b[64];`), an alignment (`__shared__ __align__(16) float t[256];`).
_SHARED_DECL = re.compile(r"__shared__\b([^;{}]{1,300});")
# An OpenCL kernel's `__local float* scratch` parameter (read as `__shared__`): local memory the launch sizes.
_SHARED_PARAM = re.compile(
    r"__shared__\s+(?:const\s+)?[\w\s]{1,80}?\*\s*(?:(?:restrict|const)\s+)?([A-Za-z_]\w*)\s*[,)]"
)
_SHARED_NOISE = re.compile(r"\b(?:__align__|alignas)\s*\([^()]{0,60}\)|\[[^\[\]]{0,200}\]|<[^<>]{0,200}>")
_LAST_NAME = re.compile(r"([A-Za-z_]\w*)\W*$")
# The variable an atomic updates, past a cast of its address: `atomicMax((int*)&smax, v)`,
# `atomicAdd(reinterpret_cast<unsigned long long*>(&acc[i]), x)`.
_ATOMIC_TARGET = re.compile(
    r"\batomic\w*\s*\(\s*"
    r"(?:\(\s*[\w\s:]{1,80}\*+\s*\)\s*|(?:reinterpret|static)_cast\s*<[^<>;]{1,80}>\s*\(\s*)?"
    r"&?\s*\(?\s*([A-Za-z_]\w*)"
)
_CAST = r"(?:\(\s*[\w\s]{1,60}\)\s*)?"
_NOT_A_SIZE = {"blockDim", "gridDim", "blockIdx", "threadIdx", "sizeof", "warpSize"}


def _lane_fast_variables(text: str) -> set[str]:
    """Variables that step by one between neighbouring threads of a warp (derived from threadIdx.x without a
    division or shift: `tid`, `lane = threadIdx.x % 32`, a global index, `for (j = lane; ...)`)."""
    # name -> the names assigned from it; a name is fast when an assignment of it uses threadIdx.x or a fast name
    derived: dict[str, list[str]] = {}
    queue: list[str] = []
    for p in (_INT_ASSIGN, _FOR_INIT):
        for m in p.finditer(text):
            name, expr = m.group(1), m.group(2)
            if re.search(r"/|>>", expr):  # x / 32 is a warp index: the same for a whole warp
                continue
            if "threadIdx.x" in expr:
                queue.append(name)
            for used in set(re.findall(r"\b[A-Za-z_]\w*\b", expr)):
                derived.setdefault(used, []).append(name)
    fast: set[str] = set()
    while queue:
        name = queue.pop()
        if name not in fast:
            fast.add(name)
            queue.extend(derived.get(name, ()))
    return fast


# Names that hold a compile-time constant, as a literal does: `constexpr int kVec = 4;`, `const int vec = 2 * 4;`,
# `template <int vec, typename T>`.
_CONST_INT = re.compile(
    r"\b(?:constexpr|const)\s+(?:static\s+)?(?:unsigned\s+|signed\s+)?(?:int|long|short|size_t|unsigned|auto|"
    r"u?int(?:8|16|32|64)_t)\s+([A-Za-z_]\w*)\s*=\s*([0-9xXa-fA-FuUlL\s+\-*()<>]{1,60});"
)
_INT_LITERAL = re.compile(r"\b(?:0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")
_TEMPLATE_HEAD = re.compile(r"\btemplate\s*<([^<>]{1,300})>")
_TEMPLATE_INT = re.compile(
    r"\b(?:int|unsigned|long|short|size_t|auto|u?int(?:8|16|32|64)_t)\s+([A-Za-z_]\w*)"
)


def _constant_names(text: str) -> set[str]:
    """Names of compile-time integer constants (`_CONST_INT`, template non-type parameters)."""
    names = {
        m.group(1)
        for m in _CONST_INT.finditer(text)
        if re.fullmatch(r"[\s+\-*()<>]*", _INT_LITERAL.sub("", m.group(2))) and re.search(r"\d", m.group(2))
    }
    for head in _TEMPLATE_HEAD.finditer(text):
        names.update(_TEMPLATE_INT.findall(head.group(1)))
    return names


def _strided_accesses(text: str, shared: set[str], fast: set[str]) -> int:
    """Products of a lane-fast index with a run-time size (`row * N`, `(size_t)x * n`) outside shared-memory
    subscripts: neighbouring threads then touch addresses a whole row apart (uncoalesced global access).
    Products with literals or constants (ALL-CAPS names, constexpr / const ints set from literals, template
    parameters: tile widths) are left out: those are tiles, not rows.
    `shared`: the shared arrays and their aliases (`_shared_names`); `fast`: the lane-fast variables."""
    constants = _constant_names(text)
    named = sorted(fast, key=lambda n: (-len(n), n))[:_MAX_FAST_NAMES]
    alt = "|".join(re.escape(n) for n in sorted({*named, "threadIdx.x"}, key=len, reverse=True))
    fast_times = re.compile(rf"{_CAST}\b(?:{alt})\b\s*\)?\s*\*\s*\(?\s*{_CAST}([A-Za-z_]\w*)")
    times_fast = re.compile(rf"\b([A-Za-z_]\w*)\s*\)?\s*\*\s*\(?\s*{_CAST}\b(?:{alt})\b")
    indices = {n for sub in _SUBSCRIPT.findall(text) for n in _IDENT.findall(sub)}
    count = 0
    for line in text.splitlines():
        if len(line) > _MAX_LINE:
            continue
        products = [*fast_times.finditer(line), *times_fast.finditer(line)]
        if not products:
            continue
        # Where a product on this line can be an address: an integer later used as an index, a pointer.
        index_names = {m.group(1) for m in _INT_ASSIGN.finditer(line)} & indices
        pointer = _POINTER_ASSIGN.search(line) is not None
        for m in products:
            other = m.group(1)
            if (
                other in _NOT_A_SIZE
                or other in shared
                or other in fast
                or other in constants
                or (other.isupper() and len(other) > 1)
            ):
                continue
            before = line[: m.start()]
            if before.count("[") > before.count("]"):
                owner = _SUBSCRIPT_OWNER.search(before[-200:])
                if owner and owner.group(1) in shared:
                    continue
            elif not (pointer or _assigns_one_of(before, index_names)):
                continue  # arithmetic, not an address: `x0 + i * dx`, `float w = i * alpha`
            count += 1
    return count


# A subscript's text (`a[row * N + col]` -> `row * N + col`), and the name an assignment ahead of a point sets.
_SUBSCRIPT = re.compile(r"\[([^\[\]]{1,200})\]")
_ASSIGNED = re.compile(r"\b([A-Za-z_]\w*)\s*=[^=;]*$")


def _assigns_one_of(before: str, names: set[str]) -> bool:
    """Whether the text ahead of a product on its line ends inside the assignment of one of `names`."""
    if not names:
        return False
    assigned = _ASSIGNED.search(before[-400:])
    return assigned is not None and assigned.group(1) in names


# The array whose subscript is still open at the end of a text: `sh[a][b + ` -> sh.
_SUBSCRIPT_OWNER = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\[[^\[\]]*\]\s*)*\[[^\[\]]*$")
_POINTER_ASSIGN = re.compile(r"\*\s*(?:__restrict__\s+)?([A-Za-z_]\w*)\s*=\s*([^;=]{1,200});")
_FOR_HEADER = re.compile(r"\bfor\s*\(([^;]{0,200});([^;]{0,200});")
_SMALL_BOUND = re.compile(r"<=?\s*(?:[A-Z_][A-Z0-9_]+|\d+)\s*$")  # BINS, 64; not N (a size)


def _shared_names(text: str) -> set[str]:
    """Shared variables (arrays and scalars) and the pointers made from them (`int* mine = sh + warp * BINS;`)."""
    shared: set[str] = set()
    for m in _SHARED_DECL.finditer(text):
        for declarator in _SHARED_NOISE.sub(" ", m.group(1)).split(","):
            if name := _LAST_NAME.search(declarator):
                shared.add(name.group(1))
    shared.update(_SHARED_PARAM.findall(text))
    for _ in range(2):
        for m in _POINTER_ASSIGN.finditer(text):
            if set(re.findall(r"\b[A-Za-z_]\w*\b", m.group(2))) & shared:
                shared.add(m.group(1))
    return shared


# Past this many atomics in one kernel the rest are not examined (each costs a few line look-ups).
_MAX_ATOMICS = 512


def _one_thread_patterns(fast: set[str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(guard, early return) for the lane-fast names `fast`: a condition true on one thread (`x == 0`,
    `0 == x`, `!x`, `x < 1`, also as the first of an `&&`), and `if (x) return;` / `if (x != 0) return;` /
    `if (x > 0) return;`, after which the rest of the kernel runs on one thread."""
    names = sorted({*fast, "threadIdx.x", "threadIdx.y", "threadIdx.z"}, key=len, reverse=True)[
        :_MAX_FAST_NAMES
    ]
    alt = "|".join(re.escape(n) for n in names)
    guard = re.compile(
        rf"==\s*0\s*(?:\)|&&)|\(\s*0\s*==|\(\s*!\s*\(?\s*(?:{alt})\b|\b(?:{alt})\s*<\s*1\s*(?:\)|&&)"
    )
    early = re.compile(rf"\bif\s*\(\s*(?:{alt})\s*(?:!=\s*0|>\s*0)?\s*\)\s*return\b")
    return guard, early


def _thread_atomics(text: str, shared: set[str], fast: set[str]) -> int:
    """Atomics on global memory issued once per element: not on a shared array, not under a one-thread guard
    (`if (lane == 0)`, `if (!threadIdx.x)`, `if (tid == 0 && n > 0)`: on the same line or up to two before, or
    opening a block the atomic is in), not after an early `if (threadIdx.x != 0) return;`, not merging a
    shared-memory partial (`hist[b] += sh[b]`), not in a loop over a fixed small range (`for (b = tid; b <
    BINS; ...)`, a per-bin merge). `fast`: the lane-fast variables (`_lane_fast_variables`). Each line's facts
    are found once, so the pass is linear in the text."""
    reads_shared = re.compile(r"\b(?:" + "|".join(map(re.escape, shared)) + r")\s*\[") if shared else None
    guard_re, early_re = _one_thread_patterns(fast)
    lines = [line if len(line) <= _MAX_LINE else "" for line in text.splitlines()]
    guard = [guard_re.search(line) is not None for line in lines]
    small_loop = []
    for line in lines:
        header = _FOR_HEADER.search(line)
        small_loop.append(header is not None and _SMALL_BOUND.search(header.group(2).strip()) is not None)
    braces: list[bool] = []  # per open brace: whether a one-thread guard opened it
    guarded_open = 0
    returned = False
    count = examined = 0
    for i, line in enumerate(lines):
        returned = returned or early_re.search(line) is not None
        for m in _ATOMIC_TARGET.finditer(line):
            examined += 1
            if examined > _MAX_ATOMICS:
                return count
            if m.group(1) in shared or returned or guarded_open or any(guard[max(0, i - 2) : i + 1]):
                continue
            if reads_shared is not None and reads_shared.search(line[m.end() :]):
                continue
            if any(small_loop[max(0, i - 8) : i + 1]):
                continue
            count += 1
        # A block opened on a guard's line, or on the line after one (`if (tid == 0)` then `{`).
        opens_guarded = guard[i] or (i > 0 and guard[i - 1] and line.lstrip().startswith("{"))
        for ch in re.findall(r"[{}]", line):
            if ch == "{":
                braces.append(opens_guarded and "else" not in line)
                guarded_open += braces[-1]
            elif braces:
                guarded_open -= braces.pop()
    return count


@dataclass(frozen=True)
class SourceFeatures:
    """Counts of source constructs, after comments and inactive #if branches are removed."""

    shared: int = 0
    vector_types: int = 0
    unroll_pragmas: int = 0
    loops: int = 0
    tensor_core: int = 0
    async_copy: int = 0
    atomics: int = 0
    barriers: int = 0
    readonly: int = 0
    warp_shuffles: int = 0
    divisions: int = 0
    transcendentals: int = 0
    fp64: int = 0
    half: int = 0
    lines: int = 0
    strided_access: int = 0  # lane-fast index times a run-time size, outside shared memory
    thread_atomics: int = 0  # global atomics issued by every thread
    embedded_cuda: int = 0  # 1: a Python source read as the CUDA in its string literals (`embedded_cuda`)


_GLOBAL = "__global__"
_GLOBAL_REACH = 400  # characters from `__global__` to the kernel's name (qualifiers, return type, attributes)


def _global_names(text: str) -> Iterator[tuple[int, str, int]]:
    """(start of `__global__`, kernel name, index of its parameter list's "(") for each `__global__` whose
    first "(" comes before any of ";{})" and follows the name within _GLOBAL_REACH characters. String
    searches, not one pattern: a pattern scanning ahead from every `__global__` was quadratic and held the GIL
    for seconds on a crafted source."""
    at = text.find(_GLOBAL)
    while at != -1:
        after = at + len(_GLOBAL)
        window = text[after : after + _GLOBAL_REACH + 256]
        if "#" in window or "%:" in window:
            # `__global__ void` / `#if defined(X)` / `__launch_bounds__(256)` / `#endif` / `k(`: the directive's
            # `defined(` is no parameter list.
            window = _PREPROCESSOR_LINE.sub(lambda m: " " * len(m.group(0)), window)
        if not (window[:1].isalnum() or window[:1] == "_"):
            paren = window.find("(")
            if paren != -1 and not any(0 <= window.find(c, 0, paren) for c in ";{})"):
                head = window[:paren].rstrip()
                j = len(head)
                while j > 0 and (head[j - 1].isalnum() or head[j - 1] == "_"):
                    j -= 1
                name = head[j:]
                if name and not name[0].isdigit() and j <= _GLOBAL_REACH and name.isascii():
                    yield at, name, after + paren
        at = text.find(_GLOBAL, after)


# `__launch_bounds__(256)` and `__attribute__((amdgpu_flat_work_group_size(1, 256)))` (HIP) or
# `__attribute__((reqd_work_group_size(16, 16, 1)))` (OpenCL) between the qualifier and the name carry parentheses
# that would read as the parameter list.
_LAUNCH_BOUNDS = re.compile(
    r"__launch_bounds__\s*\([^()]*\)|"
    r"\b__attribute__\s*\(\((?:[^()]|\((?:[^()]|\([^()]{0,200}\)){0,200}\)){0,400}\)\)"
)


def _without_launch_bounds(text: str) -> str:
    """`text` with its `_LAUNCH_BOUNDS` blanked in place (the same length), as `_global_names` must read it."""
    return _LAUNCH_BOUNDS.sub(lambda m: " " * len(m.group(0)), text)


def _closers(text: str, open_ch: str, close_ch: str) -> dict[int, int]:
    """For each `open_ch` in `text` that is closed, the index just past its closing bracket: one pass for
    every bracket (scanning from each kernel's bracket to its match was quadratic on a crafted source of nested
    `__global__ void f(` lines: 27 s for 114 KB)."""
    out: dict[int, int] = {}
    stack: list[int] = []
    for m in re.finditer(f"[{re.escape(open_ch)}{re.escape(close_ch)}]", text):
        if m.group() == open_ch:
            stack.append(m.start())
        elif stack:
            out[stack.pop()] = m.start() + 1
    return out


def entry_text(text: str, entry: str | None) -> str:
    """`text` without the definitions of the other `__global__` kernels in it.

    Agents keep the naive kernel beside the optimised one, or put a two-stage reduction in one file; the
    features should describe the kernel that runs. Device functions, globals and host code stay (the kernel may
    use them). Unchanged when `entry` is not defined here (a macro-generated or templated name)."""
    if not entry or "__global__" not in text:
        return text
    probe = _without_launch_bounds(text)
    spans: list[tuple[int, int]] = []
    names: set[str] = set()
    parens, braces = _closers(probe, "(", ")"), _closers(probe, "{", "}")
    for start, name, paren in _global_names(probe):
        if spans and start < spans[-1][1]:
            continue  # inside a kernel already cut (kernels do not nest; rescanning it per name is quadratic)
        names.add(name)
        close = parens.get(paren)
        if close is None:
            return text
        brace = close
        while brace < len(probe) and probe[brace].isspace():
            brace += 1
        if name == entry or not probe.startswith("{", brace):
            continue  # the entry itself, or a declaration without a body
        end = braces.get(brace)
        if end is None:
            return text
        spans.append((start, end))
    if entry not in names:
        return text
    return _cut(text, spans)


# Host code: top-level function definitions (`int main()`, a PyTorch extension's `torch::Tensor forward(...)`,
# `PYBIND11_MODULE(...)`) that are neither `__global__` nor `__device__`. A whole .cu file's verification in
# `main` (a `double` error, loops, divisions) was read as the kernel's: fp64 on a GeForce weighs 6x.
_TOP_LEVEL_MARK = re.compile(r"[{};]")
# Qualifiers, then at most one trailing return type (which takes a later `override` in): one way to match. With
# the return type one of the repeated alternatives, `-> const` could be read two ways each time: a 200-byte
# `void f() -> const -> const ... !{` took 17 s.
_FUNCTION_HEADER_END = re.compile(
    r"\)\s*(?:(?:const|noexcept|override|final|throw\s*\(\s*\))\s*)*(?:->[\w:<>,*&\s]{1,200})?$"
)
_DEVICE_CODE = re.compile(r"\b__(?:global|device)__\b")
_NOT_A_FUNCTION = re.compile(
    r"^\s*(?:template\s*<[^{};]*>\s*)?(?:struct|class|union|enum|namespace|typedef)\b"
)
# Each tried only where a word starts and taken whole (possessive): tried at every letter of a word, these were
# quadratic in it (a 1 MB source of 2,000-letter words before `(x) {}` took 47 s, of `namespace namespace ...`
# 1.2 s).
# Read where literals are blanked (`_blank_literals`): `extern "C" {` is `extern " " {` there, "C++" three spaces.
_TRANSPARENT_BLOCK = re.compile(
    r"(?:\bnamespace\b[\w\s:]{0,200}+|\bextern\s*+\"(?:C(?:\+\+)?| (?:  )?)\"\s*+)$"
)
_NAME_BEFORE_PAREN = re.compile(r"(?<!\w)([A-Za-z_]\w*+)\s*+(?:<[^<>;{}()]{0,200}>\s*+)?$")
_MAX_HOST_FUNCTIONS = 256  # past them, nothing is cut (a crafted source of many: a call search for each)
_HEADER_WINDOW = 2000  # characters of a header read for its end and its name
_NAMESPACE_DEPTH = 16


def without_host_code(text: str, entry: str | None = None) -> str:
    """`text` without its host-only function definitions (`_TOP_LEVEL_MARK` comment). Kept: anything `__global__`
    or `__device__`, the entry itself, any function whose name the rest of the text uses, directly or through
    kept functions to any depth (a device function qualified through a macro, `DEVICE_INLINE float f()`, called,
    or passed as a function pointer or template argument), one whose name cannot be read (an operator),
    structs, classes and everything at file scope that is not a function body (constants the kernel reads,
    `#define`s). Namespaces and `extern "C"` blocks are looked into. Unchanged for a source with no `__global__`
    (nothing to tell host from device by) or braces that do not balance."""
    if _GLOBAL not in text:
        return text
    declarations: list[tuple[int, int, str | None]] = []
    found = host_function_spans(text, declarations)
    if not found or len(found) > _MAX_HOST_FUNCTIONS:
        return text
    # A host-looking function named as the entry is the kernel, qualified through a macro (`KERNEL void k(`),
    # unless the entry is a plain `__global__` here: then it is a wrapper of the same name (`torch::Tensor
    # relu(torch::Tensor x)` beside `__global__ void relu(...)`), and the kernel's own name is no use of it.
    plain_entry = entry is not None and any(n == entry for _, _, n in found) and _defines_kernel(text, entry)
    # An operator (`HD float4 operator+(...)`, used as `a + b`) has no name to look for: kept.
    cut = [(a, b, n) for a, b, n in found if n is not None and (n != entry or plain_entry)]
    # Each span's names and the rest's read once (a search per function over the rest took 17 s on 1 MB), then
    # followed to a fixed point: DEV f1 calling f2 calling ... f5 lost f5 after a fixed number of rounds.
    by_name: dict[str, list[int]] = {}
    for i, (_, _, n) in enumerate(cut):
        by_name.setdefault(n, []).append(i)
    # A forward declaration (`void launch(float*, int);` above the kernel) is no use of the function: it kept
    # the whole host function before, and went when the function did.
    declared = [(a, b, n) for a, b, n in declarations if n in by_name]
    rest = _cut(text, sorted([(a, b) for a, b, _ in cut + declared]))
    used = set(_IDENT.findall(rest))
    if plain_entry and entry is not None and not _calls_kernel_name(rest, entry):
        used.discard(entry)
    # A kept function's declarations stay with it, and what they use (`int n = threads()`) with them.
    declared_spans: dict[str, list[tuple[int, int]]] = {}
    for a, b, n in declared:
        declared_spans.setdefault(n, []).append((a, b))
    kept: set[int] = set()
    queue = [n for n in used if n in by_name]
    while queue:
        name = queue.pop()
        for a, b in declared_spans.pop(name, ()):
            queue.extend(n for n in set(_IDENT.findall(text, a, b)) if n in by_name)
        for i in by_name.pop(name, ()):
            kept.add(i)
            a, b, _ = cut[i]
            queue.extend(n for n in set(_IDENT.findall(text, a, b)) if n in by_name)
    kept_names = {cut[i][2] for i in kept}
    gone = [(a, b) for i, (a, b, _) in enumerate(cut) if i not in kept]
    return _cut(text, sorted(gone + [(a, b) for a, b, n in declared if n not in kept_names]))


def _calls_kernel_name(text: str, entry: str) -> bool:
    """Whether `text` (comments and literals aside) names `entry` other than where it defines or declares it as a
    `__global__`: a device overload of the kernel's name that its body calls (`HD float gelu(float v)` beside
    `__global__ void gelu(...)`, calling `gelu(x[i])`) is used, not a wrapper."""
    probe = _without_launch_bounds(_blank_literals(text))
    named = sum(1 for _ in re.finditer(rf"(?<!\w){re.escape(entry)}(?!\w)", probe))
    return named > sum(1 for _, name, _ in _global_names(probe) if name == entry)


def _defines_kernel(text: str, entry: str) -> bool:
    """Whether `text` defines `entry` as a plain `__global__` function (comments and literals aside)."""
    probe = _without_launch_bounds(_blank_literals(text))
    return any(name == entry for _, name, _ in _global_names(probe))


# An #include directive naming a header (`<x>` or `"x"`); what follows on its line (a comment) is not its.
_INCLUDE_LINE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"\n]{1,200})[>"]', re.MULTILINE)


def device_code_alone(text: str, headers: frozenset[str], entry: str | None = None) -> str:
    """`text` as this server's nvcc can compile it for ptxas's figures when it lacks `headers` (a PyTorch
    extension's torch/extension.h, ATen's, c10's): their #include lines blanked and its host-only functions cut
    (`without_host_code`), which is where such headers are used (`torch::Tensor forward(...)`,
    PYBIND11_MODULE). The device code is compiled as written; one that needs those headers itself still fails
    to compile, and is read without register counts. A comment after a blanked directive is kept."""

    def blank(m: re.Match[str]) -> str:
        return "" if m.group(1).strip() in headers else m.group(0)

    return without_host_code(_INCLUDE_LINE.sub(blank, text), entry)


def host_function_spans(
    text: str, declarations: list[tuple[int, int, str | None]] | None = None, probe: str | None = None
) -> list[tuple[int, int, str | None]]:
    """(start, end, name) of each host-only function definition at file scope (namespaces looked into; see
    `without_host_code`), in order; empty where the braces cannot be followed. The (start, end, name) of each
    function declaration at file scope that is not device code (`void launch(float*, int);`) is added to
    `declarations`, when given. `probe`: the text with its literals blanked (`_blank_literals`), when the caller
    has it already."""
    found: list[tuple[int, int, str | None]] = []
    if probe is None:
        probe = _blank_literals(text)  # `printf("}")` in a kernel closed its body early
    braces = _closers(probe, "{", "}")
    lines = _Directives(probe)
    return found if _host_functions(probe, 0, len(probe), braces, found, 0, declarations, lines) else []


# A preprocessor line, with the lines its trailing backslashes continue it onto (possessive: one way to match).
_PREPROCESSOR_LINE = re.compile(r"^[ \t]*(?:#|%:)(?:[^\\\n]++|\\\r?\n|\\.?)*+", re.MULTILINE)


class _Directives:
    """Where `text`'s preprocessor lines are, read once: a `;` or `}` on one
    (`#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)`, `#define SWAP(a, b) do { ... } while (0)`)
    is the macro's, and the rest of its line no start of the next statement. Looking back from each mark for its
    line's start would be quadratic in a long line of them."""

    def __init__(self, text: str) -> None:
        spans = [m.span() for m in _PREPROCESSOR_LINE.finditer(text)]
        self.starts = [a for a, _ in spans]
        self.ends = [b for _, b in spans]
        self.length = len(text)

    def at(self, start: int, end: int) -> tuple[int | None, int]:
        """Where the statement text[start:end] starts after its last preprocessor line (a #define before a
        function stays), None when `end` is on one (a brace or semicolon in a macro's body); and just past the end
        of that line (its line break too), `end` when `end` is on none."""
        i = bisect.bisect_right(self.starts, end) - 1
        if i < 0 or self.ends[i] <= start:
            return start, end
        if end < self.ends[i]:
            return None, min(self.ends[i] + 1, self.length)
        return min(self.ends[i] + 1, end), end


def _blank_literals(text: str) -> str:
    """`text` with the insides of its string and character literals blanked and its comments made spaces (line
    breaks kept), in place (the same length): a brace or semicolon in `printf("}")` is no structure, and
    `// launch it (host)` above a function does not name it `it`."""

    def blank(m: re.Match[str]) -> str:
        t = m.group(0)
        if t[:1] == "/":
            return re.sub(r"[^\n]", " ", t)
        if t[:1] not in "\"'" or len(t) < 2:  # a number (`1'000`) is not a literal to blank
            return t
        return t[0] + " " * (len(t) - 2) + t[-1]

    return _COMMENT_OR_STRING.sub(blank, text)


def _host_functions(
    text: str,
    lo: int,
    hi: int,
    braces: dict[int, int],
    out: list[tuple[int, int, str | None]],
    depth: int,
    declarations: list[tuple[int, int, str | None]] | None = None,
    lines: _Directives | None = None,
) -> bool:
    """Append (start, end, name) of each host-only function definition at file scope in text[lo:hi] (or in a
    namespace there) to `out`, and of each function declaration that is not device code to `declarations` (when
    given); False where the braces cannot be followed. `lines`: text's preprocessor lines, when read already."""
    lines = _Directives(text) if lines is None else lines
    start = pos = lo
    while (m := _TOP_LEVEL_MARK.search(text, pos, hi)) is not None:
        at = m.start()
        header_start, past = lines.at(start, at)
        if header_start is None:
            # A brace or semicolon on a preprocessor line: a macro's body, to the end of its line (its rest, as
            # `CHECK_CONTIGUOUS(x)` after `CHECK_CUDA(x);`, is no start of the next statement). A brace it opens
            # that closes past its line (`#define BEGIN {`) is followed to its close, as it was.
            start = pos = max(braces.get(at, past) if m.group() == "{" else past, past)
            continue
        if m.group() != "{":
            if m.group() == ";" and declarations is not None:
                declared = _declaration(text, header_start, at)
                if declared is not None:
                    declarations.append((declared[0], at + 1, declared[1]))
            start = pos = at + 1
            continue
        close = braces.get(at)
        if close is None or close > hi:
            return False
        header = text[header_start:at]
        if _TRANSPARENT_BLOCK.search(header[-_HEADER_WINDOW:]):
            if depth >= _NAMESPACE_DEPTH or not _host_functions(
                text, at + 1, close - 1, braces, out, depth + 1, declarations, lines
            ):
                return False
        elif (function := _host_header(header)) is not None:
            out.append((header_start, close, function[1]))
        start = pos = close
    return True


def _host_header(header: str) -> tuple[str, str | None] | None:
    """(the text before its parameter list, its name) where `header`, a statement at file scope up to its `{` or
    `;` (after any preprocessor lines), reads as a host function's: a parameter list and qualifiers at its end,
    not a type and not device code; the name None where it cannot be read (an operator). None for anything
    else."""
    window = header[-_HEADER_WINDOW:]
    paren = window.find("(")
    if (
        paren < 0
        or not _FUNCTION_HEADER_END.search(window)
        or _NOT_A_FUNCTION.match(window)
        or _DEVICE_CODE.search(header)
    ):
        return None
    name = _NAME_BEFORE_PAREN.search(window[:paren])
    return window[:paren], name.group(1) if name else None


def _declaration(text: str, start: int, end: int) -> tuple[int, str] | None:
    """(start, name) of the function declaration text[start:end] (a statement at file scope, before its `;`,
    after any preprocessor lines): a host function's header (`_host_header`) with a name, not an initialised
    variable (`int n = size(3);`); None for anything else."""
    function = _host_header(text[start:end])
    if function is None or "=" in function[0] or function[1] is None:
        return None
    return start, function[1]


def _cut(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """`text` without the (start, end) spans, which are in order and do not overlap."""
    out, at = [], 0
    for a, b in spans:
        out.append(text[at:a])
        at = b
    out.append(text[at:])
    return "".join(out)


def entry_parameter_count(source: str, entry: str) -> int | None:
    """How many parameters the `__global__` function `entry` declares, or None where its definition cannot be
    read plainly (not found, a preprocessor line in its list, parentheses that never close)."""
    probe = _without_launch_bounds(strip_comments(source))
    parens: dict[int, int] | None = None
    for _, name, paren in _global_names(probe):
        if name != entry:
            continue
        parens = _closers(probe, "(", ")") if parens is None else parens
        close = parens.get(paren)
        if close is None:
            return None
        listed = probe[paren + 1 : close - 1]
        if "#" in listed:
            return None
        parts = split_top_level(listed, "(<[", ")>]")
        return sum(1 for part in parts if part.strip() not in ("", "void"))
    return None


def split_top_level(text: str, opening: str = "([{", closing: str = ")]}") -> list[str]:
    """`text` split at its commas outside the brackets in `opening` / `closing` (parts as written)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def source_features(
    source: str, defines: dict[str, Any], entry: str | None = None, language: Language = "cuda"
) -> SourceFeatures:
    """Count source constructs in `source` preprocessed under `defines`; with `entry`, of that kernel only
    (the other `__global__` kernels of the source left out, `entry_text`). A HIP or OpenCL source is read as its
    CUDA twin (`_as_cuda`, _DIALECT_PATTERNS); a Python one as the CUDA its string literals hold, when they hold
    the entry's (`embedded_cuda`), else, as a Triton one, for the little it says plainly
    (`python_source_features`)."""
    if language in PYTHON_LANGUAGES:
        embedded = embedded_cuda(source, entry)
        if embedded is None:
            return python_source_features(source, entry)
        cuda = source_features(embedded.text, defines, embedded.entry)
        return dataclasses.replace(cuda, embedded_cuda=1)
    text = without_host_code(entry_text(_as_cuda(preprocess(source, defines), language), entry), entry)
    # `#include <torch/extension.h>` is no division (every PyTorch extension had one) and no line of the kernel's.
    text = _INCLUDE_LINE.sub("", text)
    counts = {name: len(p.findall(text)) for name, p in _LANGUAGE_PATTERNS.get(language, _PATTERNS).items()}
    lines = sum(1 for line in text.splitlines() if line.strip())
    flow = text[:_MAX_FLOW_TEXT]
    shared = _shared_names(flow)
    fast = _lane_fast_variables(flow)
    return SourceFeatures(
        lines=lines,
        strided_access=_strided_accesses(flow, shared, fast),
        thread_atomics=_thread_atomics(flow, shared, fast),
        **counts,
    )


# ---------------------------------------------------------------- Triton and Python

# A Triton program works on blocks: shared memory, vector loads, coalescing, barriers and shuffles are the
# compiler's choices, not written in the source, so the CUDA constructs and the thread-level passes have nothing
# to read there and stay 0. What a Triton source says plainly is counted: loops, atomics, transcendentals,
# precision, and tensor cores, which `tl.dot` uses on every GPU Triton targets (MMA from Volta on, MFMA on CDNA)
# unless the call asks for IEEE fp32 (`input_precision="ieee"`, `allow_tf32=False`: FMA then). One case is
# counted wrongly: fp32 inputs on a GPU without TF32 (before Ampere) run on FMA too.
PYTHON_LANGUAGES: frozenset[str] = frozenset({"triton", "python"})
# Strings (kept: a keyword argument's value is one), docstrings (dropped) and comments (dropped); a literal left
# open ends at its line, a docstring at the end of the text, as in strip_comments.
_PY_COMMENT_OR_STRING = re.compile(
    r'"""(?:.*?)(?:"""|\Z)|\'\'\'(?:.*?)(?:\'\'\'|\Z)|"(?:\\.|[^"\\\n])*"?|\'(?:\\.|[^\'\\\n])*\'?|#[^\n]*',
    re.DOTALL,
)
_PY_DEF = re.compile(r"^(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)[ \t]*\(", re.MULTILINE)
_PY_TOP_LEVEL = re.compile(r"^(?=[^\s#])", re.MULTILINE)
_PY_DOT = re.compile(r"\btl\.dot(?:_scaled)?\s*\(((?:[^()]|\((?:[^()]|\([^()]{0,200}\)){0,200}\)){0,2000})\)")
_PY_FMA_DOT = re.compile(r"""\binput_precision\s*=\s*["']ieee["']|\ballow_tf32\s*=\s*False\b""")
_PY_PATTERNS: dict[str, re.Pattern[str]] = {
    "loops": re.compile(r"^[ \t]*(?:for|while)\b", re.MULTILINE),
    "atomics": re.compile(r"\btl\.atomic_\w+\s*\("),
    "transcendentals": re.compile(
        r"\b(?:tl|libdevice|tl\.math|tl\.extra\.cuda\.libdevice)\.(?:exp|exp2|log|log2|sin|cos|sqrt|rsqrt|"
        r"pow|tanh|erf)\s*\("
    ),
    "fp64": re.compile(r"\btl\.float64\b"),
    "half": re.compile(r"\btl\.(?:float16|bfloat16)\b"),
}


def _python_text(source: str) -> str:
    """A Python source without comments and docstrings (strings kept: `input_precision="ieee"`)."""

    def repl(m: re.Match[str]) -> str:
        text = m.group(0)
        if text.startswith("#"):
            return ""
        return "\n" * text.count("\n") if text[:3] in ('"""', "'''") else text

    return _PY_COMMENT_OR_STRING.sub(repl, source)


def python_entry_text(text: str, entry: str | None) -> str:
    """`text` without the top-level functions that `entry` does not call (directly or through those it calls):
    the other kernels of a file, kept beside it as CUDA's are (`entry_text`). Unchanged when `entry` is not
    defined at the top level."""
    if not entry:
        return text
    starts = [m.start() for m in _PY_TOP_LEVEL.finditer(text)]
    blocks: dict[str, tuple[int, int]] = {}  # name -> (start with decorators, end)
    decorated_from: int | None = None
    for i, at in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(text)
        if text.startswith("@", at):
            decorated_from = at if decorated_from is None else decorated_from
            continue
        if (m := _PY_DEF.match(text, at)) is not None:
            blocks[m.group(1)] = (at if decorated_from is None else decorated_from, end)
        decorated_from = None
    if entry not in blocks:
        return text
    kept, queue = {entry}, [entry]
    while queue:
        start, end = blocks[queue.pop()]
        for name in set(_IDENT.findall(text, start, end)) & blocks.keys() - kept:
            kept.add(name)
            queue.append(name)
    return _cut(text, sorted(span for name, span in blocks.items() if name not in kept))


def python_source_features(source: str, entry: str | None = None) -> SourceFeatures:
    """The features of a Triton or Python kernel (see PYTHON_LANGUAGES): `entry` and what it calls."""
    text = python_entry_text(_python_text(source), entry)
    counts = {name: len(p.findall(text)) for name, p in _PY_PATTERNS.items()}
    dots = sum(1 for m in _PY_DOT.finditer(text) if _PY_FMA_DOT.search(m.group(1)) is None)
    lines = sum(1 for line in text.splitlines() if line.strip())
    return SourceFeatures(lines=lines, tensor_core=dots, **counts)


# ---------------------------------------------------------------- CUDA in a Python source's strings

# Agents often launch CUDA C from Python: CuPy's RawKernel(code, name) and RawModule(code=...), PyCUDA's
# SourceModule(...).get_function(name), torch's load_inline(cuda_sources=...). That CUDA is read as a CUDA source
# is. Python's own parser finds the literals (raw, triple-quoted, implicitly or `+`-concatenated, templates filled
# with literals and module constants: `_RUNTIME_VALUE`); nothing is run. A string made at run time (an f-string's
# placeholder of another value, a file read) is not read, nor is a source Python cannot parse: those are read as
# Python, as before. Parsing and reading the tree cost about 5 s and 500 MB per crafted megabyte (`x = 1` lines),
# the parse holding the GIL throughout, so only sources up to _MAX_EMBEDDING_SOURCE are parsed: for their CUDA
# those that spell `__global__`, for a Triton launch those that name the entry as one (`parsed_python`;
# host_launch._triton_module). A module holding its kernels is a few KB to a few tens; a crafted one of that size
# takes 0.1-0.3 s.
_MAX_EMBEDDING_SOURCE = 64 * 1024
_EMBEDDING_FILENAME = "<kernel source>"
# The calls that name the kernel they launch: RawKernel(code, name), get_function(name) (CuPy's RawModule,
# PyCUDA's SourceModule).
_NAMING_CALLS = {"RawKernel": 1, "get_function": 0}
# The kernel a C++ launch names (`k<<<`, `k<T><<<`). Possessive: tried where a word starts, taken whole (a 1 MB
# word must not be scanned from each of its letters).
_CHEVRON_TARGET = re.compile(r"(?<![\w.])([A-Za-z_]\w*+)\s*+(?:<[^<>;(){}]{0,200}>\s*+)?<<<")


class EmbeddedCuda(NamedTuple):
    """The CUDA a Python source's entry reaches, and the `__global__` kernel read (None: every kernel in it).
    `edited`: the source edits strings in ways not read here (`src.replace(k, v)` in a loop), so any of this text
    may differ at run time: its host code's launch is not read."""

    text: str
    entry: str | None
    edited: bool = False


def python_module(source: str) -> ast.Module | None:
    """`source` parsed by Python, or None: too long to parse (_MAX_EMBEDDING_SOURCE), holding no CUDA kernel, or
    not Python (a syntax error, nesting beyond the parser's limits)."""
    return parsed_python(source) if _GLOBAL in source else None


def parsed_python(source: str) -> ast.Module | None:
    """`source` parsed by Python, or None: too long to parse (_MAX_EMBEDDING_SOURCE), or not Python. A Triton
    module's launches are read from it (python_launch) with no CUDA in it."""
    if len(source) > _MAX_EMBEDDING_SOURCE:
        return None
    try:
        with warnings.catch_warnings():
            # An invalid escape in a kernel's string ("\d") is the sender's business, not the server log's.
            warnings.filterwarnings("ignore", module=re.escape(_EMBEDDING_FILENAME))
            return ast.parse(source, _EMBEDDING_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None


# A string made from a template is read where every value put in it is known without running anything: a literal,
# or a module constant (`_module_constants`). Agents write the block size into their CUDA that way
# (`f"""...{BLOCK}..."""`, `"""...""".format(BLOCK=256)`, `% {"BLOCK": BLOCK}`, string.Template,
# `"..." + str(BLOCK) + "..."`, `"...BLOCK...".replace("BLOCK", str(BLOCK))`). A `.format`, `%`, Template or
# `.replace` value that is not known is put in as `_RUNTIME_VALUE`, a name nothing defines: the template's own
# `{BLOCK}`, `{{`, `%%` or replaced `#define BLOCK 128` left in the text read wrongly (a launch of `{BLOCK}` or 128
# threads, a division for each `%`). An f-string's or `str()`'s is not read, as before (its text is made at run
# time). A `.replace` of a string not known here (`src = SRC; src = src.replace(...)`, a parameter's, a loop's
# `src.replace(k, v)`) is not followed to the string it edits: what it replaces is put in as a value known at run
# time in every string read (`_edited`), or, not known itself, leaves the text's launch unread (`EmbeddedCuda.edited`).
_RUNTIME_VALUE = "__runtime_value__"
_FORMATS = frozenset({"format", "substitute", "safe_substitute"})
# `%` formatting read: `%d`, `%i`, `%s`, with or without a `(key)`, and `%%`; any other (a width, `%f`) is not.
_PERCENT = re.compile(r"%(?:\((\w+)\))?(.?)")


class _NotRead(Exception):
    """A string not read: its text made at run time (an f-string's value, `str()` of a value, not known), or
    past the module's _MAX_FILLED."""


# The strings of one module (templates filled in, and their literals) are made up to this many characters in all:
# a 64 KB source filling one template with thousands of copies of a 30 KB constant made 270 MB, and took 39 s to
# read; 550 f-strings of eight copies each, every one under that bound, made 130 MB of CUDA and took 11 s.
_MAX_FILLED = 4 * 64 * 1024
# An int put in a template is read up to this size: `str()` of one past 4,300 decimal digits raises (a hexadecimal
# literal may be longer), and no kernel's constant is near it.
_MAX_CONSTANT = 2**128


class _OverBudget(_NotRead):
    """A string past what is left of its module's _MAX_FILLED."""


class _Budget:
    """What is left of a module's _MAX_FILLED characters of strings, shared by every string read in it: a string
    read is charged for its text, one not read (a value not known) for none, and once one goes past the bound no
    other is read."""

    def __init__(self) -> None:
        self.left = _MAX_FILLED


class _Text:
    """The pieces of a string being made, charged to the module's `budget`."""

    def __init__(self, budget: _Budget) -> None:
        self.parts: list[str] = []
        self.budget = budget

    def add(self, piece: str) -> None:
        self.budget.left -= len(piece)
        if self.budget.left < 0:
            raise _OverBudget
        self.parts.append(piece)

    def text(self) -> str:
        return "".join(self.parts)


def _constant(node: ast.AST, constants: Mapping[str, int | str]) -> int | str | None:
    """The value of an int or str literal, or a module constant by name; None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is str:
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value if -_MAX_CONSTANT < node.value < _MAX_CONSTANT else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand, {})
        return -inner if isinstance(inner, int) else None
    if isinstance(node, ast.Name):
        value = constants.get(node.id)
        # A string of CUDA is read where it is written (its own statement's literal), not again where it is put.
        return None if isinstance(value, str) and _holds_cuda(value) else value
    return None


def _holds_cuda(text: str) -> bool:
    """Whether a string is read as CUDA: a kernel or device function, or a wrapper launching one."""
    return _GLOBAL in text or "__device__" in text or ("<<<" in text and ">>>" in text)


def _string_value(
    node: ast.AST, constants: Mapping[str, int | str] | None = None, budget: _Budget | None = None
) -> tuple[str, list[ast.AST]] | None:
    """The value of a string expression known without running anything (a literal, an f-string or template of
    literals and module `constants`, a `+` of those), with the nodes it is made of; None for any other
    expression, or one past what is left of the module's `budget`."""
    budget = budget or _Budget()
    left = budget.left
    try:
        found = _string_parts(node, constants or {}, budget)
    except _OverBudget:
        return None
    except (_NotRead, RecursionError):
        found = None
    if found is None:
        # Nothing made (a value known only at run time): `a + x + b + c` is tried again from each `+` in it.
        budget.left = left
    return found


def _string_parts(
    node: ast.AST, constants: Mapping[str, int | str], budget: _Budget
) -> tuple[str, list[ast.AST]] | None:
    parts = _Text(budget)
    made_of: list[ast.AST] = []
    stack = [node]
    while stack:  # a + b + c nests to the left: walked without recursion, however long
        n = stack.pop()
        made_of.append(n)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            stack.extend((n.right, n.left))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            parts.add(n.value)
        elif isinstance(n, ast.JoinedStr):
            for v in n.values:
                made_of.append(v)
                if isinstance(v, ast.Constant):
                    parts.add(str(v.value))
                    continue
                if (
                    not isinstance(v, ast.FormattedValue)
                    or v.format_spec is not None
                    or v.conversion not in (-1, 115)
                ):
                    raise _NotRead  # 115: `!s`; a spec or `!r` may write the value otherwise
                value = _constant(v.value, constants)
                if value is None:
                    raise _NotRead
                parts.add(str(value))
        elif n is not node and isinstance(n, ast.Call) and _is_str_call(n):
            value = _constant(n.args[0], constants)
            if value is None:
                raise _NotRead
            parts.add(str(value))
        elif (formatted := _formatted(n, constants, budget)) is not None:
            parts.add(formatted)
            made_of.extend(ast.walk(n))
        else:
            return None
    return parts.text(), made_of


def _is_str_call(node: ast.Call) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and len(node.args) == 1
        and not node.keywords
    )


def _formatted(node: ast.AST, constants: Mapping[str, int | str], budget: _Budget) -> str | None:
    """The text a template makes (`.format(...)`, `% ...`, `Template(...).substitute(...)`), its values not known
    put in as `_RUNTIME_VALUE`; None where `node` is none of these, or its template is not a string known here."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        template = _template_text(node.left, constants, budget)
        return None if template is None else _percent(template, node.right, constants, budget)
    if _replaces(node):
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        count = node.args[2] if len(node.args) == 3 else node.keywords[0].value if node.keywords else None
        return _replaced(node.func.value, node.args[0], node.args[1], count, constants, budget)
    if not (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FORMATS
    ):
        return None
    receiver = node.func.value
    keywords: dict[str, int | str | None] = {}
    for k in node.keywords:
        if k.arg is None:
            return None  # `**values`: which names it gives is not known here
        keywords[k.arg] = _constant(k.value, constants)
    if node.func.attr == "format":
        template = _template_text(receiver, constants, budget)
        if template is None:
            return None
        args, more = _positional(node.args, constants)
        return _format(template, args, keywords, budget, more)
    # string.Template(text).substitute(...): its mapping a dict of literals, or keywords
    if not (
        isinstance(receiver, ast.Call)
        and len(receiver.args) == 1
        and not receiver.keywords
        and _names_template(receiver.func)
    ):
        return None
    template = _template_text(receiver.args[0], constants, budget)
    if template is None or len(node.args) > 1:
        return None
    if node.args:
        mapping = _mapping(node.args[0], constants)
        if mapping is None:
            return None
        keywords = {**mapping, **keywords}
    return _substitute(template, keywords, budget)


def _replaces(node: ast.AST) -> bool:
    """Whether `node` is a `.replace(old, new)` call, or `.replace(old, new, count)` (every one: what it replaces
    in is read where known)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "replace"
        and (
            (len(node.args) in (2, 3) and not node.keywords)
            or (len(node.args) == 2 and len(node.keywords) == 1 and node.keywords[0].arg == "count")
        )
    )


def _replaced(
    receiver: ast.AST,
    old: ast.AST,
    new: ast.AST,
    count: ast.AST | None,
    constants: Mapping[str, int | str],
    budget: _Budget,
) -> str | None:
    """A template's text with `.replace(old, new)` (or `.replace(old, new, count)`) done (`src.replace("BLOCK",
    str(256))`): None where the template or what it replaces is not known here; a `new`, or a count, not known puts
    `_RUNTIME_VALUE` in for each (the template's own `BLOCK`, or `#define BLOCK 128`, is not the kernel's)."""
    template = _template_text(receiver, constants, budget)
    if template is None:
        return None
    times: int | None = -1
    if count is not None:
        known_count = _constant(count, constants)
        times = known_count if isinstance(known_count, int) and not isinstance(known_count, bool) else None
    found = _string_parts(old, constants, budget)
    if found is None or not found[0]:
        return None
    if isinstance(new, ast.Name) or (
        isinstance(new, ast.Call) and _is_str_call(new)
    ):  # `DTYPE`, `str(BLOCK)`
        known = _constant(new.args[0] if isinstance(new, ast.Call) else new, constants)
        value = _put(known)
    else:
        try:
            put = _string_parts(new, constants, budget)
        except _NotRead:  # (over the budget: raised on)
            put = None
        value = _put(put[0] if put is not None else None)
    # Charged before it is made: thousands of copies of a long value need not be made to be refused.
    if times is None:
        value, times = _RUNTIME_VALUE, -1  # how many are replaced is not known: each may be
    if template.count(found[0]) * len(value) > budget.left:
        raise _OverBudget
    return template.replace(found[0], value, times)


def _template_text(node: ast.AST, constants: Mapping[str, int | str], budget: _Budget) -> str | None:
    """A template's own text: a string literal (or `+` of them), or a module constant of one."""
    if isinstance(node, ast.Name):
        value = constants.get(node.id)
        return value if isinstance(value, str) else None
    found = _string_parts(node, constants, budget)
    return found[0] if found is not None else None


def _mapping(node: ast.AST, constants: Mapping[str, int | str]) -> dict[str, int | str | None] | None:
    """A dict literal of string keys: its values (None where not known); None for anything else."""
    if not isinstance(node, ast.Dict):
        return None
    out: dict[str, int | str | None] = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return None
        out[key.value] = _constant(value, constants)
    return out


def _positional(
    nodes: Sequence[ast.expr], constants: Mapping[str, int | str]
) -> tuple[list[int | str | None], bool]:
    """Positional values as far as their positions are known (up to a `*starred` one), and whether a starred one
    follows them: the values it holds, and so the positions of those after it, are not known here."""
    for i, node in enumerate(nodes):
        if isinstance(node, ast.Starred):
            return [_constant(a, constants) for a in nodes[:i]], True
    return [_constant(a, constants) for a in nodes], False


def _put(value: int | str | None) -> str:
    return _RUNTIME_VALUE if value is None else str(value)


def _format(
    template: str,
    args: list[int | str | None],
    keywords: Mapping[str, int | str | None],
    budget: _Budget,
    more: bool = False,
) -> str | None:
    """`template.format(*args, **keywords)` for plain fields (`{}`, `{0}`, `{name}`, no spec or conversion but
    `!s`); None for any other field or a malformed template. `more`: positional values past `args` exist but
    are not known (a starred argument)."""
    out = _Text(budget)
    auto = 0
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError:
        return None
    for literal, name, spec, conversion in fields:
        out.add(literal)
        if name is None:
            continue
        if spec or conversion not in (None, "s"):
            return None
        if name == "":
            name, auto = str(auto), auto + 1
        if name.isdigit():
            if int(name) >= len(args):
                if not more:
                    return None
                out.add(_RUNTIME_VALUE)
            else:
                out.add(_put(args[int(name)]))
        elif name.isidentifier():
            out.add(_put(keywords[name]) if name in keywords else _RUNTIME_VALUE)
        else:
            return None  # `{x.y}`, `{x[0]}`: an attribute or an item of a value
    return out.text()


def _percent(
    template: str, right: ast.AST, constants: Mapping[str, int | str], budget: _Budget
) -> str | None:
    """`template % right` for `%d`, `%i`, `%s` (keyed by a dict literal or in order of a tuple) and `%%`; None
    for any other conversion or values that do not match them."""
    by_key = _mapping(right, constants) if isinstance(right, ast.Dict) else None
    values, more = (
        _positional(right.elts, constants)
        if isinstance(right, ast.Tuple)
        else ([_constant(right, constants)] if by_key is None else [], False)
    )
    out = _Text(budget)
    at = 0
    used = 0
    for m in _PERCENT.finditer(template):
        out.add(template[at : m.start()])
        at = m.end()
        key, kind = m.group(1), m.group(2)
        if kind == "%" and key is None:
            out.add("%")
        elif kind not in ("d", "i", "s"):
            return None
        elif key is not None:
            if by_key is None or key not in by_key:
                return None
            out.add(_put(by_key[key]))
        else:
            if by_key is not None or (used >= len(values) and not more):
                return None
            out.add(_put(values[used]) if used < len(values) else _RUNTIME_VALUE)
            used += 1
    if by_key is None and (used < len(values) if more else used != len(values)):
        return None
    out.add(template[at:])
    return out.text()


def _substitute(template: str, values: Mapping[str, int | str | None], budget: _Budget) -> str | None:
    """string.Template(template).substitute(values) (safe_substitute's too); None for a malformed `$`."""
    out = _Text(budget)
    at = 0
    for m in string.Template.pattern.finditer(template):
        out.add(template[at : m.start()])
        at = m.end()
        if m.group("escaped") is not None:
            out.add("$")
            continue
        name = m.group("named") or m.group("braced")
        if name is None:
            return None
        out.add(_put(values[name]) if name in values else _RUNTIME_VALUE)
    out.add(template[at:])
    return out.text()


def _module_constants(module: ast.Module) -> tuple[dict[str, int | str], set[str]]:
    """The names a module binds once, at its top level, to an int or str literal, and nowhere else (no other
    assignment, parameter, import, def, `global`...): their values. And of those holding a string, the ones used
    only as a template (`TEMPLATE.format(...)`): their literal is read where it is filled in, not as it stands."""
    candidates = {
        target.id
        for stmt in module.body
        if isinstance(stmt, ast.Assign | ast.AnnAssign)
        and isinstance(target := stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target, ast.Name)
    }
    if not candidates:
        return {}, set()
    bound: dict[str, int] = {}
    loads: dict[str, int] = {}
    as_template: dict[str, int] = {}
    for node in ast.walk(module):  # by exact type, the commonest first: a walk of a whole module
        kind = type(node)
        if kind is ast.Name:
            assert isinstance(node, ast.Name)
            counts = loads if type(node.ctx) is ast.Load else bound
            counts[node.id] = counts.get(node.id, 0) + 1
        elif kind is ast.Call or kind is ast.BinOp:
            receiver = _template_receiver(node)
            if isinstance(receiver, ast.Name):
                as_template[receiver.id] = as_template.get(receiver.id, 0) + 1
        elif kind in BINDERS:
            for name in bindings(node):
                bound[name] = bound.get(name, 0) + 1
    constants: dict[str, int | str] = {}
    for stmt in module.body:
        value: ast.expr | None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            target, value = stmt.target, stmt.value
        else:
            continue
        if isinstance(target, ast.Name) and value is not None and bound.get(target.id) == 1:
            found = _constant(value, {})
            if found is not None:
                constants[target.id] = found
    templates = {
        name
        for name, value in constants.items()
        if isinstance(value, str) and 0 < as_template.get(name, 0) == loads.get(name, 0)
    }
    return constants, templates


def _names_template(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "Template") or (
        isinstance(func, ast.Attribute) and func.attr == "Template"
    )


def _template_receiver(node: ast.AST) -> ast.AST | None:
    """The template a `.format(...)`, `%` or `Template(...)` fills in; None for any other node."""
    if isinstance(node, ast.BinOp):
        return node.left if isinstance(node.op, ast.Mod) else None
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Attribute) and (node.func.attr == "format" or _replaces(node)):
        return node.func.value
    return node.args[0] if len(node.args) == 1 and _names_template(node.func) else None


BINDERS = (
    ast.arg,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.alias,
    ast.ExceptHandler,
    ast.MatchAs,
    ast.MatchStar,
    ast.MatchMapping,
    ast.Global,
    ast.Nonlocal,
)


def bindings(node: ast.AST) -> Iterator[str]:
    """The names `node`, one of BINDERS, binds (or declares bound elsewhere: `global`)."""
    if isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.alias):
        yield node.asname or node.name.split(".")[0]
    elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name is not None:
        yield node.name
    elif isinstance(node, ast.MatchMapping) and node.rest is not None:
        yield node.rest
    elif isinstance(node, ast.Global | ast.Nonlocal):
        yield from node.names


@dataclass
class _Statement:
    """What one top-level statement of a Python module binds, names, and holds of CUDA."""

    binds: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    literals: list[str] = field(default_factory=list)  # those holding CUDA, in order
    launched: list[str] = field(default_factory=list)  # kernel names given to RawKernel / get_function
    # `.replace(old, new)` calls of a string not known here (`src.replace(...)` after `src = SRC`): the name it is
    # called on, or None, and `old` ("": not known); `_Edits`.
    edits: list[tuple[str | None, str]] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)  # `import os`: os.replace(a, b) edits no string


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_STRINGS = (ast.Constant, ast.JoinedStr, ast.BinOp, ast.Call)


def _fills_template(node: ast.AST) -> bool:
    """Whether `node` fills a template in (`.format(...)`, `.substitute(...)`): read as a string, not for the
    kernel it names."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FORMATS
    ) or _replaces(node)


def _read_statement(
    stmt: ast.stmt,
    constants: Mapping[str, int | str] | None = None,
    templates: Collection[str] = (),
    budget: _Budget | None = None,
) -> _Statement:
    """What `stmt` binds, names and holds of CUDA, its strings read with the module's `constants` and within what
    is left of its `budget`; a template named in `templates` (`_module_constants`) is read where it is filled in,
    not where it is written."""
    out = _Statement()
    budget = budget or _Budget()
    scope = isinstance(stmt, _SCOPES)
    if isinstance(stmt, _SCOPES):
        out.binds.add(stmt.name)  # what it assigns inside is its own
    skip: set[int] = set()
    if (
        isinstance(stmt, ast.Assign | ast.AnnAssign)
        and isinstance(target := stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target, ast.Name)
        and target.id in templates
        and stmt.value is not None
    ):
        skip.update(id(n) for n in ast.walk(stmt.value))
    for node in ast.walk(stmt):  # a node at a time by its exact type: this loop is most of the cost
        kind = type(node)
        if kind is ast.Name:
            assert isinstance(node, ast.Name)
            if type(node.ctx) is not ast.Store:
                out.names.add(node.id)
                if node.id in templates and id(node) not in skip and constants is not None:
                    # A template filled in with what is not read here (`**cfg`, `%5d`): its text as written.
                    text = str(constants[node.id])
                    if _holds_cuda(text) and budget.left >= len(text):
                        budget.left -= len(text)
                        out.literals.append(text)
            elif not scope:
                out.binds.add(node.id)
        elif kind is ast.Call and not _fills_template(node):
            assert isinstance(node, ast.Call)
            if (named := launched_name(node)) is not None:
                out.launched.append(named)
        elif kind in _STRINGS:
            if id(node) in skip or (kind is ast.Constant and type(node.value) is not str):  # type: ignore[attr-defined]
                continue
            value = _string_value(node, constants, budget)
            if value is None:
                if kind is ast.Call and _replaces(node):
                    assert isinstance(node, ast.Call)
                    edit = _unread_edit(node, constants or {})
                    if edit is not None:
                        out.edits.append(edit)
                if kind is ast.JoinedStr:
                    # Placeholders: its text is made at run time; its pieces are no kernel's source.
                    skip.update(id(n) for n in ast.walk(node))
                continue
            text, made_of = value
            skip.update(id(n) for n in made_of)
            # A wrapper in a string of its own (`cuda_sources=[kernels, wrapper]`) launches the kernel: kept.
            if _holds_cuda(text):
                out.literals.append(text)
        elif kind is ast.Expr:
            assert isinstance(node, ast.Expr)
            if type(node.value) in (ast.Constant, ast.JoinedStr):
                skip.add(id(node.value))  # a docstring, or a string no call is given
        elif kind in _SCOPES and not scope:
            assert isinstance(node, _SCOPES)
            out.binds.add(node.name)  # a def under a top-level if or try
        elif kind is ast.Global:
            assert isinstance(node, ast.Global)
            out.binds.update(node.names)  # `def setup(): global k; k = ...` binds the module's k
        elif kind is ast.Import:
            assert isinstance(node, ast.Import)
            out.modules.update(a.asname or a.name.split(".")[0] for a in node.names)
    return out


def _unread_edit(call: ast.Call, constants: Mapping[str, int | str]) -> tuple[str | None, str] | None:
    """A `.replace(old, new)` whose string is not known here (`_Statement.edits`): the name it is called on (None:
    another expression) and `old`, "" where not known. None for one that edits no CUDA: of a string literal or
    f-string (an f-string is never read as CUDA), of `str(...)`, or replacing text with no letter, digit or `_` in
    it (`name.replace("-", "_")`: no kernel's launch is edited so)."""
    assert isinstance(call.func, ast.Attribute)
    receiver = call.func.value
    if (
        (
            isinstance(receiver, ast.Constant)
            and not (isinstance(receiver.value, str) and _holds_cuda(receiver.value))
        )
        or isinstance(receiver, ast.JoinedStr)
        or (isinstance(receiver, ast.Call) and _is_str_call(receiver))
    ):
        return None
    found = _string_value(call.args[0], constants)
    old = found[0] if found is not None else ""
    if found is not None and not _WORD.search(old):
        return None
    return (receiver.id if isinstance(receiver, ast.Name) else None), old


_WORD = re.compile(r"\w")
# Distinct texts put in for by edits not read (`_edited`) past this many: the whole text taken as edited.
_MAX_EDITS = 32
# Places put in for past this many (each a name of its own, longer than what it replaces): the text taken as edited.
_MAX_EDITED_PLACES = 4096


def _edited(statements: Sequence[_Statement]) -> bool:
    """Put in, for each text some `.replace` not read replaces (`_Statement.edits`), a value known only at run
    time in every string read: which string it edits is not followed, so each may be. Each place gets a name of
    its own (`__runtime_value__3__`): another string's `#define BLOCK 128` is not the edited one's BLOCK. Whether
    the text may be edited otherwise (what is replaced not known, or too many places): its launch is not read."""
    modules = set().union(*(s.modules for s in statements))
    olds = {old for s in statements for name, old in s.edits if name is None or name not in modules}
    if not olds:
        return False
    if "" in olds or len(olds) > _MAX_EDITS:
        return True
    # Longest first: of two that overlap where they start, the longer is the one put in for.
    pattern = re.compile("|".join(re.escape(o) for o in sorted(olds, key=len, reverse=True)))
    places = sum(len(pattern.findall(t)) for s in statements for t in s.literals)
    if places > _MAX_EDITED_PLACES:
        return True
    count = iter(range(places))
    for s in statements:
        s.literals = [pattern.sub(lambda _: f"{_RUNTIME_VALUE}{next(count)}__", t) for t in s.literals]
    return False


def launched_name(call: ast.Call) -> str | None:
    """The kernel name a RawKernel or get_function call is given as a literal, if it is one."""
    func = call.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    at = _NAMING_CALLS.get(called)
    if at is None:
        return None
    named = next((k.value for k in call.keywords if k.arg == "name"), None) if called == "RawKernel" else None
    if named is None and len(call.args) > at:
        named = call.args[at]
    return named.value if isinstance(named, ast.Constant) and isinstance(named.value, str) else None


def embedded_cuda(source: str, entry: str | None) -> EmbeddedCuda | None:
    """The CUDA C a Python source holds in its string literals, as far as `entry` reaches it; None when it holds
    none that `entry` reaches, or cannot be parsed (`python_module`). Which literals: those of the top-level
    statements `entry` names (a function or class of the module: the Python launching the kernel; a method of a
    class: the class; else the statements whose literals define `entry` as a `__global__` kernel) and of the
    statements those use, directly or through others, so not a naive twin kept beside it nor a Triton kernel's
    module; with `entry` none of these, all. They are read as one CUDA source, its entry `entry` when they define
    it, else the kernel named to RawKernel or get_function in those statements, else their only kernel, else
    none (every kernel of them: a Python function launching two runs both)."""
    module = python_module(source)
    return None if module is None else embedded_cuda_in(module, entry)


def embedded_cuda_in(module: ast.Module, entry: str | None) -> EmbeddedCuda | None:
    """`embedded_cuda` of a module parsed already (`python_module`)."""
    constants, templates = _module_constants(module)
    budget = _Budget()  # shared: a module's strings are made up to _MAX_FILLED in all
    statements = [_read_statement(stmt, constants, templates, budget) for stmt in module.body]
    if not any(s.literals for s in statements):
        return None
    edited = _edited(statements)
    kernels = {
        # `__global__ void __launch_bounds__(256) k(...)` named `__launch_bounds__`, and its launch was not read.
        t: {name for _, name, _ in _global_names(_without_launch_bounds(strip_comments(t)))}
        for s in statements
        for t in s.literals
    }
    binders: dict[str, list[int]] = {}
    for i, s in enumerate(statements):
        for name in s.binds:
            binders.setdefault(name, []).append(i)
    roots = binders.get(entry or "", [])
    if not roots and entry:
        roots = [
            i
            for i, stmt in enumerate(module.body)
            if isinstance(stmt, ast.ClassDef)
            and any(
                isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == entry for n in stmt.body
            )
        ]
    if not roots and entry:
        roots = [i for i, s in enumerate(statements) if any(entry in kernels[t] for t in s.literals)]
    used = statements
    if roots:
        reached, queue = set(roots), list(roots)
        while queue:
            for name in statements[queue.pop()].names:
                for j in binders.get(name, ()):
                    if j not in reached:
                        reached.add(j)
                        queue.append(j)
        used = [statements[i] for i in sorted(reached)]
    literals = list(dict.fromkeys(t for s in used for t in s.literals))
    if not literals:
        return None
    defined = set().union(*(kernels[t] for t in literals))
    if entry in defined:
        return EmbeddedCuda("\n".join(literals), entry, edited)
    launched = {name for s in used for name in s.launched} & defined
    text = "\n".join(literals)
    if not launched and len(defined) > 1:
        # torch's load_inline names no kernel in Python: its wrapper's `k<<<...>>>` does (a naive kernel kept
        # beside the one it launches is not the entry). A wrapper launching two runs both: no one kernel. Where
        # Python names two (CuPy), it runs both: a kernel's device-side `child<<<...>>>` chooses nothing.
        launched = {m.group(1) for m in _CHEVRON_TARGET.finditer(strip_comments(text))} & defined
    chosen = launched if len(launched) == 1 else defined if len(defined) == 1 else set()
    return EmbeddedCuda(text, next(iter(chosen), None), edited)


# ---------------------------------------------------------------- launch, occupancy, all together


@dataclass(frozen=True)
class StaticFeatures:
    """Everything known about one kernel before it runs."""

    source: SourceFeatures
    threads_per_block: int | None = None
    blocks: int | None = None
    dynamic_shared_bytes: int | None = None
    registers: int | None = None  # ptxas, per thread
    static_shared_bytes: int | None = None  # ptxas
    spill_bytes: int | None = None  # ptxas stores + loads
    occupancy: float | None = None  # theoretical, needs the spec (and registers when known)
    blocks_per_sm: int | None = None
    waves: float | None = None  # blocks / (SMs x resident blocks per SM)
    sm_utilisation: float | None = None  # busy share of SMs (idle SMs below a wave, partial last wave)
    fp64_ratio: float | None = None  # the GPU's FP32 over FP64 throughput (GpuSpec.fp64_ratio), with the spec
    # Whether the GPU has matrix instructions (GpuSpec.tensor_cores). The GPU's, not the kernel's: left out of
    # Claude's per-kernel features (the hardware row says it), where "baseline.tensor_cores: True" beside
    # "baseline.source.tensor_core: 0" read as a plain kernel using tensor cores.
    tensor_cores: bool | None = field(default=None, metadata={"prompt": False})
    # What of the launch was read from the source's own host code (host_launch.source_launch), as the rationale
    # and Claude's prompt say it ("grid [256, 1, 1], block [128, 1, 1]"); None when the kernel came with its
    # launch or the source says nothing. The numbers themselves are in the fields above.
    launch_from_source: str | None = None
    # The headers this server's nvcc lacks that were left out to compile the kernel's device code alone for the
    # ptxas figures above (ptxas.PtxasUsage.without_headers): the rationale says so. Empty otherwise.
    compiled_without: tuple[str, ...] = field(default=(), metadata={"prompt": False})
    numeric_defines: dict[str, float] = field(default_factory=dict)

    @property
    def total_threads(self) -> int | None:
        """Threads the launch starts (blocks x threads per block); None without a launch."""
        if self.threads_per_block is None or self.blocks is None:
            return None
        return self.threads_per_block * self.blocks

    def as_dict(self) -> dict[str, float]:
        """Flat numeric view (for logs, prompts and tests); unknown values are left out."""
        out: dict[str, float] = {f"src_{k}": float(v) for k, v in vars(self.source).items()}
        for name in (
            "threads_per_block",
            "blocks",
            "dynamic_shared_bytes",
            "registers",
            "static_shared_bytes",
            "spill_bytes",
            "occupancy",
            "blocks_per_sm",
            "waves",
            "sm_utilisation",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value)
        out.update({f"define_{k}": v for k, v in self.numeric_defines.items()})
        return out


def _numeric_defines(defines: dict[str, Any]) -> dict[str, float]:
    """Defines that read as finite numbers. Others are left out: an int too big for a float raises
    OverflowError, and a string such as "1e400" or "nan" reads as a non-finite float that would poison a model."""
    out: dict[str, float] = {}
    for k, v in defines.items():
        if not isinstance(v, int | float | str):
            continue
        try:
            number = float(v)
        except (ValueError, OverflowError):
            continue
        if math.isfinite(number):
            out[k] = number
    return out


# What `#if` reads as a condition it cannot decide (the ternary rule of _eval_condition): both branches count.
_UNDECIDED = "?"


def compile_macros(kernel: Kernel, spec: GpuSpec | None) -> dict[str, Any]:
    """The macros the compiler's device pass sees for `kernel`: nvcc's `__CUDACC__`, `__NVCC__` and
    `__CUDA_ARCH__` (from the GPU's compute capability; unknown, its conditions count both ways; also for the CUDA
    in a Python source's strings); for HIP,
    hipcc's (`__HIP_DEVICE_COMPILE__`, and by the GPU's vendor `__HIP_PLATFORM_AMD__` with the `__gfx942__`-style
    architecture, or `__HIP_PLATFORM_NVIDIA__` with nvcc's); for OpenCL, `__OPENCL_VERSION__` (unknown: its
    conditions count both ways). Then the `-D`/`-U` flags of its compile options in order, then its defines
    (never the same name as a flag: models.Kernel refuses that)."""
    macros: dict[str, Any] = {}
    vendor = spec.vendor if spec is not None else None
    if kernel.language == "hip":
        macros.update({"__HIPCC__": 1, "__HIP_DEVICE_COMPILE__": 1})
        if spec is not None and vendor == "amd":
            macros.update(
                {"__HIP__": 1, "__HIP_PLATFORM_AMD__": 1, "__HIP_PLATFORM_HCC__": 1, "__AMDGCN__": 1}
            )
            macros.update({f"__{spec.arch}__": 1, "__AMDGCN_WAVEFRONT_SIZE": spec.warp_size})
        elif vendor == "nvidia":
            macros.update({"__HIP_PLATFORM_NVIDIA__": 1, "__HIP_PLATFORM_NVCC__": 1})
    # A Python source's CUDA (`embedded_cuda`) is compiled by NVRTC (CuPy) or nvcc (torch): the same macros.
    if kernel.language in ("cuda", *PYTHON_LANGUAGES) or (kernel.language == "hip" and vendor == "nvidia"):
        cc = spec.compute_capability if spec is not None else None
        major, _, minor = (cc or "").partition(".")
        arch = int(major) * 100 + int(minor or 0) * 10 if major.isdigit() and minor.isdigit() else _UNDECIDED
        macros.update({"__CUDACC__": 1, "__NVCC__": 1, "__CUDA_ARCH__": arch})
    if kernel.language == "opencl":
        macros.update({"__OPENCL_VERSION__": _UNDECIDED, "__OPENCL_C_VERSION__": _UNDECIDED})
    return with_command_line(macros, kernel)


def with_command_line(macros: dict[str, Any], kernel: Kernel) -> dict[str, Any]:
    """`macros` (a compiler's own) after the kernel's `-D` / `-U` flags in order, then its defines: the macros a
    compile of it sees (compile_macros for the device pass, host_launch for the host pass)."""
    for option in kernel.compile_options:
        if option.startswith("-D"):
            name, eq, value = option[2:].partition("=")
            macros[name] = value if eq else 1
        elif option.startswith("-U"):
            macros.pop(option[2:], None)
    macros.update(kernel.defines)
    return macros


def _occupancy(spec: GpuSpec, threads: int, registers: int, shared: int) -> tuple[float, int] | None:
    """(occupancy, resident blocks per SM) from the hardware module, None if it is unavailable."""
    try:
        from forecaster_mcp.hardware.occupancy import occupancy_limits
    except ImportError:  # the hardware helper is optional for forecasting
        return None
    limits = occupancy_limits(spec, threads, registers, shared)
    return limits.occupancy, limits.active_blocks


def kernel_features(
    kernel: Kernel, workload: Workload | None, spec: GpuSpec | None, ptxas: PtxasEntry | None = None
) -> StaticFeatures:
    """Static features of one kernel; hardware-specific ones only when `spec` is known. The workload's sizes
    enter through the launch: the kernel's own, or one its source's host code gives it (`with_resources`)."""
    return with_resources(kernel_source_features(kernel, spec), kernel, spec, ptxas, workload)


def kernel_source_features(kernel: Kernel, spec: GpuSpec | None) -> SourceFeatures:
    """`source_features` of `kernel` in its language, under the macros its compiler sets (`compile_macros`)."""
    return source_features(kernel.source, compile_macros(kernel, spec), kernel.entry, kernel.language)


_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\b")
# Triton puts a tl.dot's operand tiles in shared memory, num_stages deep where its loads are pipelined (128 x 32 and
# 32 x 128 fp16 tiles, 4 stages: 64 KiB), an amount the compiler decides.
_TRITON_DOT = re.compile(r"\b(?:tl|triton\.language)\.dot(?:_scaled)?\s*\(")


def _has_extern_shared(kernel: Kernel) -> bool:
    return _EXTERN_SHARED.search(kernel.source) is not None


def _stages_dot_tiles(kernel: Kernel) -> bool:
    """Whether a Triton kernel (`entry` and what it calls) uses tl.dot, FMA's too (`input_precision="ieee"`)."""
    return _TRITON_DOT.search(python_entry_text(_python_text(kernel.source), kernel.entry)) is not None


def with_resources(
    src: SourceFeatures,
    kernel: Kernel,
    spec: GpuSpec | None,
    ptxas: PtxasEntry | None,
    workload: Workload | None = None,
) -> StaticFeatures:
    """A kernel's static features from its source features, its launch and (when known) ptxas's resources:
    `kernel_features` without reading the source again. A kernel without a launch takes what its source's host
    code launches it with, sizes from `workload` (host_launch.source_launch)."""
    threads = blocks = dyn = None
    read: str | None = None
    dyn_unknown = False
    if kernel.launch is not None:
        threads = kernel.launch.threads_per_block
        blocks = kernel.launch.blocks
        dyn = kernel.launch.shared_mem_bytes
    else:
        from forecaster_mcp.forecast.host_launch import source_launch

        found = source_launch(kernel, workload)
        if found is not None:
            read = found.describe()
            if found.block is not None:
                threads = math.prod(found.block)
                if found.warps is not None and spec is not None:
                    # A Triton program's warps: on AMD, wavefronts of 64 threads.
                    threads = found.warps * spec.warp_size
                dyn = found.shared_mem_bytes
                # Its dynamic shared memory not read (`256 * sizeof(T)`, a run-time size) where the kernel
                # has some: occupancy counted without it would be too high (a block of 48 KiB as one of none).
                # A Triton kernel's is the compiler's, and it stages tl.dot's tiles there.
                has_some = (
                    _stages_dot_tiles(kernel) if found.warps is not None else _has_extern_shared(kernel)
                )
                dyn_unknown = dyn is None and has_some
            if found.grid is not None:
                blocks = math.prod(found.grid)
    registers = ptxas.registers if ptxas else None
    static_smem = ptxas.shared_bytes if ptxas else None
    spills = ptxas.spill_bytes if ptxas else None
    occupancy = blocks_per_sm = waves = util = None
    if spec is not None and threads is not None and not dyn_unknown:
        occ = _occupancy(spec, threads, registers or 0, (static_smem or 0) + (dyn or 0))
        if occ is not None:
            occupancy, blocks_per_sm = occ
            if blocks is not None and blocks_per_sm > 0:
                slots = spec.sms * blocks_per_sm
                waves = blocks / slots
                if waves <= 1.0:
                    # Fewer blocks than resident slots: the scheduler spreads them over the SMs first, so
                    # what is lost is the SMs left without a block, not the empty slots (a grid-stride
                    # launch of a few blocks per SM keeps every SM busy).
                    util = min(1.0, blocks / spec.sms)
                else:
                    util = waves / math.ceil(waves)  # the last, partial wave (tail effect)
    return StaticFeatures(
        source=src,
        threads_per_block=threads,
        blocks=blocks,
        dynamic_shared_bytes=dyn,
        registers=registers,
        static_shared_bytes=static_smem,
        spill_bytes=spills,
        occupancy=occupancy,
        blocks_per_sm=blocks_per_sm,
        waves=waves,
        sm_utilisation=util,
        fp64_ratio=spec.fp64_ratio if spec is not None else None,
        tensor_cores=spec.tensor_cores if spec is not None else None,
        launch_from_source=read,
        numeric_defines=_numeric_defines(dict(kernel.defines)),
    )


# ---------------------------------------------------------------- the static prior


@dataclass(frozen=True)
class PriorShift:
    """A heuristic belief about log2 S = log2(t_baseline / t_candidate) from static features."""

    mean_log2: float
    sd_log2: float
    reasons: list[str]


# Hand-set heuristics (occupancy, waves, spills, tensor cores...) stay mild: together they never exceed
# MAX_SHIFT_LOG2. The access-pattern, algorithm and work-per-thread terms below are fitted (ridge, log2 speedup
# on the term values) on 246 measured pairs of different kernels of 9 problems on an H200 (benchmarks/corpus,
# made by this project); leaving each problem out in turn (benchmarks/corpus_lopo.py) they give accuracy 0.82,
# Brier 0.135, ECE 0.075, and 31% of pairs beyond the 0.95 threshold with none of those wrong (without
# work_per_thread: 0.78, 0.149, 0.067, 25%). PRIOR_SD_LOG2 is the fit's residual spread (1.13), rounded up.
PRIOR_SD_LOG2 = 1.2
MAX_SHIFT_LOG2 = 0.6
MAX_TOTAL_SHIFT_LOG2 = 5.0
FITTED_TERMS: tuple[tuple[str, float, str], ...] = (
    ("strided_access", -2.2, "uncoalesced (row-strided) global access"),
    ("thread_atomics", -4.0, "one global atomic per element"),
    ("tiling", 0.9, "shared-memory tiling"),
    ("vector_types", 0.6, "vector loads"),
    ("warp_shuffles", 1.2, "warp shuffles"),
    ("work_per_thread", 0.2, "more work per thread (fewer threads for the same workload)"),
)
# work_per_thread is log2(threads the baseline launches / threads the candidate launches), capped here: both
# kernels do the same workload, so fewer threads means each does more (register tiling, coarsening, fewer
# partial results to combine). Sixteen times fewer threads is as much as it is trusted to say; how few is too
# few is the waves term's business. It is fitted on different kernels and applies to them only: between
# tuning variants of one kernel (23 Kernel Tuner spaces, launches derived from block and tile sizes) the one
# launching fewer threads was faster in 24% to 87% of pairs depending on kernel and GPU, about half overall.
WORK_RATIO_CAP_LOG2 = 4.0


def _fp64_scale(a: StaticFeatures, b: StaticFeatures) -> float:
    """How much more FP64 costs on the pair's GPU than where the fp64 term's 0.1 log2 was set (half-rate FP64,
    the data-centre GPUs): log2 of the GPU's FP32 over FP64 throughput, at least 1. On a GeForce or workstation
    Ampere, Ada or Blackwell (1/64 rate) it is 6: -0.6 log2 for the kernel that uses doubles. On the H200 the
    fp64 kernels of benchmarks/corpus (conv1d accumulating in double) ran 1.4-1.9x slower than their float
    twins, so the term stays on the safe side of the throughput ratio (a double may be one scalar)."""
    ratio = a.fp64_ratio or b.fp64_ratio
    return max(1.0, math.log2(ratio)) if ratio else 1.0


def _presence(a: int, b: int) -> int:
    """+1 when only the candidate (b) uses a construct, -1 when only the baseline (a) does."""
    return int(b > 0) - int(a > 0)


def _construct_counts(s: SourceFeatures) -> dict[str, int]:
    """Source counts by name, with "tiling" (shared memory and barriers together)."""
    return {**vars(s), "tiling": s.shared * s.barriers}


def _work_ratio(baseline: StaticFeatures, candidate: StaticFeatures) -> float:
    ta, tb = baseline.total_threads, candidate.total_threads
    if not ta or not tb:
        return 0.0  # a launch is missing (or empty): nothing to say
    cap = WORK_RATIO_CAP_LOG2
    return max(-cap, min(cap, math.log2(ta / tb)))


def fitted_values(baseline: StaticFeatures, candidate: StaticFeatures) -> list[float]:
    """The value of each FITTED_TERMS term, in FITTED_TERMS order: the presence difference (`_presence`) of
    each source construct, and the capped log2 thread ratio for work_per_thread."""
    a, b = _construct_counts(baseline.source), _construct_counts(candidate.source)
    return [
        _work_ratio(baseline, candidate) if name == "work_per_thread" else float(_presence(a[name], b[name]))
        for name, _, _ in FITTED_TERMS
    ]


def prior_shift(
    baseline: StaticFeatures, candidate: StaticFeatures, fitted: bool = True, same_family: bool = False
) -> PriorShift:
    """A shift in log2 speedup from feature differences, with a wide spread (see module doc and FITTED_TERMS).
    `fitted=False` leaves the fitted terms out (the hand-set part alone, which refits start from).
    `same_family`: two variants of one source, for which work_per_thread says nothing (WORK_RATIO_CAP_LOG2)."""
    shift = 0.0
    terms: list[tuple[float, str]] = []

    def add(value: float, why: str) -> None:
        nonlocal shift
        if value != 0.0:
            shift += value
            terms.append((value, f"{why} ({'+' if value > 0 else '-'})"))

    a, b = baseline, candidate
    if a.spill_bytes is not None and b.spill_bytes is not None and a.spill_bytes != b.spill_bytes:
        # Spilled bytes go through local memory; a few bytes are cheap, hundreds are not.
        add(-0.12 * (math.log2(1 + b.spill_bytes / 8) - math.log2(1 + a.spill_bytes / 8)), "register spills")
    if a.occupancy is not None and b.occupancy is not None and min(a.occupancy, b.occupancy) > 0:
        # Occupancy matters mostly when it is low: above one half, latency is usually hidden.
        lo_a, lo_b = min(a.occupancy, 0.5), min(b.occupancy, 0.5)
        add(0.25 * math.log2(lo_b / lo_a), "occupancy")
    elif a.occupancy is not None and b.occupancy is not None and (a.occupancy > 0) != (b.occupancy > 0):
        # One of the two cannot launch at all (registers or shared memory beyond the SM's); neither: no term.
        if b.occupancy == 0.0:
            add(-MAX_SHIFT_LOG2, "candidate cannot launch at this block size")
        else:
            add(MAX_SHIFT_LOG2, "baseline cannot launch at this block size")
    if a.sm_utilisation is not None and b.sm_utilisation is not None and a.sm_utilisation > 0:
        if b.sm_utilisation > 0:
            add(0.4 * math.log2(b.sm_utilisation / a.sm_utilisation), "SM utilisation (waves)")
    if a.threads_per_block is not None and b.threads_per_block is not None:
        add(0.1 * (int(a.threads_per_block % 32 != 0) - int(b.threads_per_block % 32 != 0)), "partial warps")
        add(0.1 * (int(a.threads_per_block < 64) - int(b.threads_per_block < 64)), "tiny blocks")
    sa, sb = a.source, b.source
    if a.tensor_cores is not False and b.tensor_cores is not False:
        # A GPU without matrix instructions (Pascal, MI50, RDNA2) gains nothing from them; on Pascal and
        # older nvcc refuses mma for the architecture (the local forecaster gives such a kernel a high p_fail).
        add(0.35 * _presence(sa.tensor_core, sb.tensor_core), "tensor cores")
    add(0.08 * _presence(sa.async_copy, sb.async_copy), "async copies")
    add(0.05 * _presence(sa.readonly, sb.readonly), "read-only loads")
    add(0.04 * _presence(sa.unroll_pragmas, sb.unroll_pragmas), "unrolling")
    add(-0.1 * _fp64_scale(a, b) * _presence(sa.fp64, sb.fp64), "fp64 arithmetic")
    shift = max(-MAX_SHIFT_LOG2, min(MAX_SHIFT_LOG2, shift))
    if fitted:
        for (name, weight, why), value in zip(FITTED_TERMS, fitted_values(a, b), strict=True):
            if not (same_family and name == "work_per_thread"):
                add(weight * value, why)
    shift = max(-MAX_TOTAL_SHIFT_LOG2, min(MAX_TOTAL_SHIFT_LOG2, shift))
    # Largest contributions first: a rationale shows only the first few.
    reasons = [why for _, why in sorted(terms, key=lambda t: -abs(t[0]))]
    return PriorShift(shift, PRIOR_SD_LOG2, reasons)


# Anchoring on measured kernels of the workload (LocalForecaster._prior_forecast). A kernel's log2 runtime is
# the workload's level, less the prior's static score of the kernel, plus an error of that kernel's own; the
# prior's log2 speedup of a pair is the difference of two scores, so its spread (PRIOR_SD_LOG2) is that of two such
# errors. Each measured kernel of the same workload and GPU then estimates an unmeasured kernel's runtime (its
# runtime less the prior's shift from it to the unmeasured one). The median of n estimates (the errors are
# heavy-tailed: one kernel the features misjudge badly must not move every forecast of its workload) leaves about
# 1 + (pi/2)/n errors where one estimate leaves 2. Kernels of other designs than the pair's own kernel say little
# of a tweak of it: only anchors no further from the unmeasured kernel in the fitted terms count
# (anchored_log2_ms). Leaving each problem of benchmarks/corpus out in turn, with a random share of each
# workload's kernels measured and the pairs of one measured and one unmeasured kernel forecast
# (benchmarks/corpus_lopo.py --anchors SHARE, means of 20 draws), against the pair's other kernel alone, for 30 /
# 50 / 70% measured: accuracy 0.829 -> 0.834, 0.824 -> 0.837, 0.816 -> 0.832; Brier 0.132 -> 0.126, 0.133 ->
# 0.121, 0.137 -> 0.120; ECE 0.095 -> 0.089, 0.082 -> 0.077, 0.085 -> 0.085; decided at the 0.95 threshold 30 ->
# 33%, 31 -> 34%, 31 -> 35%, with at most 0.4% of those wrong (none before). Taking every anchor (not only the
# near ones) decided more (36-38%) but lost accuracy on the pairs whose kernels differ in no fitted term
# (0.68 -> 0.64) and with 30% measured overall (0.829 -> 0.814); their mean instead of the median lost 0.5-1.5
# points more.
KERNEL_ERROR_SD_LOG2 = PRIOR_SD_LOG2 / math.sqrt(2.0)
# Measured kernels (of other families, the latest of each) a forecast anchors on, at most.
MAX_ANCHORS = 16


class Anchored(NamedTuple):
    """An unmeasured kernel's log2 runtime (ms) as its workload's measured kernels estimate it."""

    log2_ms: float
    sd_log2: float
    used: int  # the measured kernels the estimate rests on, the pair's own kernel included


def anchored_log2_ms(
    target: StaticFeatures, anchors: Sequence[tuple[StaticFeatures, float]], target_is_candidate: bool
) -> Anchored:
    """Log2 runtime (ms) of an unmeasured kernel and its sd, from measured kernels of the same workload and GPU,
    each given as (features, log2 ms), the first the pair's other kernel: the median of their estimates
    (KERNEL_ERROR_SD_LOG2). Of the others, only those that differ from the target in no more of the fitted terms
    (FITTED_TERMS: the access pattern, algorithm and work-per-thread constructs) than the pair's own kernel does
    count: a tweak of the pair's kernel is estimated from that kernel and from other tweaks alike, not from kernels
    of other designs whose errors say little about it. Each prior shift is taken in
    the pair's own direction (`target_is_candidate`: the unmeasured kernel is the pair's candidate), so that
    anchored on the pair's other kernel alone the forecast is the pair's plain prior."""
    if not anchors:
        raise ValueError("anchored_log2_ms needs at least one measured kernel")
    reach = _terms_apart(anchors[0][0], target)
    near = [anchors[0], *(a for a in anchors[1:] if _terms_apart(a[0], target) <= reach)]
    return _median_estimate(target, near, target_is_candidate, KERNEL_ERROR_SD_LOG2)


def _median_estimate(
    target: StaticFeatures,
    measured: Sequence[tuple[StaticFeatures, float]],
    target_is_candidate: bool,
    sd_one: float,
    same_family: bool = False,
) -> Anchored:
    """The median of the measured kernels' estimates of the target's log2 runtime (each one's runtime less the
    prior's shift from it to the target, taken in the pair's direction), each estimate's error `sd_one`."""
    estimates = [
        t - prior_shift(f, target, same_family=same_family).mean_log2
        if target_is_candidate
        else t + prior_shift(target, f, same_family=same_family).mean_log2
        for f, t in measured
    ]
    n = len(estimates)
    # Up to two estimates the median is their mean; beyond, it costs a normal sample's pi/2 in variance.
    spread = 1.0 / n if n <= 2 else (math.pi / 2.0) / n
    return Anchored(statistics.median(estimates), sd_one * math.sqrt(1.0 + spread), n)


# A kernel's configurations (its tuning family: the same source, other defines) share whatever its design gets
# right or wrong that the static features miss, the error anchoring leaves in (KERNEL_ERROR_SD_LOG2). Once
# some of them are measured, an unmeasured one is estimated from them, and what is left is how far one
# configuration lies from another: the sd of log2 runtime within a tuning space, 0.75 (the median over the 23
# Kernel Tuner spaces of benchmarks/tune_local.py: 0.12 to 2.0, most 0.5 to 0.9). How far that can be is not
# learnt from 1-3 configurations: a space 64 times wide looks narrow through two alike ones. Of the pairs such
# estimates were 95% sure of, 15-18% were wrong on the held-out recordings with a normal spread of 0.6-1.2, and
# 10-14% with heavier tails or each family's own spread learnt from its few (a Cauchy spread went down to 6%,
# but has no mean for measure_next to value). So they are never more than SIBLING_MAX_CONFIDENCE sure:
# the spread widens to keep the forecast there, and they inform p_faster and measure_next but do not decide a
# verdict alone. Simulated (benchmarks/young_family.py: 1-3 random configurations of a space measured, another
# forecast against a third), chosen on the TUNE recordings by log loss (0.5966; 0.5981 at 0.6 and 0.85, 0.5975
# at 0.75 and 0.9): on the held-out ones accuracy 0.70, ECE 0.042, Brier 0.205, log loss 0.599.
CONFIG_SD_LOG2 = 0.75
SIBLING_MAX_CONFIDENCE = 0.85
_SIBLING_Z = statistics.NormalDist().inv_cdf(SIBLING_MAX_CONFIDENCE)


def sibling_spread(mean_log2: float, sd_log2: float) -> float:
    """The spread of a forecast from a young family's configurations (`sibling_log2_ms`) with mean `mean_log2`:
    `sd_log2`, widened so that it is at most SIBLING_MAX_CONFIDENCE sure of the direction."""
    return max(sd_log2, abs(mean_log2) / _SIBLING_Z)


def sibling_log2_ms(
    target: StaticFeatures, siblings: Sequence[tuple[StaticFeatures, float]], target_is_candidate: bool
) -> Anchored:
    """Log2 runtime (ms) of an unmeasured kernel and its sd from measured configurations of its own tuning
    family, each given as (features, log2 ms): the median of their estimates (each sibling's runtime less the
    same-family prior's shift to the target, in the pair's direction) with CONFIG_SD_LOG2 per configuration."""
    if not siblings:
        raise ValueError("sibling_log2_ms needs at least one measured configuration")
    return _median_estimate(target, siblings, target_is_candidate, CONFIG_SD_LOG2, same_family=True)


def _terms_apart(a: StaticFeatures, b: StaticFeatures) -> int:
    """How many of FITTED_TERMS tell the two kernels apart."""
    return sum(value != 0.0 for value in fitted_values(a, b))
