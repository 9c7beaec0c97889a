"""The launch a kernel's own host code gives it: for forecasting a kernel sent without `launch`.

An agent often sends a whole .cu file (a `main`, or a PyTorch extension's wrapper), or a Python module whose CUDA
string holds the kernel and the C++ wrapper launching it (torch's load_inline, KernelBench's form; read as that
CUDA, `_embedded`; a CuPy or PyCUDA one launches it from Python, as a Triton module its `@triton.jit` kernel, read
by python_launch), and no `launch`: forecasting does not need one (DESIGN.md), but without it the static prior
knows neither the block size (occupancy, waves) nor how many threads share the work (its `work_per_thread` term).
On the corpus of benchmarks/corpus_lopo.py (leave one problem out) the pairs sent without launches give accuracy
0.804, ECE 0.103 and 25.2% decided, against 0.822, 0.075 and 30.9% with them; sent without launches but with host
code launching each kernel (`--host-launch`), the figures with them. When the source launches `entry` itself, with
`entry<<<grid, block[, shared[, stream]]>>>` or `hipLaunchKernelGGL(entry, grid, block, shared, stream, ...)`, and
a dimension evaluates to a whole number from what the source and the workload say, that dimension is used:

- literals, object-like `#define`s (after the kernel's own defines and `-D` flags pick the `#if` branches),
  integer variables given one value (`const int threads = 256;`, `int blocks = (n + 255) / 256;`), `dim3`
  variables (`dim3 block(16, 16);`), `min` / `max` and the usual ceiling divisions (`cdiv`, `ceil_div`,
  `CEIL_DIV`, `DIV_UP`, `div_up`), casts. A name is the declaration C++'s scope gives it where it is written
  (`_Scopes`): another function's, block's or namespace's `BLOCK` is not this one's, and one a template, a
  lambda, a range-for or a structured binding declares is not read;
- the workload's `problem` sizes and scalar `args` by name (exact, else the one name equal ignoring case), and a
  buffer argument's `x.numel()` and `x.size(i)` from its shape (a wrapper's tensor parameters stand for the
  workload's input buffers in order where it takes exactly those and names none of them: `_tensor_aliases`);
- a launching function's parameter default that every call of it leaves out (`launch(x, y, n)` of `void
  launch(..., int threads = 256)`), and an integer parameter every call passes as one constant (`launch(x, y,
  n, 256)` from `main` or a load_inline wrapper; a literal, an expression of them, a `#define`, a name every
  declaration of which is `const` or `constexpr` and initialised; the default counting for a call leaving it out),
  where its callers are all in the text's host code (`_defaults`): not one exported (bound to Python by name,
  `extern "C"`), named otherwise (`&launch`, `m.def`), calling itself, variadic, or with another overload declared.
  A constant passed for a size the workload names is a test size: the workload's stands. Any other parameter is
  its callers', which only the workload says (a caller's own parameter passed on, `launch(x, y, n, block)`, too).

A name assigned two different values, or changed in place (`+=`, `++`, `grid.x = ...`, `grid.x += 1`), its address
taken (`&block_size`: set at run time) or read from `std::cin`, a value known only at run time (a device query, an
unnamed size), a ternary, or two launches of the entry that disagree leave that part unknown: a block without a
grid still gives occupancy. Nothing is run; the expression evaluator (`_value`) computes as C++ does, in each
value's integer type: a name's declared one (`int n`, `size_t total`, `uint16_t b`, `idx_t n` of `using idx_t =
int;`, a parameter's), a literal's (`1 << 31` an int, `1u`, `1LL`), a cast's, `x.numel()`'s int64_t, the usual
conversions between them (`short` promoted to int). A value stored in or cast to a type not read (`float`, `char`,
`bool`, `T`) is unknown. A value past a signed type's range (an `int n = x.numel()` of 3e9 elements, `M * N` of two
ints at 65536) is unknown, as C++ leaves it undefined; unsigned types wrap, as C++ defines.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import itertools
import json
import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from forecaster_mcp.forecast import features
from forecaster_mcp.models import (
    MAX_BLOCK_XY,
    MAX_BLOCK_Z,
    MAX_GRID_X,
    MAX_GRID_YZ,
    MAX_SHARED_MEM_BYTES,
    MAX_THREADS_PER_BLOCK,
    BufferArg,
    Kernel,
    ScalarArg,
    Workload,
)

Dim3 = tuple[int, int, int]
_T = TypeVar("_T")


@dataclass(frozen=True)
class SourceLaunch:
    """What the source's launches of the entry agree on; None where they do not say (or disagree)."""

    grid: Dim3 | None
    block: Dim3 | None
    shared_mem_bytes: int | None
    # A Triton program's warps (`num_warps`): its threads are these times the GPU's warp size (64 on AMD), the
    # block above them at NVIDIA's 32. None for a CUDA launch, which says its threads.
    warps: int | None = None

    def describe(self) -> str:
        parts = []
        if self.grid is not None:
            parts.append(f"grid {list(self.grid)}")
        if self.warps is not None:
            parts.append(f"num_warps {self.warps}")  # as Triton says it: a block of threads is no Triton term
        elif self.block is not None:
            parts.append(f"block {list(self.block)}")
        return ", ".join(parts)


# Launch sites: `entry<<<`, `entry<T, 4><<<` (template arguments one level deep), and HIP's macro.
_TEMPLATE_ARGS = r"(?:\s*<(?:[^<>;]|<[^<>;]{0,200}>){0,400}>)?"
_HIP_LAUNCH = (
    r"\bhipLaunchKernelGGL\s*\(\s*(?:HIP_KERNEL_NAME\s*\(\s*)?(?:\(\s*void\s*\*\s*\)\s*)?&?\s*{entry}\b"
)
# Sources past this many launch sites of the entry, or config expressions past this many characters, are not
# read: an agent's source may be anything, up to 1 MB.
MAX_SITES = 32
MAX_EXPR_CHARS = 400
MAX_DEPTH = 8  # names defined by names, this deep

# Of one name: an assignment (a declaration's initialiser too; its value is read up to the `;` or a comma outside
# brackets), a change in place, a declaration initialised in parentheses or braces (`dim3 grid(...)`, `int n{...}`).
# Not a member: `o->threads = 1024` or `cfg.threads = 1024` sets no variable `threads`.
# The name first, its look behinds after it: a scan looks for its letters, not at every character (`_named`).
_ASSIGN = r"{name}(?<![\w.]{name})(?<!->{name})\s*=(?!=)"
# Changed in place, a dim3's member too (`grid.x += 1`, `block.x /= 2`, `grid.x++`); its address passed or kept
# (`cudaOccupancyMaxPotentialBlockSize(&min_grid, &block_size, ...)`, `scanf("%d", &n)`: set at run time); read
# from `std::cin`.
# Its first alternative starts at the name; the next two read back from it, to the `++` or `--` before it, or to
# the `(`, `,` or `=` before its `&`; the last starts at a `cin` (`_Occurrences.changed`).
_CHANGED_AT = r"{name}(?<![\w.]{name})(?<!->{name})\s*(?:\.\s*[xyz]\s*(?:(?:[-+*/%&|^]|<<|>>)?=(?!=)|\+\+|--)|(?:[-+*/%&|^]|<<|>>)=|\+\+|--)"
_CHANGED_AFTER = r"(?:\+\+|--)\s*{name}\b|[(,=]\s*&\s*{name}\b(?!\s*[.\[])"
_CIN_CHAIN = r"\s*>>(?:\s*[\w.]+\s*>>){{0,4}}\s*{name}\b"
_CHANGED = rf"{_CHANGED_AT}|{_CHANGED_AFTER}|\bcin{_CIN_CHAIN}"
# The last alternative alone, its `\b` after the `cin` (the same matches): a scan looks for the letters `cin`.
_CIN = rf"cin(?<!\wcin){_CIN_CHAIN}"
_DIM3_DECL = r"\bdim3\s+{name}\s*([({{])"
# The words a declaration not read begins with (`int n(4);`, `const n{4};`).
_DECL_WORDS = (
    "int",
    "long",
    "unsigned",
    "signed",
    "short",
    "size_t",
    "auto",
    "int32_t",
    "int64_t",
    "uint32_t",
    "uint64_t",
    "const",
    "constexpr",
)
_OTHER_DECL = rf"\b(?:{'|'.join(_DECL_WORDS)})\s+{{name}}\s*[({{{{]"
MAX_ASSIGNMENTS = 64  # of one name: past them, it is not worth reading
MAX_CONSTANT_NAMED = (
    4096  # places a name passed as a constant stands (`_Names.constant`): past them, not read
)
_ASSIGNED = re.compile(r"\s*=(?!=)")
_WORD_BEFORE = re.compile(r"(?<!\w)\w+$")
_CONST_WORD = frozenset({"const", "constexpr"})
MAX_NAMES = 64  # names looked up per source
_DIM3_EXPR = re.compile(r"dim3\s*[({](.*)[)}]|\{(.*)\}", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_]\w*")
# A tensor made with another's shape: `torch::empty_like(x)` (zeros, ones, rand, randn, full too; `at::` or none),
# options after the tensor allowed, or `x.clone()`.
_LIKE = re.compile(
    r"(?:(?:torch|at)\s*::\s*)?(?:empty|zeros|ones|rand|randn|full)_like\s*\(\s*([A-Za-z_]\w*)\s*(?:,[^;]*)?\)"
    r"|([A-Za-z_]\w*)\s*\.\s*clone\s*\(\s*\)"
)
_NUMEL = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\.|->)\s*numel\s*\(\s*\)")
_SIZE = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\.|->)\s*size\s*\(\s*(-?\d+)\s*\)")
_CAST = re.compile(
    r"\(\s*((?:const\s+)?(?:unsigned|signed|int|long|short|size_t|int64_t|int32_t|uint64_t|uint32_t|unsigned\s+int|"
    r"long\s+long|unsigned\s+long(?:\s+long)?|(?:unsigned\s+)?short(?:\s+int)?|u?int(?:8|16)_t))\s*\)"
)
_CPP_CAST = re.compile(r"\b(?:static_cast|reinterpret_cast)\s*<([^<>()]{1,60})>\s*\(")
_NAMESPACE = re.compile(r"\b(?:std|cuda|at|c10|torch)\s*::\s*")
_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)([uUlLzZ]*)\b")
# A C-style cast's operand: a name or number, a call or parenthesised expression after it.
_OPERAND = re.compile(r"\s*(?:[A-Za-z_]\w*|(?:0[xX][0-9a-fA-F]+|\d+)[uUlLzZ]*)?\s*(\()?")

# The integer types launch arithmetic is done in, as (bits, signed). C++'s `int` is 32 bits: `int n =
# x.numel()` of 3e9 elements, `M * N` of two ints at 65536, `1 << 31` are past its range, which is undefined
# (or, converting, wraps negative): no wrap is emulated, the value is unknown. Unsigned types wrap, as C++
# defines. `long` is 64 bits (LP64: Linux, where the GPUs are).
_Kind = tuple[int, bool]
_INT: _Kind = (32, True)
_UINT: _Kind = (32, False)
_LONG: _Kind = (64, True)
_ULONG: _Kind = (64, False)
# A type the evaluator does not read (`float`, `char`, `bool`, `T`, an alias it cannot resolve): a value stored or
# passed in it is unknown, not its value's type.
_NOT_READ: _Kind = (0, True)
_KINDS: dict[str, _Kind] = {
    **dict.fromkeys(("int", "signed", "signed int", "int32_t"), _INT),
    **dict.fromkeys(("unsigned", "unsigned int", "uint32_t", "uint"), _UINT),
    **dict.fromkeys(
        ("long", "long int", "long long", "long long int", "int64_t", "ssize_t", "ptrdiff_t", "intptr_t"),
        _LONG,
    ),
    **dict.fromkeys(
        ("unsigned long", "unsigned long long", "unsigned long int", "uint64_t", "size_t", "uintptr_t"),
        _ULONG,
    ),
    # Narrower ones, promoted to int in arithmetic (`_promoted`); not `char`, whose sign is the platform's, nor
    # `bool`, which a conversion makes 0 or 1. A dim3 is made of unsigned ints.
    **dict.fromkeys(("signed char", "int8_t"), (8, True)),
    **dict.fromkeys(("unsigned char", "uint8_t"), (8, False)),
    **dict.fromkeys(("short", "short int", "signed short", "signed short int", "int16_t"), (16, True)),
    **dict.fromkeys(("unsigned short", "unsigned short int", "uint16_t"), (16, False)),
    "dim3": _UINT,
}
# Words before a name that make no declaration of it (`return n = 5;`, `else n = 5;`).
_NOT_TYPES = frozenset(
    {
        "return",
        "else",
        "do",
        "case",
        "goto",
        "throw",
        "co_return",
        "co_yield",
        "new",
        "delete",
        "and",
        "or",
        "not",
    }
)
_QUALIFIERS = re.compile(r"\b(?:const|constexpr|static|volatile|register|inline)\b|\bstd\s*::")
# The evaluator's names for a conversion to each type (casts, suffixed literals, a tensor's int64_t sizes).
_AS = {
    "__as_int": _INT,
    "__as_uint": _UINT,
    "__as_long": _LONG,
    "__as_ulong": _ULONG,
    "__as_int8": (8, True),
    "__as_uint8": (8, False),
    "__as_int16": (16, True),
    "__as_uint16": (16, False),
}
_AS_NAME = {kind: name for name, kind in _AS.items()}
# The types a declaration may name before a variable (`const int n = ...;`), read back from its name.
# Any words (`const idx_t`, `unsigned short`, `float`), namespaces among them, a reference's `&` after them.
_DECLARED_TYPE = re.compile(r"(?<![\w:])(?:[A-Za-z_]\w*\s*::\s*|[A-Za-z_]\w*\s+)*[A-Za-z_]\w*\s*&{0,2}\s*$")
# The source's integer type aliases: `using idx_t = int;`, `typedef unsigned int u32;`.
_ALIAS = re.compile(
    r"\busing\s+([A-Za-z_]\w*)\s*=\s*([\w:\s]{1,80});|\btypedef\s+([\w:\s]{1,80}?)\s+([A-Za-z_]\w*)\s*;"
)
MAX_ALIASES = 256  # read per source: past them, no alias is read
_SIZEOF = re.compile(r"\bsizeof\s*\(\s*([A-Za-z_][\w:]*(?:\s+[A-Za-z_]\w*)*)\s*\)")
_SIZES_OF = {
    **dict.fromkeys(("char", "signed char", "unsigned char", "int8_t", "uint8_t", "bool"), 1),
    **dict.fromkeys(("short", "unsigned short", "int16_t", "uint16_t", "half", "__half", "__nv_bfloat16"), 2),
    **dict.fromkeys(
        ("int", "unsigned", "unsigned int", "float", "int32_t", "uint32_t", "half2", "__half2"), 4
    ),
    **dict.fromkeys(("double", "long long", "unsigned long long", "int64_t", "uint64_t", "size_t"), 8),
    **dict.fromkeys(("float2", "int2", "uint2"), 8),
    **dict.fromkeys(("float4", "int4", "uint4", "double2"), 16),
}
_FLOAT = re.compile(r"\d\.\d*|\.\d|\d[eE][+-]?\d")
_CEIL_DIV = frozenset(
    {"cdiv", "ceil_div", "ceildiv", "CEIL_DIV", "CEILDIV", "DIV_UP", "div_up", "DIVUP", "divup"}
)
_FUNCS = frozenset({"min", "max", "MIN", "MAX", "umin", "umax", *_CEIL_DIV})
_UNKNOWN = object()


def _kind_of(type_text: str) -> _Kind | None:
    """The integer type a type names (`const int`, `std::size_t`, `const int&`); None for any other (`auto`,
    `float`, `T`)."""
    return _KINDS.get(" ".join(_QUALIFIERS.sub(" ", type_text.replace("&", " ")).split()))


def _type_kind(type_text: str, aliases: Mapping[str, _Kind]) -> _Kind | None:
    """The type a declaration or parameter names, the source's aliases read (`idx_t` of `using idx_t = int;`):
    None for `auto` (or none named: its value's type); _NOT_READ for one not read (`float`, `char`, `T`)."""
    kind = _kind_of(type_text)
    if kind is not None:
        return kind
    words = _NAME.findall(_QUALIFIERS.sub(" ", type_text))
    if not words or words == ["auto"]:
        return None
    return aliases.get(words[0], _NOT_READ) if len(words) == 1 else _NOT_READ


def _aliases(text: str) -> dict[str, _Kind]:
    """The source's integer type aliases (`_ALIAS`), each of one type; one aliased twice over is not read."""
    if "using" not in text and "typedef" not in text:
        return {}
    out: dict[str, _Kind] = {}
    for m in itertools.islice(_ALIAS.finditer(text), MAX_ALIASES):
        name, aliased = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
        kind = _type_kind(aliased, out)
        if kind is None or out.setdefault(name, kind) != kind:
            out[name] = _NOT_READ
    return out


def _as(value: int, kind: _Kind) -> int:
    """`value` converted to `kind`: an unsigned type wraps it; a signed type it does not fit is ArithmeticError,
    as is a type not read (_NOT_READ)."""
    bits, signed = kind
    if bits == 0:
        raise ArithmeticError("a type not read")
    if not signed:
        return value % (1 << bits)
    if not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        raise ArithmeticError("past the type's range")
    return value


def _promoted(kind: _Kind) -> _Kind:
    """C++'s integer promotion: a type narrower than int (`short`, `uint16_t`) is computed in int."""
    return _INT if kind[0] < 32 else kind


def _common(a: _Kind, b: _Kind) -> _Kind:
    """The type C++'s usual arithmetic conversions give two operands: promoted, the wider, else the unsigned."""
    a, b = _promoted(a), _promoted(b)
    if a[0] != b[0]:
        return a if a[0] > b[0] else b
    return a if not a[1] else b


def _literal(m: re.Match[str]) -> str:
    """A suffixed or hexadecimal literal as the evaluator's conversion to its type (`1u` is an unsigned int, `1ll`
    a long long, `0xFFFFFFFF` an unsigned int: the first of its candidate types holding it); a plain decimal one
    is left as written (an int, else a long: `_value`)."""
    digits, suffix = m.group(1), m.group(2).lower()
    hexadecimal = digits[:2].lower() == "0x"
    if not suffix and not hexadecimal:
        return m.group(0)
    if not hexadecimal and digits != "0" and digits.startswith("0"):
        return "__unknown__"  # octal
    value = int(digits, 16 if hexadecimal else 10)
    kinds = [_INT, _UINT, _LONG, _ULONG]
    if "u" in suffix:
        kinds = [k for k in kinds if not k[1]]
    elif not hexadecimal:
        kinds = [k for k in kinds if k[1]]
    if "l" in suffix or "z" in suffix:
        kinds = [k for k in kinds if k[0] == 64]
    kind = next((k for k in kinds if value < 1 << (k[0] - k[1])), None)
    return f"{_AS_NAME[kind]}({value})" if kind is not None else "__unknown__"


def _typed_casts(text: str) -> str | None:
    """`text` with its C-style integer casts as the evaluator's conversions: `(size_t)M * N` is
    `__as_ulong(M) * N`; a cast of a type not read is unknown. None where an operand is not read."""
    for _ in range(MAX_EXPR_CHARS):
        last = next(reversed(list(_CAST.finditer(text))), None)  # the innermost first: `(int)(long)x`
        if last is None:
            return text
        operand = _OPERAND.match(text, last.end())
        if operand is None:
            return None
        end = operand.end()
        if operand.group(1) is not None:  # `(int)(n + 1)`, `(int)min(a, b)`
            close = _closing(
                text, end, len(text)
            )  # a few hundred characters: MAX_EXPR_CHARS, each cast named
            if close is None:
                return None
            end = close + 1
        if not text[last.end() : end].strip():
            return None  # `(int)-n`: not read
        kind = _kind_of(last.group(1))
        called = _AS_NAME[kind] if kind is not None else "__unknown__"
        text = f"{text[: last.start()]} {called}({text[last.end() : end]}){text[end:]}"
    return None


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated parts of `text` (parentheses, braces and brackets nest), stripped."""
    return [p.strip() for p in features.split_top_level(text)]


_PARENS = re.compile(r"[()]")


def _closing(text: str, start: int, limit: int = 4000) -> int | None:
    """Index of the `)` closing the `(` just before `start`, within `limit` characters."""
    depth = 1
    for m in _PARENS.finditer(text, start, min(len(text), start + limit)):
        depth += 1 if m.group(0) == "(" else -1
        if depth == 0:
            return m.start()
    return None


def _may_launch(kernel: Kernel) -> bool:
    """Whether the source could launch a kernel at all: CUDA or HIP (a Python launcher passes its sizes at run
    time) with a `<<<` or `hipLaunchKernelGGL` in it."""
    return kernel.language in ("cuda", "hip") and (
        "<<<" in kernel.source or "hipLaunchKernelGGL" in kernel.source
    )


def _embedded(kernel: Kernel) -> tuple[ast.Module, Kernel, bool] | None:
    """A Python source parsed, and the CUDA its entry reaches (features.embedded_cuda) as a kernel of its own: its
    entry the kernel that CUDA runs; and whether the source edits that text in ways not read (`EmbeddedCuda.edited`).
    None for another language, or a Python source with no such CUDA."""
    if kernel.language not in features.PYTHON_LANGUAGES:
        return None
    module = features.python_module(kernel.source)
    embedded = features.embedded_cuda_in(module, kernel.entry) if module is not None else None
    if module is None or embedded is None or embedded.entry is None:
        return None
    cuda = kernel.model_copy(update={"source": embedded.text, "entry": embedded.entry, "language": "cuda"})
    return module, cuda, embedded.edited


def launches_itself(kernel: Kernel) -> bool:
    """Whether the source (comments aside) launches `kernel.entry` itself, read or not; for a Python source,
    whether the C++ in its strings (torch's load_inline wrapper) or its Python (CuPy, PyCUDA) launches the kernel
    that source runs, or, holding no CUDA, whether it launches its Triton kernel `entry` (`entry[grid](...)`), or the one the wrapper
    `entry` launches."""
    if kernel.language in features.PYTHON_LANGUAGES:
        found = _embedded(kernel)
        if found is None:
            from forecaster_mcp.forecast.python_launch import triton_launches

            module = _triton_module(kernel)
            return module is not None and triton_launches(module, kernel.entry)
        module, kernel, _ = found
        from forecaster_mcp.forecast.python_launch import python_launches

        if python_launches(module, kernel.entry):
            return True
    if not _may_launch(kernel):
        return False
    sites = _launch_sites(features.strip_comments(kernel.source), kernel.entry)
    return sites is None or bool(sites)  # None: more sites than MAX_SITES, so some


def _launch_sites(text: str, entry: str) -> list[tuple[int, list[str]]] | None:
    """Each launch of `entry`: where it is, and its configuration's parts (grid, block[, shared[, stream]]).
    None: too many."""
    # Every match counts toward MAX_SITES, read or not: each costs a scan of thousands of characters, and 1 MB
    # of `hipLaunchKernelGGL(k,((((` (no call ever closing) took 8 s when only the read ones counted.
    sites: list[tuple[int, list[str]]] = []
    chevrons = re.compile(rf"(?<![\w.]){re.escape(entry)}{_TEMPLATE_ARGS}\s*<<<")
    hip = re.compile(_HIP_LAUNCH.format(entry=re.escape(entry)))
    for i, m in enumerate(itertools.chain(chevrons.finditer(text), hip.finditer(text))):
        if i >= MAX_SITES:
            return None
        if m.re is chevrons:
            end = text.find(">>>", m.end(), m.end() + 4 * MAX_EXPR_CHARS)
            if end >= 0:
                sites.append((m.start(), _split_args(text[m.end() : end])))
            continue
        opened = text.find("(", m.start())
        close = _closing(text, opened + 1)
        if close is None:
            continue
        args = _split_args(text[opened + 1 : close])
        if args[0].count("<") != args[0].count(">"):
            # `hipLaunchKernelGGL(k<float, 4>, grid, block, ...)`: split at the template's comma, the grid
            # would be read as the block. Such a site is read as unknown.
            sites.append((m.start(), ["?", "?", "?"]))
        elif len(args) >= 5:
            sites.append((m.start(), args[1:4]))
    return sites


# How far back the statement of a name in a comma list is looked for (`int a = f(1, 2), n = x.numel();`).
_STATEMENT_CHARS = 400
# A comma list's first declarator, its type before it (`const int a = 0`, `unsigned long* p`, `int m(4)`), and
# a later one (`*q`, `b = f(1, 2)`). A type with template arguments (`std::pair<int, int> p`) is not matched.
_FIRST_DECLARATOR = re.compile(
    r"\s*(?P<type>[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*|\s+[A-Za-z_]\w*)*?)(?!\w)[\s*&]+[A-Za-z_]\w*\s*(?:[=({\[].*)?",
    re.DOTALL,
)
_LATER_DECLARATOR = re.compile(r"[\s*&]*[A-Za-z_]\w*\s*(?:[=({\[].*)?", re.DOTALL)
_TEMPLATED_FIRST = re.compile(r"\s*[A-Za-z_][\w:\s]*<(?!<)")


def _in_statement(text: str, at: int) -> bool:
    """Whether text[at] is outside any parentheses or brackets of its statement (after the last `;`, `{` or `}`
    within _STATEMENT_CHARS): `int m, n;`, not `f(x, n, m)` nor a parameter list."""
    low = max(0, at - _STATEMENT_CHARS)
    start = max(text.rfind(";", low, at), text.rfind("{", low, at), text.rfind("}", low, at))
    if start < 0 and low > 0:
        return False
    if (
        start >= 0
        and text[start] == "{"
        and text[max(0, start - 40) : start].rstrip()[-1:] in ("(", "=", ",", "{", "[")
    ):
        return False  # a list in braces: `torch::empty({M, N, K}, ...)`, `shape = {M, N}`
    piece = text[start + 1 : at]
    return all(piece.count(a) == piece.count(b) for a, b in (("(", ")"), ("[", "]"), ("<<<", ">>>")))


def _statement_start(text: str, at: int) -> int | None:
    """Where the statement holding text[at] starts: after the `;`, `{`, `}` before it, or the `(` or `[` it is
    in (`for (int i = 0, n = ...`); None past _STATEMENT_CHARS."""
    depth = 0
    for i in range(at - 1, max(-1, at - 1 - _STATEMENT_CHARS), -1):
        ch = text[i]
        if ch in ")]":
            depth += 1
        elif ch in "([":
            if depth == 0:
                return i + 1
            depth -= 1
        elif depth == 0 and ch in ";{}":
            return i + 1
    return 0 if at <= _STATEMENT_CHARS else None


def _listed_kind(text: str, at: int, aliases: Mapping[str, _Kind]) -> tuple[bool, _Kind | None]:
    """Whether the name at text[at] is a later one of a comma list (`int a = 0, n = x.numel();`), and then the
    type its statement declares it: the first declarator's (`int* p = 0, n`: int), None where the statement
    declares nothing (`a = 0, n = 1;`, `return a, n;`) or names `auto`, _NOT_READ where that cannot be read
    (a pointer `*n`, a template's type, a statement not read)."""
    listed, _, kind = _listed(text, at, aliases)
    return listed, kind


def _listed(text: str, at: int, aliases: Mapping[str, _Kind]) -> tuple[bool, bool, _Kind | None]:
    """`_listed_kind`, and whether the statement declares the name (an `auto` one too: `auto a = 0, n = 1;`)."""
    gap = at
    while gap > 0 and at - gap < 40 and text[gap - 1] in " \t\r\n*&":
        gap -= 1
    if gap == 0 or text[gap - 1] != ",":
        return False, False, None
    start = _statement_start(text, gap - 1)
    if start is None:
        return True, True, _NOT_READ
    parts = features.split_top_level(text[start : gap - 1])
    first = _FIRST_DECLARATOR.fullmatch(parts[0])
    if first is None:
        # A type with template arguments (`std::pair<int, int> p = {}, n`), or one in braces before it (`int
        # a{1}, n`): a declaration not read. Anything else declares nothing (`a = 0, n = 1;`, `{M, N, K}`, `f(a,
        # n = 3)`).
        unread = not parts[0].strip() or _TEMPLATED_FIRST.match(parts[0]) is not None
        return True, unread, _NOT_READ if unread else None
    words = _NAME.findall(first.group("type"))
    if words[0] in _NOT_TYPES:
        return True, False, None  # `return a, n;`
    if "*" in text[gap:at] or any(_LATER_DECLARATOR.fullmatch(p) is None for p in parts[1:]):
        return True, True, _NOT_READ
    return True, True, _type_kind(first.group("type"), aliases)


_WORD = re.compile(r"\w+")


def _spaces_before(text: str, at: int) -> int:
    r"""Where the run of whitespace before text[at] starts (`at` where there is none). str.rstrip's whitespace is
    the regex `\s` (both Py_UNICODE_ISSPACE); a long run is read in growing pieces."""
    if at == 0 or not text[at - 1].isspace():
        return at
    size = 64
    while True:
        low = max(0, at - size)
        kept = text[low:at].rstrip()
        if kept or low == 0:
            return low + len(kept)
        size *= 4


def _scan(pattern: re.Pattern[str], text: str, starts: list[int] | None) -> Iterator[re.Match[str]]:
    """`pattern.finditer(text)`, tried only at `starts` (ascending): the same matches where every match of the
    pattern starts at one of them and none is empty (a match at one start sees the whole text, before it too, as
    the scan does). None: the scan itself."""
    if starts is None:
        yield from pattern.finditer(text)
        return
    end = 0
    for start in starts:
        if start >= end:
            m = pattern.match(text, start)
            if m is not None:
                yield m
                end = m.end()


class _Occurrences:
    r"""Where a name stands in the text after whitespace, `&`, `++`, `--` or `>>`, and where the whitespace before
    each starts: where a pattern of a name that starts before it (_CHANGED_AFTER, `_CIN`, _DIM3_DECL, _OTHER_DECL)
    may have it. Each puts `\s` or one of those right before the name, no word character after it (`\b`, `\s`
    or a bracket), and a name of word characters alone stands nowhere else in a match; each starts at a fixed word
    or operator before the name's whitespace (a `cin` chain's, any number of words before), so it is tried there
    alone. Scanned for at every character (no letters to look for), each took 30-60 ms a MB for each of up to
    MAX_NAMES names: 32 launchers reading 60 names, 0.9 MB, took 5.9 s. A name standing so more than once in 32
    characters, each tried in Python, is scanned for as before."""

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        self.spaces: list[int] | None = None  # None: scanned for as before
        if _WORD.fullmatch(name):
            quoted = re.escape(name)
            found = re.finditer(
                rf"{quoted}(?:(?<=[\s&]{quoted})|(?<=\+\+{quoted})|(?<=--{quoted})|(?<=>>{quoted}))(?!\w)",
                text,
            )
            most = max(MAX_ASSIGNMENTS, len(text) // 32)
            standing = list(itertools.islice(found, most + 1))
            if len(standing) <= most:
                self.spaces = [_spaces_before(text, m.start()) for m in standing]

    def after(self, words: tuple[str, ...]) -> list[int] | None:
        """Where one of `words` ends right before the name's whitespace: where a pattern starting with it may
        match, in order. None: anywhere."""
        if self.spaces is None:
            return None
        text = self.text
        return sorted(
            {
                spaces - len(w)
                for spaces in self.spaces
                for w in words
                if spaces >= len(w) and text.startswith(w, spaces - len(w))
            }
        )

    def changed(self) -> bool:
        """Whether `_CHANGED` matches the text: the name changed in place, its address taken, read from cin."""
        text = self.text
        quoted = re.escape(self.name)
        if self.spaces is None:
            return re.search(_CHANGED.format(name=quoted), text) is not None
        if re.search(_CHANGED_AT.format(name=quoted), text) is not None:
            return True
        starts = self.after(("++", "--")) or []
        for spaces in self.spaces:
            if spaces >= 1 and text[spaces - 1] == "&":
                before = _spaces_before(text, spaces - 1)
                if before >= 1:
                    starts.append(before - 1)
        after = re.compile(_CHANGED_AFTER.format(name=quoted))
        if any(after.match(text, at) for at in starts):
            return True
        chained = any(spaces >= 2 and text.startswith(">>", spaces - 2) for spaces in self.spaces)
        return chained and re.search(_CIN.format(name=quoted), text) is not None


def _set_in(text: str, name: str) -> bool:
    """Whether `text` assigns `name`, changes it (`_CHANGED`) or declares it (_DIM3_DECL, _OTHER_DECL): one of
    those patterns matches it anywhere."""
    quoted = re.escape(name)
    if re.search(_ASSIGN.format(name=quoted), text) is not None:
        return True
    occurrences = _Occurrences(text, name)
    if occurrences.changed():
        return True
    dim3 = re.compile(_DIM3_DECL.format(name=quoted))
    other = re.compile(_OTHER_DECL.format(name=quoted))
    return (
        next(_scan(dim3, text, occurrences.after(("dim3",))), None) is not None
        or next(_scan(other, text, occurrences.after(_DECL_WORDS)), None) is not None
    )


# What a declaration of a name is, for the scope it is visible in (`_Scopes`): a variable, a parameter of a function
# or lambda (visible in its body), a template's parameter (its instantiation's: not read), or one whose value cannot
# be read (a range-for's, a structured binding's, a `catch`'s, two kinds of declaration at one scope).
_Entity = tuple[int, int, str]  # (visible from, up to, what)
_NOWHERE: _Entity = (
    -1,
    -1,
    "nowhere",
)  # no declaration of the name is visible here: a header's, or undeclared
_UNREAD: _Entity = (-1, -1, "unread")  # which declaration a name is here is not known
_SKIPPED: _Entity = (-1, -1, "skipped")  # a prototype's parameter: visible nowhere
_OWN_PARAM: _Entity = (-1, -1, "own-param")  # a parameter of the function a launch (or call) is in (`_Names`)
_STATEMENT_WORD = re.compile(r"\b(for|while|if|switch|catch)\s*$")
_BINDING = re.compile(r"\bauto\s*&{0,2}\s*\[[\w\s,]*$")
_TEMPLATE_HEAD = re.compile(r"template(?<!\wtemplate)\s*<[^;{}()<>]*$")
_BODY_OR_END = re.compile(r"[{;]")
_NOT_DECLARING = _NOT_TYPES | {"sizeof", "alignof", "co_await"}
_ELSE = re.compile(r"\s*else\b")
_SPACES = re.compile(r"\s*")
_NAMESPACE_HEAD = re.compile(r"\b(inline\s+)?namespace\b\s*([\w:]*)\s*$")
_EXTERN_HEAD = re.compile(r'\bextern\s*"[^"]*"\s*$')
_CLASS_HEAD = re.compile(r"\b(?:struct|class|union)\b")
_QUALIFIED_NAME = re.compile(r"::\s*~?\s*\w+\s*$")
_USING_NAMESPACE = re.compile(r"\busing\s+namespace\s+([\w:]+)")
MAX_HEADS = 64  # namespaces and classes around a function: past them, its names may be any's
MAX_DECLARATIONS = 256  # of one name: past them, it is not read


class _Nesting:
    """Where one kind of bracket pairs nest in text[start:end], read once: the innermost pair holding a position,
    found by bisection (walking up from the last one opened is quadratic in a crafted source's depth). One never
    closed holds the rest of the text."""

    def __init__(self, probe: str, brackets: str, start: int = 0, end: int | None = None) -> None:
        self.end = len(probe) if end is None else end
        self.closers: dict[int, int] = {}  # open -> just past its close
        self.marks: list[int] = []  # each bracket read
        self.tops: list[int] = []  # the innermost open after each (-1: none)
        opener = brackets[0]
        stack: list[int] = [-1]
        for at in [
            m.start() for m in re.compile(f"[{re.escape(brackets)}]").finditer(probe, start, self.end)
        ]:
            if probe[at] == opener:
                stack.append(at)
            elif len(stack) > 1:
                self.closers[stack.pop()] = at + 1
            else:
                continue  # a close with no open: none of these
            self.marks.append(at)
            self.tops.append(stack[-1])

    def around(self, at: int) -> tuple[int, int] | None:
        """The innermost pair holding text[at] (not a bracket itself): its open's index and just past its close."""
        i = bisect.bisect_left(self.marks, at) - 1
        opened = self.tops[i] if i >= 0 else -1
        return (opened, self.closers.get(opened, self.end)) if opened >= 0 else None


class _Scopes:
    """C++ scope, read from the braces of the text (literals and comments blanked): which declaration of a name a
    use of it at a place means. A local of one function is no other function's; one declared in a function is
    visible from its declaration to the end of its block, shadowing any outer one; a parameter in its function's
    (or lambda's) body; one at namespace or class scope in all its block (the file's: everywhere). A `const int
    BLOCK = 128;` in `launch_a` is not the `BLOCK` of `launch_b`, nor of `namespace y`, nor a template's or a
    range-for's `BLOCK` there, and a for's, if's or catch's own name ends with its statement. Where a namespace's
    or class's declaration may reach past its braces (a function defined as `S::f`, a class's body for a base's,
    the namespace reopened, a `using` of it), a name that would otherwise be the global (or none) is not known; an
    anonymous namespace's and an `extern "C"` block's are the scope's around. A declaration is read as the words
    before a name (`int n`, `const idx_t& n`, `T
    n`, a comma list's later name); one not seen so (`std::vector<int> n`) is not read as shadowing. The brackets
    are read where a declaration needs them, each host function's apart and the rest once with those blanked: a
    source of 80,000 small functions is not read bracket by bracket for a name declared in two."""

    def __init__(self, probe: str, spans: list[tuple[int, int, str | None]], starts: list[int]) -> None:
        self.probe = probe
        self.spans = spans
        self.starts = starts
        self._inside: dict[int, tuple[_Nesting, _Nesting]] = {}  # of each host function, by its start
        self._outside: tuple[_Nesting, _Nesting] | None = None
        # Of each name: its entities, and the entity of each declaration by where its name stands; None: not read.
        self._declared: dict[str, tuple[list[_Entity], dict[int, _Entity]] | None] = {}
        # Of each name: its namespaces' and classes' entities, each with its kind and the namespace's name (`_head`).
        self._members: dict[str, list[tuple[_Entity, str, str]]] = {}
        self._heads: dict[int, tuple[str, str]] = {}  # `_head`, by the brace
        self._contexts: dict[int, tuple[bool, list[tuple[str, str]]]] = {}  # `_context`, by where it is read
        self._usings: dict[str, bool] = {}  # `_reaches`: a using-declaration of the name, by name
        self._using_spaces: list[frozenset[str]] | None = None  # the namespaces `using namespace` names

    def _nestings(self, at: int) -> tuple[_Nesting, _Nesting, bool]:
        """The braces and parentheses around `at`, and whether it is in a host function."""
        span = _span_at(self.spans, self.starts, at)
        if span is not None:
            if span[0] not in self._inside:
                self._inside[span[0]] = (
                    _Nesting(self.probe, "{}", span[0], span[1]),
                    _Nesting(self.probe, "()", span[0], span[1]),
                )
            return (*self._inside[span[0]], True)
        return (*self._outer(), False)

    def _outer(self) -> tuple[_Nesting, _Nesting]:
        """The braces and parentheses outside the host functions (theirs blanked)."""
        if self._outside is None:
            pieces, last = [], 0
            for a, b, _ in self.spans:
                pieces += [self.probe[last:a], " " * (b - a)]
                last = b
            outside = "".join([*pieces, self.probe[last:]])
            self._outside = (_Nesting(outside, "{}"), _Nesting(outside, "()"))
        return self._outside

    def _head(self, brace: int) -> tuple[str, str]:
        """What the braces opened at `brace` are the body of: ("namespace", its name), ("class", "") for a struct,
        class or union, ("open", "") where their names are the enclosing scope's (an anonymous or inline
        namespace, `extern "C" { ... }`), else ("other", "") (a function's, a block's, an initialiser's)."""
        if brace not in self._heads:
            probe = self.probe
            low = max(0, brace - _STATEMENT_CHARS)
            start = max(
                probe.rfind(";", low, brace), probe.rfind("{", low, brace), probe.rfind("}", low, brace)
            )
            segment = probe[max(start + 1, low) : brace]
            found = ("other", "")
            space = _NAMESPACE_HEAD.search(segment)
            if space is not None:
                name = space.group(2) or ""
                found = ("open", "") if space.group(1) or not name else ("namespace", name)
            elif _EXTERN_HEAD.search(segment) is not None:
                found = ("open", "")
            elif _CLASS_HEAD.search(segment) is not None and "=" not in segment and "(" not in segment:
                found = ("class", "")
            self._heads[brace] = found
        return self._heads[brace]

    def _context(self, at: int) -> tuple[bool, list[tuple[str, str]]]:
        """Of a name used at `at`: whether its function is defined by a qualified name (`void S::f()`, where a
        class's or namespace's names are visible), and the namespace and class bodies around it, innermost first
        (past MAX_HEADS of them: read as qualified)."""
        span = _span_at(self.spans, self.starts, at)
        where = span[0] if span is not None else at
        if where not in self._contexts:
            qualified = False
            if span is not None:
                paren = self.probe.find("(", span[0], span[1])
                qualified = paren >= 0 and _QUALIFIED_NAME.search(self.probe, span[0], paren) is not None
            braces = self._outer()[0]
            heads: list[tuple[str, str]] = []
            block = braces.around(where)
            while block is not None and not qualified:
                if len(heads) >= MAX_HEADS:
                    qualified = True
                heads.append(self._head(block[0]))
                block = braces.around(block[0])
            self._contexts[where] = (qualified, heads)
        return self._contexts[where]

    def _reaches(self, name: str, at: int, kind: str, space: str) -> bool:
        """Whether a name a class's (`kind` "class") or namespace `space`'s braces declare may be the one used at
        `at`, outside them: from a function defined by a qualified name, a class's body (a base's member), the
        same namespace reopened, or through a `using` of it or of its namespace."""
        if name not in self._usings:
            using = rf"\busing\s+(?:typename\s+)?[\w:<>\s]{{0,200}}::\s*{re.escape(name)}\s*;"
            self._usings[name] = re.search(using, self.probe) is not None
        qualified, heads = self._context(at)
        if self._usings[name] or qualified:
            return True
        if kind == "class":
            return any(k == "class" for k, _ in heads)
        parts = frozenset(space.split("::")) - {""}
        if self._using_spaces is None:
            self._using_spaces = [
                frozenset(m.group(1).split("::")) for m in _USING_NAMESPACE.finditer(self.probe)
            ]
        return any(k == "namespace" and parts & set(n.split("::")) for k, n in heads) or any(
            parts & used for used in self._using_spaces
        )

    def _body(self, at: int) -> _Entity | None:
        """The braces a parameter list or template head before `at` opens (a function's or lambda's body): the
        scope its parameters have; _SKIPPED where a `;` comes first (a declaration's); None where neither is."""
        body = _BODY_OR_END.search(self.probe, at, at + 4 * _STATEMENT_CHARS)
        if body is None:
            return None
        if body.group(0) == ";":
            return _SKIPPED
        closers = self._nestings(body.start())[0].closers
        return (body.start(), closers.get(body.start(), len(self.probe)), "")

    def _statement_end(self, braces: _Nesting, start: int, limit: int) -> int | None:
        """Just past the statement from `start` (a for's, while's, if's or catch's body): its braces, else up to a
        `;` with nothing bracketed on the way; None where that is not seen before `limit`."""
        probe = self.probe
        body = _SPACES.match(probe, start, limit).end()  # type: ignore[union-attr]
        if body < limit and probe[body] == "{":
            return braces.closers.get(body)
        semi = probe.find(";", body, min(limit, body + 4 * _STATEMENT_CHARS))
        if (
            semi < 0
            or "{" in probe[body:semi]
            or probe.count("(", body, semi) != probe.count(")", body, semi)
        ):
            return None
        return semi + 1

    def _declaration(self, name: str, at: int) -> _Entity | None:
        """The entity a declaration of `name` at `at` makes; None where `at` is no declaration's."""
        probe = self.probe
        gap = _spaces_before(probe, at)
        before = probe[gap - 1] if gap > 0 else ""
        binding = (
            before in ("[", ",") and _BINDING.search(probe, max(0, at - _STATEMENT_CHARS), at) is not None
        )
        if binding:
            pass  # `auto [n, m] = f();`
        elif before == ",":
            if not _listed(probe, at, {})[1]:
                return None
        else:
            # A word before it, a reference's `&` or two between (`const int& n`), as `_DECLARED_TYPE` reads a
            # type; not one that makes no declaration (`return n`, `case n`).
            end = gap
            while end > 0 and gap - end < 2 and probe[end - 1] == "&":
                end = _spaces_before(probe, end - 1)
            word = end
            while word > 0 and end - word < 40 and (probe[word - 1].isalnum() or probe[word - 1] == "_"):
                word -= 1
            if word == end or not _NAME.fullmatch(probe[word:end]) or probe[word:end] in _NOT_DECLARING:
                return None
        line = probe.rfind("\n", max(0, at - _STATEMENT_CHARS), at)
        if (line >= 0 or at <= _STATEMENT_CHARS) and probe[line + 1 : at].lstrip().startswith("#"):
            return None  # a preprocessor line's (`#define GRID n / 256`)
        head = probe.rfind("template", max(0, at - _STATEMENT_CHARS), at)
        if head >= 0 and _TEMPLATE_HEAD.match(probe, head, at) is not None:
            body = self._body(at)
            return _UNREAD if body is None else body if body == _SKIPPED else (*body[:2], "template")
        braces, parens, in_host = self._nestings(at)
        block = braces.around(at)
        paren = parens.around(at)
        if paren is not None and (block is None or paren[0] > block[0]):
            statement = _STATEMENT_WORD.search(probe, max(0, paren[0] - 16), paren[0])
            if statement is None:  # a function's or lambda's parameter
                body = self._body(paren[1])
                return _UNREAD if body is None else body if body == _SKIPPED else (*body[:2], "param")
            # `for (int i = 0; ...)`, `for (int b : sizes)`, `catch (int e)`: to the end of its statement (an
            # `if`'s through its `else`), else of the block around
            ranged = re.match(rf"{re.escape(name)}\s*:(?!:)", probe[at : at + len(name) + 40]) is not None
            what = "unread" if binding or ranged or statement.group(1) == "catch" else "var"
            if in_host and block is not None:
                stop = self._statement_end(braces, paren[1], block[1])
                otherwise = _ELSE.match(probe, stop) if stop is not None else None
                if otherwise is not None and statement.group(1) == "if":
                    stop = self._statement_end(braces, otherwise.end(), block[1])
                if stop is not None:
                    return (at, stop, what)
            what = "unread"  # its statement's end not seen: not read to the end of the block
        else:
            what = "unread" if binding else "var"
        if block is None:
            if in_host:
                return _UNREAD  # in a host function's header, outside its parameters: not read
            return (-1, len(probe), what)  # the file's
        if in_host:
            return (at, block[1], what)  # a function's local from where it stands
        while block is not None and self._head(block[0])[0] == "open":
            block = braces.around(block[0])  # `namespace { ... }`, `extern "C" { ... }`: the scope around
        return (*block, what) if block is not None else (-1, len(probe), what)

    def declared(self, name: str) -> tuple[list[_Entity], dict[int, _Entity]] | None:
        """The entities `name` is declared as, and the one of each declaration by where its name stands; None
        where it cannot be read (named or declared too often, a declaration whose scope is not found)."""
        if name not in self._declared:
            self._declared[name] = self._read(name)
        return self._declared[name]

    def _read(self, name: str) -> tuple[list[_Entity], dict[int, _Entity]] | None:
        probe = self.probe
        by_scope: dict[tuple[int, int], str] = {}
        at_of: dict[int, _Entity] = {}
        members = self._members.setdefault(name, [])
        # Where a declaration may stand: after whitespace, a `&`, a comma or a `[`, not after `return ` or `case `
        # (uses by the thousand are passed over without a step in Python).
        quoted = re.escape(name)
        may = re.compile(rf"{quoted}(?<=[\s&,\[]{quoted})(?<!return {quoted})(?<!case {quoted})\b")
        for i, m in enumerate(may.finditer(probe)):
            if i >= MAX_CONSTANT_NAMED or len(at_of) > MAX_DECLARATIONS:
                return None
            at = m.start()
            entity = self._declaration(name, at)
            if entity is None:
                continue
            if entity == _UNREAD:
                return None
            at_of[at] = entity
            if entity[0] >= 0 and probe[entity[0]] == "{" and entity[2] in ("var", "unread"):
                kind, space = self._head(entity[0])
                if kind in ("namespace", "class"):
                    members.append((entity, kind, space))
            if entity != _SKIPPED:
                scope = entity[:2]
                # Two kinds of declaration at one scope (a parameter and a variable): not read.
                kept = by_scope.setdefault(scope, entity[2])
                if kept != entity[2]:
                    by_scope[scope] = "unread"
        entities = [(lo, hi, what) for (lo, hi), what in by_scope.items()]
        for at, entity in at_of.items():
            if entity != _SKIPPED:
                at_of[at] = (entity[0], entity[1], by_scope[entity[:2]])
        return entities, at_of

    def resolve(self, name: str, at: int) -> _Entity:
        """The entity `name` at `at` is: the innermost declaration visible there, _NOWHERE where none is, _UNREAD
        where that is not known."""
        declared = self.declared(name)
        if declared is None:
            return _UNREAD
        best: _Entity | None = None
        for entity in declared[0]:
            if entity[0] <= at < entity[1] and (best is None or entity[0] >= best[0]):
                if best is not None and entity[0] == best[0]:
                    return _UNREAD  # two at one place, neither inside the other
                best = entity
        # A namespace's or class's declaration reaches past its braces (`void S::f()`, a reopened namespace, a
        # base class, `using`): where one may, the name is not known to be the one around, or none.
        members = self._members.get(name)
        if members and (best is None or best[0] < 0 or any(best[:2] == m[0][:2] for m in members)):
            for (lo, hi, _), kind, space in members:
                if not lo <= at < hi and self._reaches(name, at, kind, space):
                    return _UNREAD
        return best if best is not None else _NOWHERE

    def site(self, name: str, at: int) -> _Entity:
        """The entity a definition of `name` whose name stands at `at` sets: its own declaration's, else the one
        visible there (an assignment `n = 5;`)."""
        declared = self.declared(name)
        if declared is None:
            return _UNREAD
        return declared[1].get(at) or self.resolve(name, at)


class _Lookups:
    """What the text says of each name (its assignments, its declared types), shared by the _Names of every
    launching function of one source: they depend on the text alone, and looked up afresh for each of 32
    launching functions reading 60 names, 0.9 MB took 350 s."""

    def __init__(self, scopes: _Scopes) -> None:
        self.scopes = scopes
        self.defs: dict[str, tuple[str, list[tuple[str, int]]] | None] = {}
        self.of_entity: dict[tuple[str, _Entity], tuple[str, dict[str, list[int]]] | None] = {}
        self.declared: dict[str, list[tuple[int, _Kind]] | None] = {}
        self.constant: dict[str, bool] = {}  # `_Names.constant`
        # The values of declarations whose definitions stand outside the function a _Names reads parameters of
        # (a global, another function's local): the same for every _Names of the source, of either kind.
        self.values: dict[tuple[str, _Entity, bool], tuple[int, _Kind] | None] = {}
        self.places: dict[
            tuple[str, _Entity], list[int]
        ] = {}  # where each entity's definitions stand, in order


class _WorkloadNames:
    """The workload's sizes (its `problem` sizes and integer scalar `args`) and buffer shapes, by name: exact, else
    the one name equal ignoring case. A lookup in the workload alone, whatever the source says of the name."""

    def __init__(self, workload: Workload | None) -> None:
        self.sizes: dict[str, int] = {}
        self.shapes: dict[str, list[int]] = {}
        if workload is not None:
            for key, value in workload.problem.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    self.sizes[key] = value
            for arg in workload.args:
                if isinstance(arg, ScalarArg) and isinstance(arg.value, int):
                    self.sizes.setdefault(arg.name, arg.value)
                elif isinstance(arg, BufferArg):
                    self.shapes[arg.name] = list(arg.shape)

    def size(self, name: str) -> int | None:
        found = _by_name(self.sizes, name)
        return found if isinstance(found, int) else None

    def shape(self, name: str) -> list[int] | None:
        found = _by_name(self.shapes, name)
        return found if isinstance(found, list) else None


def _by_name(table: Mapping[str, object], name: str) -> object:
    if name in table:
        return table[name]
    folded = [v for k, v in table.items() if k.lower() == name.lower()]
    return folded[0] if len(folded) == 1 else _UNKNOWN


class _Names:
    """What the source and the workload say a name's value is (each name looked up once, when first read)."""

    def __init__(
        self,
        text: str,
        macros: Mapping[str, str],
        workload: Workload | None,
        given: Collection[str] = (),
        params: Collection[str] = (),
        aliases: Mapping[str, str] | None = None,
        defaults: Mapping[str, str] | None = None,
        kinds: Mapping[str, _Kind] | None = None,
        types: Mapping[str, _Kind] | None = None,
        *,
        lookups: _Lookups,
        span: tuple[int, int] | None = None,
        changed: Collection[str] = (),
        constants_only: bool = False,
    ) -> None:
        self.text = text
        self.macros = macros
        self.given = frozenset(given)  # the kernel's own defines and -D flags: what it is compiled with
        # The parameters of the host function the launch is in: their values are its callers' (`launch(512)`),
        # whatever the source assigns a variable of that name elsewhere; only the workload can say.
        self.params = frozenset(params)
        # The function they are the parameters of (where it starts and ends), and its body's `{`: they are what
        # their names mean in it, where no declaration inside it shadows them.
        self.span = span
        # Those the function sets itself before or after the launch (`n /= 2;`, `if (n > 1024) n = 1024;`): which
        # value the launch sees is not known here.
        self.changed = frozenset(changed)
        self.aliases = dict(
            aliases or {}
        )  # a wrapper's tensor parameter -> the workload buffer it stands for
        # A parameter's default that every caller leaves out (`_defaults`): its value, as the source's is.
        self.defaults = dict(defaults or {})
        self.kinds = dict(kinds or {})  # a parameter's integer type, where it has one (`int n`)
        self.types = dict(types or {})  # the source's integer type aliases (`using idx_t = int;`: `_aliases`)
        self._lookups = lookups  # of `text`: shared by one source's _Names
        self.scopes = self._lookups.scopes
        self.body = self.scopes.probe.find("{", span[0], span[1]) if span is not None else -1
        self._memo: dict[tuple[str, _Entity | int], tuple[int, _Kind] | None] = {}
        self.workload = _WorkloadNames(workload)
        # A caller's argument is read as a constant of the source alone (`_Constants`): a variable it names is
        # read only where every declaration of it is `const` or `constexpr` (`constant`).
        self.constants_only = constants_only

    def entity(self, name: str, at: int) -> _Entity:
        """What `name` at `at` is (`_Scopes.resolve`): _OWN_PARAM for a parameter of the function of `params` in
        it, where no declaration inside its body shadows it."""
        entity = self.scopes.resolve(name, at)
        if (
            name in self.params
            and self.span is not None
            and self.span[0] <= at < self.span[1]
            and entity != _UNREAD
            and entity[0] <= self.body
        ):
            return _OWN_PARAM
        return entity

    def definitions(self, name: str, entity: _Entity) -> tuple[str, dict[str, list[int]]] | None:
        """("value", the expressions the entity `name` is there is assigned, each with where its name stands) or
        ("dim3", a dim3 declaration's arguments); ("value", empty) when the source never sets it (a parameter of a
        function, a template's: their callers'); None when the source sets `name` in a way that cannot be read (in
        place anywhere, more than MAX_ASSIGNMENTS times, an initialiser in braces, past MAX_NAMES names), or which
        declaration it is is not known."""
        if entity == _UNREAD or entity[2] == "unread":
            return None
        key = (name, entity)
        if key not in self._lookups.of_entity:
            self._lookups.of_entity[key] = self._of_entity(name, entity)
        return self._lookups.of_entity[key]

    def _of_entity(self, name: str, entity: _Entity) -> tuple[str, dict[str, list[int]]] | None:
        defs = self._lookups.defs
        if name not in defs:
            defs[name] = self._definitions(name) if len(defs) < MAX_NAMES else None
        found = defs[name]
        if found is None:
            return None
        kind, sites = found
        out: dict[str, list[int]] = {}
        if entity[2] in ("param", "template", "own-param"):
            return kind, out  # set by its callers (a default is theirs to leave out)
        for expr, at in sites:
            site = self.scopes.site(name, at)
            if site == _UNREAD:
                return None
            if site == entity:
                out.setdefault(expr, []).append(at)
        return kind, out

    def _definitions(self, name: str) -> tuple[str, list[tuple[str, int]]] | None:
        quoted = re.escape(name)
        text = self.text
        occurrences = _Occurrences(text, name)
        if occurrences.changed():
            return None
        exprs: list[tuple[str, int]] = []
        for i, m in enumerate(re.finditer(_ASSIGN.format(name=quoted), text)):
            stop = text.find(";", m.end(), m.end() + MAX_EXPR_CHARS)
            value = text[m.end() : stop] if stop >= 0 else "{"
            if i >= MAX_ASSIGNMENTS or "{" in value or "}" in value:
                return None
            # Up to a comma outside brackets: `int m = x.size(0), n = x.size(1);` gives m x.size(0).
            exprs.append((" ".join(features.split_top_level(value)[0].split()), m.start()))
        dim3 = re.compile(_DIM3_DECL.format(name=quoted))
        declared = list(
            itertools.islice(_scan(dim3, text, occurrences.after(("dim3",))), MAX_ASSIGNMENTS + 1)
        )
        if not declared:
            other = re.compile(_OTHER_DECL.format(name=quoted))
            unread = next(_scan(other, text, occurrences.after(_DECL_WORDS)), None)
            return None if unread is not None else ("value", exprs)
        if exprs or len(declared) > MAX_ASSIGNMENTS:
            return None
        args: list[tuple[str, int]] = []
        for m in declared:
            if m.group(1) == "(":
                close = _closing(text, m.end(), MAX_EXPR_CHARS)
            else:
                found = text.find("}", m.end(), m.end() + MAX_EXPR_CHARS)
                close = found if found >= 0 else None
            if close is None:
                return None
            named = text.find(name, m.start() + 4, m.end())  # where its name stands
            args.append((" ".join(text[m.end() : close].split()), named))
        return ("dim3", args)

    def workload_size(self, name: str) -> int | None:
        """The workload's size of that name (`_WorkloadNames.size`), or None."""
        return self.workload.size(name)

    def shape(self, name: str, depth: int, at: int) -> list[int] | None:
        """The shape of the buffer `name` stands for: the workload's of that name (or of the input a wrapper's
        tensor parameter stands for, `aliases`), unless the source makes its own tensor of that name. One made
        like another (`auto y = torch::empty_like(x)`, `x.clone()`) has that one's shape; one made otherwise
        (`auto out = torch::empty({16})`) is not the workload's `out`, and is not read."""
        entity = self.entity(name, at)
        if entity != _OWN_PARAM and depth <= MAX_DEPTH:
            defs = self.definitions(name, entity)
            if defs is None or defs[0] == "dim3" or len(defs[1]) > 1:
                return None
            if entity[2] in ("param", "template"):
                return None  # another function's (a lambda's) tensor: its caller's
            if defs[1]:
                made, places = next(iter(defs[1].items()))
                like = _LIKE.fullmatch(made)
                if like is None:
                    return None
                shapes = [self.shape(like.group(1) or like.group(2), depth + 1, a) for a in places]
                return _agreed(shapes)
        elif entity != _OWN_PARAM:
            return None
        return self.workload.shape(self.aliases.get(name, name))

    def value(self, name: str, depth: int, at: int) -> tuple[int, _Kind] | None:
        """The one whole number `name` at `at` stands for, with its integer type, or None (each name worked out
        once a declaration: `a = b + b + b` over eight levels of names must not cost 3^8 evaluations). A macro's
        names are the place's it is used at."""
        entity = self.entity(name, at) if name not in self.macros else at
        memo: dict[tuple[str, _Entity | int], tuple[int, _Kind] | None] = self._memo
        key: tuple[str, _Entity | int] = (name, entity)
        if isinstance(entity, tuple) and self._shared(name, entity):
            memo, key = self._lookups.values, (name, entity, self.constants_only)  # type: ignore[assignment]
        if key not in memo:
            try:
                memo[key] = self._value(name, depth, at, entity)
            except ArithmeticError:
                memo[key] = None  # past its type's range
        return memo[key]

    def _shared(self, name: str, entity: _Entity) -> bool:
        """Whether the value of `entity` is every _Names' of the source: a variable no definition of which stands
        in the function whose parameters this one reads."""
        if entity[2] != "var" and entity != _NOWHERE:
            return False
        defs = self.definitions(name, entity)
        span = self.span
        if defs is None or span is None:
            return False
        places = self._lookups.places
        if (name, entity) not in places:
            places[name, entity] = sorted(a for found in defs[1].values() for a in found)
        found = places[name, entity]
        i = bisect.bisect_left(found, span[0])
        return i == len(found) or found[i] >= span[1]

    def meanings(self, expr: str, at: int) -> tuple[_Entity, ...]:
        """What each name of `expr` means where it stands at `at` (`entity`), its names in order: an expression
        whose names mean the same is read once."""
        return tuple(self.entity(n, at) for n in sorted(set(_NAME.findall(expr))))

    def _typed_at(self, expr: str, places: list[int], depth: int) -> tuple[int, _Kind] | None:
        """`expr`'s value where it stands at each of `places`, where they agree (its names may mean others there):
        read once for each meaning of its names."""
        found: dict[tuple[_Entity, ...], tuple[int, _Kind] | None] = {}
        for at in places:
            meant = self.meanings(expr, at)
            if meant not in found:
                found[meant] = _typed(expr, self, depth, at)
        return _agreed(list(found.values()))

    def _value(self, name: str, depth: int, at: int, entity: _Entity | int) -> tuple[int, _Kind] | None:
        if depth > MAX_DEPTH:
            return None
        if isinstance(entity, int):
            macro = self.macros[name]
            found = _typed(macro, self, depth, at) if macro != "" else None
            return found if name in self.given else self._agreeing(name, found)
        if entity == _OWN_PARAM:
            if name in self.changed:
                return None
            # Its declared type's (`int n`: a workload's 3e9 is past it), else 64 bits.
            kind = self.kinds.get(name)
            default = self.defaults.get(name)
            # A default's names are the function's declaration's, at its start.
            start = self.span[0] if self.span is not None else 0
            found = _typed(default, self, depth, start) if default is not None else None
            if found is not None:
                return self._agreeing(name, (_as(found[0], kind), kind) if kind is not None else found)
            size = self.workload_size(name)
            return (_as(size, kind or _LONG), kind or _LONG) if size is not None else None
        defs = self.definitions(name, entity)
        if defs is None or defs[0] == "dim3" or len(defs[1]) > 1:
            return None  # set in a way that cannot be read, twice over, or a dim3 where a number is read
        if defs[1]:
            if self.constants_only and not self.constant(name):
                return None  # not const or constexpr wherever declared: a caller's argument reads constants alone
            found = self._typed_at(*next(iter(defs[1].items())), depth)
            declared = self.declared(name, entity)
            if found is None or declared is None:
                return None
            # Stored in its declared type (`int n = x.numel();`), each if declared several ways; an `auto` or
            # undeclared one keeps its value's.
            value = found[0]
            for kind in declared:
                _as(value, kind)
            return self._agreeing(name, (_as(value, declared[0]), declared[0]) if declared else found)
        # Set where it cannot be read (`int n; get_size(x, n);`, or never): the workload's size, in its declared
        # type (an int cannot hold 3e9).
        size = self.workload_size(name)
        declared = self.declared(name, entity) if size is not None else None
        if size is None or declared is None:
            return None
        for kind in declared:
            _as(size, kind)
        return (_as(size, declared[0]), declared[0]) if declared else (size, _LONG)

    def constant(self, name: str) -> bool:
        """Whether `name` is a constant wherever the text names it: each declaration of it `const` or `constexpr`
        and initialised with `=` (`constexpr int kBlock = 256;`, `const int threads = 256;` in a function), and
        nothing else declaring it (a parameter `int threads`, a loop's `for (int threads : ...)`, an `int
        threads;`, a later name of a comma list), whose value a caller's argument may be instead."""
        memo = self._lookups.constant
        if name not in memo:
            memo[name] = self._constant(name)
        return memo[name]

    def _constant(self, name: str) -> bool:
        text = self.text
        standing = list(itertools.islice(re.finditer(rf"{_named(name)}\b", text), MAX_CONSTANT_NAMED + 1))
        if len(standing) > MAX_CONSTANT_NAMED:
            return False  # named too often to read
        declared = False
        for m in standing:
            if m.start() >= 2 and text.startswith("->", m.start() - 2):
                continue  # a member of that name (`_named` leaves out `.threads`)
            assigned = _ASSIGNED.match(text, m.end()) is not None
            gap = _spaces_before(text, m.start())
            word = _WORD_BEFORE.search(text, max(0, gap - 40), gap) if not assigned else None
            if (
                not assigned
                and (word is None or word.group(0) in _NOT_TYPES)
                and not text.startswith("&", gap - 1)
            ):
                continue  # a use (`launch(x, kBlock)`, `return kBlock`): no type before it
            before = _DECLARED_TYPE.search(text, max(0, m.start() - 80), m.start())
            words = _NAME.findall(before.group(0)) if before is not None else []
            if not words or words[-1] in _NOT_TYPES:
                if assigned:
                    return False  # `threads = 256;`, `int a = 1, threads = 2;`: no const's declaration
                continue  # a use
            if not assigned or not _CONST_WORD.intersection(words):
                return False
            declared = True
        return declared

    def declared(self, name: str, entity: _Entity) -> list[_Kind] | None:
        """The integer types `name` is declared with (`const int n = ...;`, `unsigned n;`, `idx_t n` of `using
        idx_t = int;`, `int a = 1, n = 2;`: `_listed_kind`), in order; _NOT_READ for another type (`float n`, `T
        n`, an alias not read, a pointer in a list); `auto` says none. None past MAX_ASSIGNMENTS declarations."""
        if name not in self._lookups.declared:
            self._lookups.declared[name] = self._declared(name)
        found = self._lookups.declared[name]
        if found is None:
            return None
        kinds = []
        for at, kind in found:
            site = self.scopes.site(name, at)
            if site == _UNREAD:
                return None
            if site == entity:
                kinds.append(kind)
        return kinds

    def _declared(self, name: str) -> list[tuple[int, _Kind]] | None:
        kinds: list[tuple[int, _Kind]] = []
        quoted = re.escape(name)
        text = self.text
        read = 0
        for m in re.finditer(rf"{_named(name)}(?<!->{quoted})\s*(?:=(?!=)|;|(,))", text):
            if m.group(1) is not None and not _in_statement(text, m.start()):
                continue  # `f(x, n, m)`, `void g(int n, int m)`: an argument or a parameter, not declared here
            read += 1
            if read > MAX_ASSIGNMENTS:
                return None
            listed, kind = _listed_kind(text, m.start(), self.types)
            if not listed:
                before = _DECLARED_TYPE.search(text, max(0, m.start() - 80), m.start())
                type_text = before.group(0) if before is not None else ""
                words = _NAME.findall(type_text)
                kind = _type_kind(type_text, self.types) if words and words[-1] not in _NOT_TYPES else None
            if kind is not None:
                kinds.append((m.start(), kind))
        return kinds

    def _agreeing(self, name: str, found: tuple[int, _Kind] | None) -> tuple[int, _Kind] | None:
        """`found`, the source's value for `name`, unless the workload sizes that name otherwise: a `main`'s own
        test size (`const int n = 1 << 20;`) is not the size the kernel is forecast (and run) at."""
        size = self.workload_size(name)
        return None if size is not None and (found is None or size != found[0]) else found

    def dims(self, expr: str, depth: int, at: int) -> Dim3 | None:
        """A launch dimension written at `at`: `dim3(...)`, `{...}`, a dim3 variable, or a number (x; y and z
        are 1)."""
        text = expr.strip()
        if depth > MAX_DEPTH or len(text) > MAX_EXPR_CHARS:
            return None
        m = _DIM3_EXPR.fullmatch(text)
        if m is not None:
            inner = m.group(1) if m.group(1) is not None else m.group(2)
            return self._dims_of(_split_args(inner), depth, at)
        entity = self.entity(text, at) if _NAME.fullmatch(text) and text not in self.macros else None
        if entity == _OWN_PARAM:
            default = self.defaults.get(text)
            if default is not None and _DIM3_EXPR.fullmatch(default):
                start = self.span[0] if self.span is not None else 0
                return self.dims(default, depth + 1, start)  # `dim3 block = dim3(256)`
            if default is None and self.workload_size(text) is None:
                return None  # `void launch(dim3 grid, ...)`: the caller's
        elif entity is not None:
            defs = self.definitions(text, entity)
            if defs is None or len(defs[1]) > 1:
                return None
            if defs[1]:
                made, places = next(iter(defs[1].items()))
                if defs[0] == "dim3":
                    return _agreed([self._dims_of(_split_args(made), depth + 1, a) for a in places])
                if made.startswith(("dim3", "{")):
                    return _agreed([self.dims(made, depth + 1, a) for a in places])
            elif defs[0] == "dim3":
                return None
        x = _evaluate(text, self, depth + 1, at)
        return (x, 1, 1) if x is not None else None

    def _dims_of(self, parts: list[str], depth: int, at: int) -> Dim3 | None:
        if not 1 <= len(parts) <= 3 or any(not p for p in parts):
            return None
        values = [_evaluate(p, self, depth + 1, at) for p in parts]
        if any(v is None for v in values):
            return None
        full = [v for v in values if v is not None] + [1] * (3 - len(values))
        return (full[0], full[1], full[2])


def _evaluate(expr: str, names: _Names, depth: int, at: int) -> int | None:
    """The whole-number value of a host expression written at `at`, or None."""
    found = _typed(expr, names, depth, at)
    return found[0] if found is not None else None


def _typed(expr: str, names: _Names, depth: int, at: int) -> tuple[int, _Kind] | None:
    """The whole-number value of a host expression written at `at` (where its names are looked up) and its
    integer type, or None (past its type's range too)."""
    if depth > MAX_DEPTH or len(expr) > MAX_EXPR_CHARS or "?" in expr or _FLOAT.search(expr):
        return None

    def numel(m: re.Match[str]) -> str:
        shape = names.shape(m.group(1), 0, at)
        return f"__as_long({math.prod(shape)})" if shape is not None else "__unknown__"  # int64_t

    def size(m: re.Match[str]) -> str:
        shape = names.shape(m.group(1), 0, at)
        i = int(m.group(2))
        return (
            f"__as_long({shape[i]})" if shape is not None and -len(shape) <= i < len(shape) else "__unknown__"
        )

    def sizeof(m: re.Match[str]) -> str:
        found = _SIZES_OF.get(re.sub(r"\s+", " ", m.group(1)).removeprefix("std::"))
        return f"__as_ulong({found})" if found is not None else "__unknown__"  # a size_t

    def cast(m: re.Match[str]) -> str:
        kind = _type_kind(m.group(1), names.types)
        return f"{_AS_NAME[kind]}(" if kind is not None and kind != _NOT_READ else "__unknown__("

    text = _SIZEOF.sub(sizeof, expr)
    text = _NUMEL.sub(numel, text)
    text = _SIZE.sub(size, text)
    text = _CPP_CAST.sub(cast, text)
    cast_free = _typed_casts(text)
    if cast_free is None:
        return None
    text = _NAMESPACE.sub("", cast_free)
    text = _LITERAL.sub(_literal, text)
    if re.search(r"->|\.|\[|'|\"|&&|\|\||!(?!=)", text):
        return None  # members, subscripts, characters, logic: nothing a launch size needs
    text = text.replace("/", "//")
    tree = features.parse_c_expression(text)
    if tree is None:
        return None
    try:
        return _value(tree.body, names, depth, at)
    except (ArithmeticError, ValueError, TypeError, KeyError, RecursionError):
        return None


def _value(node: ast.AST, names: _Names, depth: int, at: int) -> tuple[int, _Kind]:
    """A node's value and type, computed as C++ does in that type (ArithmeticError past a signed one's range)."""
    if isinstance(node, ast.Name):
        found = names.value(node.id, depth + 1, at)
        if found is None:
            raise ValueError(f"{node.id} is not known")
        return found
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.keywords:
            raise ValueError("not a known function")
        name = node.func.id
        if name in _AS and len(node.args) == 1:  # a cast, a suffixed literal
            kind = _AS[name]
            return _as(_value(node.args[0], names, depth, at)[0], kind), kind
        if name not in _FUNCS or len(node.args) != 2:
            raise ValueError("not a known function")
        (a, ka), (b, kb) = (_value(arg, names, depth, at) for arg in node.args)
        kind = _common(ka, kb)
        a, b = _as(a, kind), _as(b, kind)
        if name in _CEIL_DIV:
            return _as(features._c_div(_as(a + b - 1, kind), b), kind), kind
        return (min(a, b) if name.lower().endswith("min") else max(a, b)), kind
    if isinstance(node, ast.BinOp):
        (a, ka), (b, kb) = _value(node.left, names, depth, at), _value(node.right, names, depth, at)
        op = features._BINARY.get(type(node.op))
        if op is None:
            raise TypeError("operator")
        if isinstance(node.op, ast.LShift | ast.RShift):
            # The left operand's type; a count past its width, or a negative one shifted left, is undefined.
            if not 0 <= b < ka[0] or (isinstance(node.op, ast.LShift) and a < 0 and ka[1]):
                raise ArithmeticError("shift out of range")
            ka = _promoted(ka)
            return _as(op(a, b), ka), ka
        kind = _common(ka, kb)
        return _as(op(_as(a, kind), _as(b, kind)), kind), kind
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner, kind = _value(node.operand, names, depth, at)
        kind = _promoted(kind)
        return (_as(-inner, kind) if isinstance(node.op, ast.USub) else inner), kind
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        # A decimal literal is an int, else a long (`_literal` reads the others); none is wider.
        if node.value >= 1 << 63:
            raise ArithmeticError("beyond 64 bits")
        return node.value, _INT if node.value < 1 << 31 else _LONG
    raise TypeError(f"unsupported {type(node).__name__}")


def _valid_block(b: Dim3 | None) -> Dim3 | None:
    if b is None or min(b) < 1 or b[0] > MAX_BLOCK_XY or b[1] > MAX_BLOCK_XY or b[2] > MAX_BLOCK_Z:
        return None
    return b if b[0] * b[1] * b[2] <= MAX_THREADS_PER_BLOCK else None


def _valid_grid(g: Dim3 | None) -> Dim3 | None:
    if g is None or min(g) < 1 or g[0] > MAX_GRID_X or g[1] > MAX_GRID_YZ or g[2] > MAX_GRID_YZ:
        return None
    return g


def _agreed(values: list[_T | None]) -> _T | None:
    """The value every launch site gave, or None (none read, or two that disagree)."""
    first = values[0] if values else None
    return first if first is not None and all(v == first for v in values) else None


# What the compiler's host pass defines itself (no `__CUDA_ARCH__`, `__HIP_DEVICE_COMPILE__`: host code); the
# toolkit's version is not known here ("?": its `#if`s count both ways, features.compile_macros' rule).
_COMPILER_HOST_MACROS = {
    "cuda": {
        "__CUDACC__": "1",
        "__NVCC__": "1",
        "__CUDACC_VER_MAJOR__": "?",
        "__CUDACC_VER_MINOR__": "?",
        "CUDART_VERSION": "?",
        "CUDA_VERSION": "?",
    },
    "hip": {"__HIPCC__": "1", "HIP_VERSION": "?", "HIP_VERSION_MAJOR": "?"},
}


def _host_macros(kernel: Kernel) -> dict[str, str]:
    """The macros of the host pass: the compiler's own, then the kernel's `-D` flags and defines."""
    macros = features.with_command_line(dict(_COMPILER_HOST_MACROS.get(kernel.language, {})), kernel)
    return {k: str(int(v) if isinstance(v, bool) else v) for k, v in macros.items()}


_DEFINE_LINE = re.compile(r"^\s*#\s*define\s+([A-Za-z_]\w*)(?![\w(])[ \t]*(.*)$", re.MULTILINE)


def source_launch(kernel: Kernel, workload: Workload | None) -> SourceLaunch | None:
    """The launch the source's host code gives `kernel.entry` (module doc); None when it launches it nowhere or
    says nothing usable. CUDA and HIP sources are read; a Python source's (`_python_launch`) by the C++ in its
    strings (torch's load_inline wrapper), else by its Python calls of the kernel (CuPy, PyCUDA, Triton)."""
    python = kernel.language in features.PYTHON_LANGUAGES
    if not python and "<<<" not in kernel.source and "hipLaunchKernelGGL" not in kernel.source:
        return None
    macros = _host_macros(kernel)
    workload_json = workload.model_dump_json() if workload is not None else ""
    digest = hashlib.sha256(
        json.dumps(
            [kernel.source, kernel.entry, kernel.language, sorted(macros.items()), workload_json]
        ).encode()
    ).digest()
    with _CACHE_LOCK:
        if digest in _CACHE:
            _CACHE.move_to_end(digest)
            return _CACHE[digest]
    found = None
    if python:
        found = _python_launch(kernel, workload)  # a Python source parsed once, not on every forecast
    elif _may_launch(kernel):
        found = _source_launch(kernel.source, kernel.entry, macros, workload)
    with _CACHE_LOCK:
        _CACHE[digest] = found
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return found


def _triton_module(kernel: Kernel) -> ast.Module | None:
    """A Python source parsed, where it may launch `kernel.entry` as a Triton kernel (`entry[grid](...)`), or
    `entry` may be a wrapper launching one (`def entry(` in a source naming triton): not every Python source is
    parsed (features.parsed_python: up to 64 KB, 0.1-0.3 s at most)."""
    entry = re.escape(kernel.entry)
    launched = re.search(rf"(?<![\w.]){entry}\s*\[", kernel.source) is not None
    wrapper = "triton" in kernel.source and re.search(rf"\bdef\s+{entry}\s*\(", kernel.source) is not None
    return features.parsed_python(kernel.source) if launched or wrapper else None


def _python_launch(kernel: Kernel, workload: Workload | None) -> SourceLaunch | None:
    """A Python source's launch of the kernel it runs: the one the C++ wrapper in its CUDA string gives it (torch's
    load_inline, KernelBench's form), else the one its Python calls give it (python_launch: CuPy, PyCUDA); for a
    source holding no CUDA, its Triton kernel's (`kernel[grid](...)`, python_launch.triton_launch)."""
    found = _embedded(kernel)
    if found is None:
        from forecaster_mcp.forecast.python_launch import triton_launch

        module = _triton_module(kernel)
        return triton_launch(module, kernel.entry, workload) if module is not None else None
    module, cuda, edited = found
    if _may_launch(cuda) and not edited:  # text edited as not read: its launch may be any
        # The names Python may bind C++ functions by (load_inline's `functions=["forward"]`): every string that
        # is one word.
        exported = {
            node.value
            for node in ast.walk(module)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value)
        }
        launch = _source_launch(cuda.source, cuda.entry, _host_macros(cuda), workload, exported)
        if launch is not None:
            return launch
    from forecaster_mcp.forecast.python_launch import python_launch

    return python_launch(module, cuda.entry, workload, kernel.entry)


# Results by a digest of what decides them (not the sources themselves: 1 MB each).
_CACHE: OrderedDict[bytes, SourceLaunch | None] = OrderedDict()
_CACHE_SIZE = 1024
_CACHE_LOCK = threading.Lock()


_FUNCTION_NAME = re.compile(r"(?<!\w)[A-Za-z_]\w*+\s*+(?:<[^<>;{}()]{0,200}>\s*+)?\(")


# The words of a parameter's type that leave it one tensor (`const at::Tensor&`, `c10::optional<torch::Tensor>`).
_TENSOR_TYPE_WORDS = frozenset({"Tensor", "torch", "at", "c10", "std", "const", "volatile", "optional"})


@dataclass(frozen=True)
class _Param:
    """A parameter of a host function: its name, whether it is a tensor (`torch::Tensor x`, `const at::Tensor&
    x`; None for another type naming tensors, `std::vector<torch::Tensor>`, `at::TensorList`: several of the
    caller's at once), its default's text (`int threads = 256`), if it has one, its integer type, if it is one
    (`int n`: a workload's 3e9 is past it), and the parameter as written (`const int n = 4`)."""

    name: str
    tensor: bool | None
    default: str | None
    kind: _Kind | None
    written: str


def _parameter_texts(text: str, probe: str, start: int, stop: int) -> list[str] | None:
    """The parameters of the function header at text[start:stop] (its first parameter list) as written; None where
    it has none. Its brackets and commas are read in `probe`, the text with its literals and comments blanked
    (features._blank_literals): a `{`, `)` or `,` in a string default (`const char* s = "{"`) is none of its."""
    header = probe[start:stop]
    # Tried only where a word starts, the word taken whole: at every letter, a 40 KB word before `(int t) {`
    # took 33 s.
    name = _FUNCTION_NAME.search(header)
    if name is None:
        return None
    close = _closing(header, name.end(), len(header))
    if close is None:
        return None
    out = []
    at = start + name.end()
    for part in features.split_top_level(header[name.end() : close], "(<[{", ")>]}"):
        out.append(text[at : at + len(part)].strip())  # the blanked text is the raw one's length: same places
        at += len(part) + 1
    return out


def _header_parameters(text: str, probe: str, start: int, end: int) -> list[str]:
    """The parameters `_parameters` reads of the function defined at text[start:end] as written: its header up to
    its body's `{`, found in `probe` (a `{` in a string default is no body)."""
    body = probe.find("{", start, end)
    return _named_parameters(_parameter_texts(text, probe, start, body) or []) if body >= 0 else []


def _default(param: str) -> str | None:
    """A parameter's default (`int threads = 256`: "256"), if it has one."""
    _, eq, value = param.partition("=")
    return " ".join(value.split()) or None if eq else None


def _parameters(
    text: str, probe: str, start: int, end: int, aliases: Mapping[str, _Kind]
) -> tuple[_Param, ...]:
    """The parameters of the function defined at text[start:end], in order; `probe`: the text with its literals
    and comments blanked (features._blank_literals); `aliases`: the source's integer type aliases (`_aliases`)."""
    out: list[_Param] = []
    for param in _header_parameters(text, probe, start, end):
        declared = param.split("=", 1)[0]
        words = _NAME.findall(declared)
        kind = words[:-1]
        tensor = "Tensor" in kind and _TENSOR_TYPE_WORDS.issuperset(kind)
        out.append(
            _Param(
                words[-1],
                tensor or (None if any("Tensor" in w for w in kind) else False),
                _default(param),
                _type_kind(declared.strip().removesuffix(words[-1]), aliases),
                param,
            )
        )
    return tuple(out)


def _tensor_aliases(params: tuple[_Param, ...], workload: Workload | None) -> dict[str, str]:
    """The workload's buffers a wrapper's tensor parameters stand for, by position, where their names are not
    the workload's: `torch::Tensor forward(torch::Tensor input)` sized by `input.numel()` beside a workload whose
    input is `x`. Only when the wrapper takes exactly the workload's input buffers (intent in or inout), as many
    and none of them by name (a KernelBench module passes its inputs in order), and no list of tensors beside
    them (`std::vector<torch::Tensor> xs`: which inputs it holds is not known); else none."""
    tensors = [p.name for p in params if p.tensor]
    if workload is None or not tensors or any(p.tensor is None for p in params):
        return {}
    inputs = [a.name for a in workload.args if isinstance(a, BufferArg) and a.intent in ("in", "inout")]
    buffers = {a.name.lower() for a in workload.args if isinstance(a, BufferArg)}
    if len(inputs) != len(tensors) or any(t.lower() in buffers for t in tensors):
        return {}
    return dict(zip(tensors, inputs, strict=True))


def _named(name: str) -> str:
    """A pattern of `name` where no word or `.` goes before it: the name first, the look behind after it, so that
    a scan of the text looks for the name's letters (a look behind first is tried at every character: 30 ms a MB,
    for each launching function)."""
    quoted = re.escape(name)
    return rf"{quoted}(?<![\w.]{quoted})"


# After a function's name where it is called: template arguments one level deep, then the `(`.
_CALL_TAIL = re.compile(r"\s*+(?:<[^<>;{}()]{0,200}>\s*+)?\(")


def _span_at(
    spans: list[tuple[int, int, str | None]], starts: list[int], at: int
) -> tuple[int, int, str | None] | None:
    """The host function whose span holds position `at`, or None. The spans are in order, none inside another
    (`starts`: theirs): found by bisection (walking them all for each call of 32 launching functions took 10 s
    after 80,000 small ones)."""
    i = bisect.bisect_right(starts, at) - 1
    return spans[i] if i >= 0 and at < spans[i][1] else None


def _called(
    probe: str, span: tuple[int, int, str | None], spans: list[tuple[int, int, str | None]], starts: list[int]
) -> bool:
    """Whether the host function at `span` is called from another host function of the text (a helper of the
    wrapper), or cannot be named; a declaration (`cpp_sources`' prototype), `&forward` or a docstring's
    `forward (CUDA)` is no call. `probe`: the text with its literals and comments blanked
    (features._blank_literals), so that `m.def("forward", &forward, "relu forward (CUDA)")` calls nothing.
    `starts`: the spans' starts (in order, none inside another)."""
    if span[2] is None:
        return True
    call = re.compile(_named(span[2]) + _CALL_TAIL.pattern)
    for m in call.finditer(probe):
        caller = _span_at(spans, starts, m.start())
        if caller is not None and caller[:2] != span[:2]:
            return True
    return False


# Words of a type that are no parameter's name (`void f(long long);` is unnamed, not a `long` named `long`).
_TYPE_WORDS = frozenset(
    {
        "int",
        "long",
        "short",
        "unsigned",
        "signed",
        "char",
        "float",
        "double",
        "bool",
        "void",
        "const",
        "volatile",
    }
)


def _named_parameters(texts: list[str]) -> list[str]:
    """The parameters `_parameters` reads of a parameter list as written (not `void`, nor an empty one)."""
    out = []
    for text in texts:
        words = _NAME.findall(text.split("=", 1)[0])
        if words and words[-1] != "void":
            out.append(text)
    return out


def _same_type(declared: str, defined: str) -> bool:
    """Whether a declaration's parameter (`const float*`, `int count = 4`) has the type of the definition's
    (`const float* x`), its name left out or another."""
    d = re.findall(r"[A-Za-z_]\w*|[*&]|::", declared.split("=", 1)[0])
    f = re.findall(r"[A-Za-z_]\w*|[*&]|::", defined.split("=", 1)[0])
    named = bool(d) and _NAME.fullmatch(d[-1]) is not None and d[-1] not in _TYPE_WORDS
    return d == f[:-1] or (named and len(d) >= 2 and d[:-1] == f[:-1])


class _Constants:
    """The value each call's argument is where it is a constant of the source: a literal, an expression of them,
    a `#define`, a `const` or `constexpr` name (`_Names.constant`), read as a launch's names are but without the
    workload; the calling function's own parameters are its callers', not known. Read once for each expression
    and set of the calling function's parameter names (callers by the thousand name the same few)."""

    def __init__(
        self,
        text: str,
        probe: str,
        macros: Mapping[str, str],
        given: Collection[str],
        aliases: Mapping[str, _Kind],
        lookups: _Lookups,
    ) -> None:
        self.text = text
        self.probe = probe
        self.macros = macros
        self.given = given
        self.aliases = aliases
        self.lookups = lookups
        self._names: dict[tuple[int, int, str | None] | None, _Names] = {}
        self._values: dict[tuple[str, tuple[_Entity, ...], _Kind], int | None] = {}

    def value(
        self, expr: str, caller: tuple[int, int, str | None] | None, kind: _Kind, at: int
    ) -> int | None:
        """`expr`'s value as a parameter of type `kind` takes it, where `expr` is a constant written at `at`; the
        parameters of `caller` (the host function making the call; None: none) its own."""
        if caller not in self._names:
            own: frozenset[str] = frozenset()
            if caller is not None:
                own = frozenset(
                    p.name for p in _parameters(self.text, self.probe, caller[0], caller[1], self.aliases)
                )
            self._names[caller] = _Names(
                self.text,
                self.macros,
                None,
                self.given,
                own,
                types=self.aliases,
                lookups=self.lookups,
                span=caller[:2] if caller is not None else None,
                constants_only=True,
            )
        names = self._names[caller]
        # What each of its names means there: the same expression of the same constants is read once.
        key = (expr, names.meanings(expr, at), kind)
        if key not in self._values:
            found = _typed(expr, names, 0, at)
            try:
                self._values[key] = _as(found[0], kind) if found is not None else None
            except ArithmeticError:
                self._values[key] = None  # past the parameter's type's range, or a type not read
        return self._values[key]


# An argument whose angle brackets do not balance (`Traits<int, 4>::n` cut at its comma, `a < b`): where the
# call's arguments stand is not known.
_ANGLES = re.compile(r"<<|>>|->|<=|>=|[<>]")


def _balanced(arg: str) -> bool:
    marks = [m.group(0) for m in _ANGLES.finditer(arg)]
    return marks.count("<") == marks.count(">")


def _defaults(
    text: str,
    probe: str,
    span: tuple[int, int, str | None],
    spans: list[tuple[int, int, str | None]],
    declarations: list[tuple[int, int, str | None]],
    params: tuple[_Param, ...],
    exported: Collection[str],
    starts: list[int],
    named: Mapping[str | None, int],
    constants: _Constants,
) -> tuple[dict[str, str], dict[str, str]]:
    """The values the calls of the host function at `span` give its parameters, by name: the defaults that every
    call leaves out (`launch(x, y, n)` of `launch(..., int threads = 256)`), its definition's default, else a
    declaration's (`void launch(const float*, float*, int, int threads = 256);`); and, of its integer parameters,
    the one constant every call passes or leaves to a default of that value (`launch(x, y, n, 256)`: `_Constants`),
    as an expression of it. Only where the function is called from the text's host functions and named nowhere
    else: one named otherwise (`m.def("launch", &launch)`, a pointer kept), or none calling it (its callers not
    sent), may be called with any argument; so may one Python binds by name (`exported`: load_inline's
    `functions=[...]`, an `extern "C"` one's ctypes), and Python passes every argument, pybind11 not knowing C++'s
    defaults. An overload's default is not it (one the function changes itself, `threads = 64;`, is left out by the
    caller, with the parameter's callers' values). No constant is read of a function calling itself, taking any
    number of arguments (`...`), declared with other parameter types beside it (another overload's calls are
    matched by name too), or called with more arguments than it takes or with ones whose places are not known.
    `probe`: the text with its literals and comments blanked (features._blank_literals); `starts`: the spans'
    starts, in order; `named`: how many of them have each name."""
    start, end, name = span
    given = [p.default for p in params]
    readable = [p.kind is not None and p.kind in _AS_NAME for p in params]
    if name is None or name in exported:
        return {}, {}
    declared = [d for d in declarations if d[2] == name]
    if len(declared) > MAX_ASSIGNMENTS:
        return {}, {}
    # Only its own declarations: as many parameters, of the same types (another overload's `void launch(const
    # half*, half*, int, int threads = 64, cudaStream_t s = 0);` is not it). A default written on both (illegal
    # C++, which agents write), or on two declarations, that differs is unknown.
    body = probe.find("{", start, end)
    mine = [p.written for p in params]
    conflicting: set[int] = set()
    overloaded = False
    for a, b, _ in declared:
        texts = _named_parameters(_parameter_texts(text, probe, a, b) or [])
        if len(texts) != len(mine) or not all(map(_same_type, texts, mine)):
            overloaded = True
            continue
        for i, written in enumerate(texts):
            default = _default(written)
            if default is not None and given[i] is None:
                given[i] = default
            elif default is not None and default != given[i]:
                conflicting.add(i)
    for i in conflicting:
        given[i] = None
    if (all(g is None for g in given) and not any(readable)) or named[name] != 1:
        return {}, {}
    variadic = "..." in probe[start : body if body >= 0 else end]
    # Each call's caller, its arguments, and where it stands.
    calls: list[tuple[tuple[int, int, str | None], list[str], int]] = []
    recursive = False
    # A call through an object (`op.launch(n, 1024)`, `this->launch(...)`) counts: a method defined outside its
    # class (`void Op::launch(int n, int threads = 256)`) is called so.
    quoted = re.escape(name)
    for i, m in enumerate(re.finditer(rf"{quoted}(?<!\w{quoted})\b", probe)):
        at = m.start()
        if start <= at < body or any(a <= at < b for a, b, _ in declared):
            continue  # its own header, a declaration of it
        tail = _CALL_TAIL.match(probe, m.end())
        caller = _span_at(spans, starts, at)
        close = (
            _closing(probe, tail.end())
            if tail is not None and caller is not None and i < MAX_ASSIGNMENTS
            else None
        )
        if tail is None or caller is None or close is None:
            return {}, {}  # named otherwise, called outside the host functions, or too often to read
        inside = probe[tail.end() : close]
        calls.append((caller, _split_args(inside) if inside.strip() else [], at))
        recursive = recursive or caller[:2] == span[:2]
    passed = max((len(args) for _, args, _ in calls), default=0)  # the most arguments a call passes
    out: dict[str, str] = {}
    for i, (param, default) in enumerate(zip(params, given, strict=True)):
        if calls and default is not None and passed <= i:
            out[param.name] = default
    if not calls or recursive or variadic or overloaded or passed > len(params):
        return out, {}
    if not all(_balanced(arg) for _, args, _ in calls for arg in args):
        return out, {}
    agreed: dict[str, str] = {}
    for i, (param, default) in enumerate(zip(params, given, strict=True)):
        kind = param.kind
        if passed <= i or not readable[i] or kind is None:
            continue  # left out by every call (its default, above), or of a type not read
        values: set[int | None] = set()
        for caller, args, at in calls:
            if i < len(args):
                values.add(constants.value(args[i], caller, kind, at))
            else:
                values.add(constants.value(default, None, kind, start) if default is not None else None)
            if None in values or len(values) > 1:
                break
        else:
            agreed[param.name] = f"{_AS_NAME[kind]}({values.pop()})"
    return out, agreed


# `extern "C"` where literals are blanked: a function of C linkage, which ctypes may call with any argument.
_EXTERN_C = re.compile(r'\bextern\s*" "')
_EXTERN_C_BLOCK = re.compile(r'\bextern\s*" "\s*\{')


def _extern_c(probe: str, spans: list[tuple[int, int, str | None]]) -> set[str]:
    """The names of the host functions at `spans` declared `extern "C"`, alone or in an `extern "C" { ... }`
    block. `probe`: the text with its literals blanked (`extern "C"` is `extern " "` there)."""
    if _EXTERN_C.search(probe) is None:
        return set()
    blocks: list[tuple[int, int]] = []
    closers: dict[int, int] | None = None
    for m in _EXTERN_C_BLOCK.finditer(probe):
        closers = features._closers(probe, "{", "}") if closers is None else closers
        close = closers.get(m.end() - 1)
        blocks.append((m.end(), close if close is not None else len(probe)))
    out = set()
    for a, b, name in spans:
        header = probe[a : probe.find("{", a, b)]
        if name is not None and (_EXTERN_C.search(header) or any(lo <= a < hi for lo, hi in blocks)):
            out.add(name)
    return out


def _source_launch(
    source: str,
    entry: str,
    macros: Mapping[str, str],
    workload: Workload | None,
    exported: Collection[str] = (),
) -> SourceLaunch | None:
    text = features.preprocess(source, dict(macros))
    sites = _launch_sites(text, entry)
    if not sites:
        return None
    # A name the source defines two ways (`#undef` and defined again, or in both branches of an `#if` that
    # cannot be decided, both kept) is not read: which one the launch sees is not known here.
    defined = dict(macros)
    for m in _DEFINE_LINE.finditer(text):
        name, value = m.group(1), m.group(2).strip()
        if name not in macros and defined.setdefault(name, value) != value:
            defined[name] = ""
    declarations: list[tuple[int, int, str | None]] = []
    probe = features._blank_literals(text)  # read by the spans, and by each launching function's callers
    spans = features.host_function_spans(text, declarations, probe)
    aliases = _aliases(text)
    starts = [a for a, _, _ in spans]  # in order, none inside another
    named = Counter(name for _, _, name in spans)
    lookups = _Lookups(
        _Scopes(probe, spans, starts)
    )  # what the text says of each name: one for every launcher
    constants = _Constants(text, probe, defined, macros, aliases, lookups)
    exported = {*exported, *_extern_c(probe, spans)}
    sized = _WorkloadNames(workload)
    # The names of each launching function (None: launches outside any), read once for its up to MAX_SITES launches.
    by_span: dict[tuple[int, int, str | None] | None, _Names] = {}
    grids, blocks, shared = [], [], []
    for at, parts in sites:
        if len(parts) < 2:
            return None
        span = _span_at(spans, starts, at)
        if span not in by_span:
            params = _parameters(text, probe, span[0], span[1], aliases) if span is not None else ()
            called = True
            defaults: dict[str, str] = {}
            changed: frozenset[str] = frozenset()
            if span is not None:
                body = probe.find("{", span[0], span[1])
                own = probe[body : span[1]] if body >= 0 else ""
                # Parameters the function sets itself: neither its callers' values nor its defaults.
                changed = frozenset(p.name for p in params if _set_in(own, p.name))
                defaulted, passed = _defaults(
                    text, probe, span, spans, declarations, params, exported, starts, named, constants
                )
                # A constant a caller passes for a size the workload names is a test size (`launch(x, y, 1 <<
                # 20, 256)` from main): the workload's stands.
                passed = {n: v for n, v in passed.items() if sized.size(n) is None}
                defaults = {n: d for n, d in {**defaulted, **passed}.items() if n not in changed}
                called = _called(probe, span, spans, starts)
            # A helper the wrapper calls (`launch(out, x)`) takes its tensors from it, not from Python in order.
            tensors = {} if called else _tensor_aliases(params, workload)
            kinds = {p.name: p.kind for p in params if p.kind is not None}
            by_span[span] = _Names(
                text,
                defined,
                workload,
                macros,
                [p.name for p in params],
                tensors,
                defaults,
                kinds,
                aliases,
                lookups=lookups,
                span=span[:2] if span is not None else None,
                changed=changed,
            )
        names = by_span[span]
        grids.append(_valid_grid(names.dims(parts[0], 0, at)))
        blocks.append(_valid_block(names.dims(parts[1], 0, at)))
        smem = _evaluate(parts[2], names, 0, at) if len(parts) >= 3 and parts[2] else 0
        shared.append(smem if smem is not None and 0 <= smem <= MAX_SHARED_MEM_BYTES else None)
    found = SourceLaunch(_agreed(grids), _agreed(blocks), _agreed(shared))
    return found if found.grid is not None or found.block is not None else None
