"""The public data types: tool inputs (Kernel, Workload) and tool outputs.

Field names here are the public contract of DESIGN.md: add fields freely, never rename.
Validation messages are read by agents, so they say what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

MAX_SOURCE_BYTES = 1_000_000
HISTORY_SCOPE_MARK = "@"  # between a workload key (hex) and the ledger of an isolated history (history_key)
# A replayed device's history (measurements, forecasts, calibration) is filed under "<GPU> (replay <digest of its
# recordings>)", apart from a real GPU of that name and from other recordings of it (ReplayMeasurer.history_device);
# replayed measurements stored before that are filed under "<GPU> (replay)" (store migration 16).
REPLAY_HISTORY_MARK = " (replay"


def history_gpu(hardware: str) -> str:
    """The GPU a stored history's `hardware` is of: "A100-PCIE-40GB (replay 1a2b...)" is an A100-PCIE-40GB."""
    return hardware.split(REPLAY_HISTORY_MARK, 1)[0]


MAX_CANDIDATES = 64
MIN_CANDIDATES = 2


def candidate_count_problem(count: int) -> str | None:
    """Why `count` candidates are no compare_kernels call (2 to 64, the baseline among them), or None."""
    if MIN_CANDIDATES <= count <= MAX_CANDIDATES:
        return None
    advice = (
        "the baseline is one of the candidates: pass it and at least one kernel to compare with it"
        if count < MIN_CANDIDATES
        else "split larger sets into several calls against the same baseline (repeat it in each)"
    )
    return f"compare_kernels takes {MIN_CANDIDATES} to {MAX_CANDIDATES} candidates, got {count}; {advice}"


# The smallest time cap a measurement may ask for (max_seconds). Below it the device would be held (loading,
# a checked run) for far longer than the cap, and charging only the cap would make that time close to free.
MIN_MEASURE_SECONDS = 0.1

Language = Literal["cuda", "opencl", "hip", "triton", "python"]
Dtype = Literal[
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]
DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}
InitKind = Literal["random_uniform", "random_normal", "zeros", "ones", "arange"]
Intent = Literal["in", "out", "inout"]
DefineValue = int | float | str
# A kernel's defines are its tuning parameters (a dozen in a Kernel Tuner space): these bounds keep a
# request's size, the prompt Claude is paid to read, and the family model's fit (its cost grows with the number
# of parameters: 200 of them took 30 s and 1 GB on 200 points) proportionate.
MAX_DEFINES = 64
MAX_DEFINE_NAME = 128


def _too_many_defines(count: int) -> str:
    return (
        f"{count} defines, over the limit of {MAX_DEFINES}: pass the tuning parameters only (constants the source "
        "always needs belong in the source)"
    )


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: "$" would let a trailing newline through
# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators: a NUL cannot reach a
# process argument at all, the others have no place in a macro value or a compiler flag, and each of NEL,
# U+2028 and U+2029 ends a line for str.splitlines() (and perhaps for a model reading the prompt).
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

# Every spot the preprocessor could read a file at: `#include`, `#include_next`, `#import` or `#embed` after `#`,
# its digraph `%:` or trigraph `??=`, wherever it stands (inside a string or comment too: judging those would
# mean lexing C++ as the compiler does, raw strings and all, and a miss leaks a file). Backslash-newline (and
# `??/`-newline) splices are joined first, as the compiler joins them. A comment between `#` and the directive
# or between it and the header (legal, and never written) is refused rather than skipped: skipping it is a
# scan to its end from every `#`.
_SPLICE = re.compile(r"(?:\\|\?\?/)[ \t\f\v]*(?:\r\n|\n|\r)")
_INCLUDE = re.compile(
    r"(?:#|%:|\?\?=)[ \t\f\v]*(?:(/\*)|(include_next|include|import|embed)\b[ \t\f\v]*([^\r\n]{0,200}))"
)
_HEADER_NAME = re.compile(r'<([^<>]*)>|"([^"]*)"')
# `__has_include("...")` tells whether a file exists (an #if on it, then an #error, answers the caller).
_HAS_INCLUDE = re.compile(r"__has_(?:include|include_next|embed)\b[ \t\f\v]*(\(?)[ \t\f\v]*([^\r\n]{0,200})")
# `#pragma GCC dependency "file"` (or its _Pragma string) checks a file's date, and says when it is missing. A
# comment right after GCC is refused too (the compiler reads it as a space, so it could hide the word), and a
# _Pragma whose text macros build (`_Pragma(XS(GCC DEP "f"))`) where the source says dependency at all.
_GCC_DEPENDENCY = re.compile(r"GCC[ \t\f\v]*(?:dependency\b|/\*)")
# A _Pragma not directly followed by "(" and a string literal: a macro names it, or builds its text.
_BUILT_PRAGMA = re.compile(r'_Pragma(?!\s*\(\s*(?:L|u8|u|U)?")')
_DEPENDENCY = re.compile(r"\bdependency\b")
# `__has_include` without its parenthesis where it is only tested for (`defined(__has_include)`, `#ifdef`).
_TESTED_FOR = re.compile(
    r"(?:(?:^|(?<=[ \t\f\v(!&|]))defined(?:[ \t\f\v]*\([ \t\f\v]*|[ \t\f\v]+)"
    r"|(?:#|%:|\?\?=)[ \t\f\v]*(?:ifn?def|elifn?def)[ \t\f\v]+)\Z",
    re.MULTILINE,
)
_TESTED_NAME = re.compile(r"[ \t\f\v]*(?:\)|$|//|/\*|&&|\|\|)", re.MULTILINE)
# Token pasting (`##`, its digraph, its trigraph) makes identifiers no check here can read: CAT(__has_,include)
# is __has_include once an #if expands it, and pasted words stringized (`#x`) make any _Pragma text. Pasting is
# refused in a source that has an #if or #elif or stringizes (a '#' before a name later on a #define line).
_PASTE = re.compile(r"(?:#|\?\?=){2}|%:%:")
_CONDITIONAL = re.compile(r"(?:#|%:|\?\?=)[ \t\f\v]*(?:if|elif)\b")
_STRINGIZE = re.compile(r"^[ \t\f\v]*#[ \t\f\v]*define\b[^\n]*?(?<!#)#(?!#)[ \t\f\v]*[A-Za-z_]", re.MULTILINE)
_HASH_SPELLING = re.compile(r"%:|\?\?=")
# `#line N "file"`, and GNU's linemarker `# N "file"`, rename the source for diagnostics, and gcc's caret
# display then prints line N of that file from disk: `#line 1 "/proc/self/environ"` then `#error` would show
# the caller the server's environment. `#line` is refused anywhere (as #include is); a linemarker where it is a
# directive: first on its line, or right after a comment that ends there.
_LINE_DIRECTIVE = re.compile(
    r"(?:#|%:|\?\?=)[ \t\f\v]*line\b|(?:^|(?<=\r)|\*/)[ \t\f\v]*(?:#|%:|\?\?=)[ \t\f\v]*\d", re.MULTILINE
)
# C0 controls other than the whitespace C allows (tab, newline, vertical tab, form feed, carriage return):
# gcc drops a NUL with a warning and then obeys the directive it hid ("#\0include" passed the check above).
SOURCE_CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


_HEADER_ADVICE = (
    "the server compiles kernels and shows the compiler's messages, so it accepts only headers named plainly, "
    "as <cuda_fp16.h> or \"cub/cub.cuh\" (the CUDA toolkit's and the standard library's); paste your own "
    "helpers into the source (an #include in a comment is checked too)"
)


def _header_problem(shown: str, rest: str) -> str | None:
    """Why the header an #include (or __has_include) names at the start of `rest` is refused, or None."""
    header = _HEADER_NAME.match(rest)
    if header is None or rest.startswith("/*"):
        return f'{shown!r} does not name its header as <name> or "name" (a macro may name any file); {_HEADER_ADVICE}'
    name = header.group(1) if header.group(1) is not None else header.group(2)
    if name.startswith(("/", "~")) or "\\" in name or ".." in name.split("/") or not name.strip():
        return (
            f"{shown!r} names a file by an absolute path, through '..' or with a backslash; {_HEADER_ADVICE}"
        )
    return None


# What a macro's value (a define, a -D option) may not hold: it is preprocessor text the source checks above
# never see, so a value could be the __has_include, _Pragma or 'dependency' a source may not spell out, or a
# '#' (pasting) or a quoted file name for one.
_MACRO_VALUE = re.compile(r'__has_|_Pragma|\bdependency\b|[#"]|%:|\?\?=')


def macro_value_problem(value: str) -> str | None:
    """Why a define's value is refused (see _MACRO_VALUE), or None."""
    if (bad := _MACRO_VALUE.search(value)) is None:
        return None
    return (
        f"holds {bad.group()!r}: a macro's value is preprocessor text the server cannot check for a file test "
        "(__has_include, _Pragma, #pragma GCC dependency), so it holds no '#', quotes, __has_, _Pragma or "
        "'dependency'; spell such code in the source"
    )


def source_problem(source: str) -> str | None:
    """Why `source` is refused, or None. Kernels are compiled on the server and compiler messages go back to
    the caller, so nothing in a source may make the compiler read, or show, a file of the server's: a header
    named by an absolute path, through `..` or a backslash, or by a macro (a define could name any file), a
    `#line` naming a file, or a directive hidden by a NUL."""
    if (bad := SOURCE_CONTROL_CHARACTER.search(source)) is not None:
        return (
            f"has the control character {bad.group()!r}: a kernel source holds text, tabs and newlines only "
            "(the compiler skips a NUL and obeys what it hid)"
        )
    joined = _SPLICE.sub("", source)
    # gcc ends a line at a lone \r too, skips a leading BOM, and ignores trigraphs (a "??/" splice is none):
    # the linemarker check reads the source both joined and as written.
    if any(_LINE_DIRECTIVE.search(text.lstrip("\ufeff")) is not None for text in (joined, source)):
        return "has a #line directive or a linemarker ('# 12 \"file\"'): leave them out (the server numbers lines)"
    for m in _INCLUDE.finditer(joined):
        if m.group(1) is not None:
            return f"has a comment right after a '#': write the directive plainly; {_HEADER_ADVICE}"
        if problem := _header_problem(f"#{m.group(2)} {m.group(3).strip()[:80]}", m.group(3)):
            return problem
    if _GCC_DEPENDENCY.search(joined) is not None or (
        _BUILT_PRAGMA.search(joined) is not None and _DEPENDENCY.search(joined) is not None
    ):
        return (
            "has '#pragma GCC dependency', a comment right after 'GCC', or a _Pragma built by macros in a "
            "source with the word 'dependency' (comments too): leave it out or reword it (the pragma checks a "
            "file of the server's)"
        )
    if _PASTE.search(joined) is not None and (
        _CONDITIONAL.search(joined) is not None
        or _STRINGIZE.search(_HASH_SPELLING.sub("#", joined)) is not None
    ):
        return (
            "uses token pasting (##) together with #if or stringizing (#x): pasted names can test for a file "
            "of the server's (__has_include in an #if, a _Pragma); write the pasted names out, or choose the "
            "code with -D defines and #ifdef"
        )
    for m in _HAS_INCLUDE.finditer(joined):
        if not m.group(1) and _TESTED_FOR.search(joined, max(0, m.start() - 40), m.start()) is not None:
            if _TESTED_NAME.match(m.group(2)) is not None:  # ")" or the line's end (comments, && and || too)
                continue  # defined(__has_include), #ifdef __has_include: asks whether the compiler has it
        # Without its parenthesis the name comes from a macro: refused as a header not named plainly.
        rest = m.group(2) if m.group(1) else ""
        if problem := _header_problem(f"__has_include({m.group(2).strip()[:80]}", rest):
            return problem
    return None


INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

# CUDA's launch limits (every compute capability since 3.0).
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_BLOCK_XY = 1024
MAX_BLOCK_Z = 64
MAX_THREADS_PER_BLOCK = 1024
# Dynamic shared memory per block, over any GPU's limit (the largest opt-in today is 227 KiB on sm_90 and
# sm_100); the measurer checks the device's own limit, this only turns away sizes no GPU has.
MAX_SHARED_MEM_BYTES = 2**20

# nvcc flags a kernel may carry. Each changes how device code is generated and none names a file, a directory,
# a host compiler or options for a host tool, so a kernel cannot make the server read, write or run anything.
# Only the attached `flag=value` form is accepted: every list item is one whole flag (matched whole, with
# fullmatch: `$` would let a trailing newline through).
_PTXAS_OPTION = (
    r"(?:-v|--verbose|-O[0-3]|--opt-level=[0-3]|-warn-spills|--warn-on-spills|-warn-lmem-usage"
    r"|--warn-on-local-memory-usage|-warn-double-usage|--warn-on-double-precision-use"
    r"|-dlcm=(?:ca|cg|cs|lu|cv)|--def-load-cache=(?:ca|cg|cs|lu|cv)"
    r"|-dscm=(?:wb|cg|cs|wt)|--def-store-cache=(?:wb|cg|cs|wt)|--?maxrregcount=\d{1,3}"
    r"|--?allow-expensive-optimizations=(?:true|false)|--?fmad=(?:true|false))"
)
_ARCH_NAME = r"(?:sm|compute)_\d{2,3}[af]?"
COMPILE_OPTION = re.compile(
    r"(?:"
    r"-O[0-3]|--?std=c\+\+(?:11|14|17|20)"
    r"|--?use_fast_math|--?(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)"
    r"|--?maxrregcount=\d{1,3}|--?extra-device-vectorization|--?restrict"
    r"|-lineinfo|--generate-line-info|-G|--device-debug"
    r"|--?expt-relaxed-constexpr|--?expt-extended-lambda|--?extended-lambda"
    r"|-w|--disable-warnings|--?Wno-deprecated-gpu-targets"
    r"|-D[A-Za-z_][A-Za-z0-9_]*(?:=[A-Za-z0-9_.+\-]*)?|-U[A-Za-z_][A-Za-z0-9_]*"
    rf"|(?:-Xptxas|--ptxas-options)={_PTXAS_OPTION}(?:,{_PTXAS_OPTION})*"
    r"|(?:-rdc|--relocatable-device-code)=(?:true|false)|-dc|--device-c"
    rf"|(?:-arch|--gpu-architecture|-code|--gpu-code)={_ARCH_NAME}"
    rf"|(?:-gencode|--generate-code)=arch=compute_\d{{2,3}}[af]?,code={_ARCH_NAME}"
    r")"
)
_ARCH_OPTION = re.compile(r"^(?:-arch|--gpu-architecture|-code|--gpu-code|-gencode|--generate-code)=")
ACCEPTED_COMPILE_OPTIONS = (
    "-O0..-O3, -use_fast_math, -ftz=, -prec-div=, -prec-sqrt=, -fmad= (true|false), -maxrregcount=N, "
    "-extra-device-vectorization, -restrict, -lineinfo, -G, -std=c++11|14|17|20, -expt-relaxed-constexpr, "
    "-extended-lambda, -w, -Wno-deprecated-gpu-targets, -DNAME[=value], -UNAME, "
    "-Xptxas=<ptxas flags, comma separated: -v, -O0..-O3, -warn-spills, -warn-lmem-usage, -dlcm=ca|cg|cs|lu|cv, "
    "-dscm=wb|cg|cs|wt, -maxrregcount=N, -allow-expensive-optimizations=true|false>, -rdc=true|false, -dc, "
    "-arch=sm_XX, -code=sm_XX, -gencode=arch=compute_XX,code=sm_XX"
)


def compile_option_allowed(option: str) -> bool:
    """True for an nvcc flag a kernel may carry (see COMPILE_OPTION): code generation only, no file access."""
    return COMPILE_OPTION.fullmatch(option) is not None


def is_arch_option(option: str) -> bool:
    """True for a flag that picks the target architecture (the compile flows pick their own otherwise)."""
    return _ARCH_OPTION.match(option) is not None


def _check_number(value: Any, what: str, low: int = INT64_MIN, high: int = INT64_MAX) -> None:
    """Raise unless a number is finite and, for an integer, within [low, high]."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}: numbers must be finite (NaN and infinity are not valid input)")
    if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
        raise ValueError(f"{what} is out of range: integers must be between {low} and {high}")


def _one_line(value: str, what: str, limit: int) -> str:
    """`value` unless it has a control character (a newline, NUL, ...) or is over `limit` characters. Names and
    sizes reach forecasters' prompts and reports as one line each: a newline in them could pose as a section
    of the prompt."""
    if CONTROL_CHARACTER.search(value) or len(value) > limit:
        raise ValueError(
            f"{what} {value[:80]!r} has a control character (newline, NUL, ...) or is over {limit} characters: "
            "pass one line of printable text"
        )
    return value


MAX_PROBLEM_ENTRIES = 64


def _too_many_problem_entries(count: int) -> str:
    return (
        f"workload.problem has {count} entries, over {MAX_PROBLEM_ENTRIES}: pass the sizes that matter (M, N, K, "
        "batch, ...)"
    )


def _whole(value: int | float | str) -> int | float | str:
    """A float that is a whole number of safe size (4096.0) as an int; anything else as it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _dim3(value: Any, what: str) -> tuple[int, int, int]:
    # A whole float (128.0, what a client's `4096 / 32` sends) is the integer it names, as the published schema
    # (JSON Schema "integer") and every other integer field here take it: it was refused, "must hold integers".
    if isinstance(value, float):
        value = [value]
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= 3:
        raise ValueError(f"{what} must be a list of 1 to 3 positive integers, e.g. [256, 1, 1]")
    dims: list[Any] = [
        int(d) if isinstance(d, float) and d.is_integer() and abs(d) < 2**53 else d
        for d in (*value, *([1] * (3 - len(value))))
    ]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must hold integers, got {value!r}")
    if any(d <= 0 for d in dims):
        raise ValueError(f"{what} dimensions must be positive (at least 1), got {value!r}")
    return (dims[0], dims[1], dims[2])


def _within(dims: tuple[int, int, int], limits: tuple[int, int, int], what: str) -> None:
    for axis, d, limit in zip("xyz", dims, limits, strict=True):
        if d > limit:
            raise ValueError(
                f"{what}.{axis} is {d}; CUDA allows at most {limit} (limits x, y, z: {list(limits)})"
            )


def _dim3_schema(largest: int) -> dict[str, Any]:
    """The published form of a grid or block: what `_dim3` accepts (one to three sizes, or one number)."""
    size = {"type": "integer", "minimum": 1, "maximum": largest}
    return {
        "anyOf": [
            {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1, "maxItems": 3},
            size,
        ]
    }


class Launch(_Strict):
    """How a CUDA kernel is launched."""

    grid: Annotated[tuple[int, int, int], WithJsonSchema(_dim3_schema(MAX_GRID_X), mode="validation")] = (
        Field(description="grid dimensions [x, y, z] in blocks ([x] or [x, y] or a number: the rest are 1)")
    )
    block: Annotated[tuple[int, int, int], WithJsonSchema(_dim3_schema(MAX_BLOCK_XY), mode="validation")] = (
        Field(description="block dimensions [x, y, z] in threads ([x] or [x, y] or a number: the rest are 1)")
    )
    shared_mem_bytes: int = Field(default=0, ge=0, description="dynamic shared memory per block")

    @field_validator("grid", mode="before")
    @classmethod
    def _grid(cls, v: Any) -> tuple[int, int, int]:
        dims = _dim3(v, "launch.grid")
        _within(dims, (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ), "launch.grid")
        return dims

    @field_validator("block", mode="before")
    @classmethod
    def _block(cls, v: Any) -> tuple[int, int, int]:
        dims = _dim3(v, "launch.block")
        _within(dims, (MAX_BLOCK_XY, MAX_BLOCK_XY, MAX_BLOCK_Z), "launch.block")
        if dims[0] * dims[1] * dims[2] > MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"launch.block has {dims[0] * dims[1] * dims[2]} threads; CUDA allows at most "
                f"{MAX_THREADS_PER_BLOCK} per block"
            )
        return dims

    @field_validator("shared_mem_bytes")
    @classmethod
    def _shared(cls, v: int) -> int:
        if v > MAX_SHARED_MEM_BYTES:
            raise ValueError(
                f"launch.shared_mem_bytes is {v}, over the {MAX_SHARED_MEM_BYTES}-byte cap: no GPU gives a block "
                "that much shared memory (the most today is 227 KiB, 232448 bytes, on H100 and B200)"
            )
        return v

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


_DECIMAL_INT = re.compile(r"-?(0|[1-9][0-9]{0,17})")
# An integer literal as C spells it: decimal, octal (leading 0) or hex, with an optional u/l suffix.
C_INT_SUFFIX = r"(?:[uU][lL]{0,2}|[lL]{1,2}[uU]?)"
C_INT = re.compile(rf"([+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)){C_INT_SUFFIX}?")


def c_integer(text: str) -> int | None:
    """The integer C reads in `text` when it is an integer literal ("016" is octal 14, "0x10" 16, "16u" 16),
    else None ("09" is no octal number, "1_6" no literal; nor more digits than int() reads)."""
    exact = C_INT.fullmatch(text.strip())
    if exact is None:
        return None
    digits = exact.group(1)
    sign = -1 if digits.startswith("-") else 1
    body = digits.lstrip("+-")
    try:
        if body[:2] in ("0x", "0X"):
            return sign * int(body[2:], 16)
        if len(body) > 1 and body.startswith("0"):
            return sign * int(body, 8)
        return sign * int(body)
    except ValueError:
        return None


def _define_key(value: DefineValue) -> DefineValue:
    """A define's value as the content key holds it: the number its #define text spells, where the text is
    one (16 and "16" are one kernel to the compiler, and True and 1), else the value as given. Numbers given
    as numbers keep the key they always had; "016" (octal in C) or "16u" stay strings."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        if _DECIMAL_INT.fullmatch(value):
            return int(value)
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) and str(number) == value else value
    return value


class Kernel(_Strict):
    """One kernel candidate: source, entry point, launch and tuning parameters."""

    id: str | None = Field(default=None, max_length=128, description="unique in a call; default k0, k1, ...")
    source: str = Field(
        description="the kernel source (at most 1 MB)", json_schema_extra={"maxLength": MAX_SOURCE_BYTES}
    )
    entry: str = Field(
        description="the __global__ function name",
        json_schema_extra={"maxLength": 256, "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
    )
    language: Language = "cuda"
    launch: Launch | None = Field(
        default=None,
        description="grid and block; needed to measure on a GPU, and it sharpens forecasts between different "
        "kernels (waves, occupancy, threads launched for the same workload)",
    )
    defines: dict[str, DefineValue] = Field(
        default_factory=dict,
        description=f"macros (#define NAME value ahead of the source) / tuning parameters; at most {MAX_DEFINES}",
        json_schema_extra={"maxProperties": MAX_DEFINES},
    )
    compile_options: list[str] = Field(default_factory=list, max_length=64, description="extra nvcc flags")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(
                "kernel id is empty: leave it out for the default (k0, k1, ...) or name the kernel"
            )
        return None if v is None else _one_line(v, "kernel id", 128)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("source is empty: pass the kernel's full source text")
        size = len(v.encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise ValueError(
                f"source is {size} bytes, over the {MAX_SOURCE_BYTES}-byte limit: "
                "send only the kernel and what it includes"
            )
        problem = source_problem(v)
        if problem is not None:
            raise ValueError(f"source {problem}")
        return v

    @field_validator("entry")
    @classmethod
    def _entry(cls, v: str) -> str:
        if not _IDENT.fullmatch(v) or len(v) > 256:
            raise ValueError(f"entry {v[:80]!r} is not a C identifier: pass the __global__ function's name")
        return v

    @field_validator("defines", mode="before")
    @classmethod
    def _defines_counted_first(cls, v: Any) -> Any:
        """The count before the entries: pydantic validated every entry of a dict of millions (seconds of an
        HTTP server's event loop, every other client waiting) only for the count to refuse it."""
        if isinstance(v, dict) and len(v) > MAX_DEFINES:
            raise ValueError(_too_many_defines(len(v)))
        return v

    @field_validator("defines")
    @classmethod
    def _defines(cls, v: dict[str, DefineValue]) -> dict[str, DefineValue]:
        if len(v) > MAX_DEFINES:
            raise ValueError(_too_many_defines(len(v)))
        for name, value in v.items():
            if not _IDENT.fullmatch(name):
                raise ValueError(f"define name {name[:80]!r} is not a C identifier")
            if len(name) > MAX_DEFINE_NAME:
                raise ValueError(
                    f"define name {name[:80]!r}... is over {MAX_DEFINE_NAME} characters: shorten it"
                )
            if isinstance(value, str):
                _one_line(value, f"define {name}'s value", 256)
                if value.endswith("\\") or "/*" in value:
                    # It becomes a #define line: a trailing backslash would join the next line to it and a
                    # comment opener would swallow the source up to its first */.
                    raise ValueError(
                        f"define {name}'s value {value[:80]!r} ends with a backslash or opens a /* comment: "
                        "pass the value itself"
                    )
                if (problem := macro_value_problem(value)) is not None:
                    raise ValueError(f"define {name}'s value {value[:80]!r} {problem}")
            else:
                # It becomes -Dname=value: NaN, inf or a 400-digit integer is not a C literal anyone means.
                _check_number(value, f"define {name}")
        return v

    @field_validator("compile_options")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        for opt in v:
            if CONTROL_CHARACTER.search(opt) or len(opt) > 256:
                raise ValueError(
                    f"compile option {opt[:80]!r} has a control character (newline, NUL, ...) or is over "
                    "256 characters: pass one nvcc flag per list item"
                )
            if opt.startswith("-D") and (problem := macro_value_problem(opt.partition("=")[2])) is not None:
                raise ValueError(f"compile option {opt[:80]!r}: its value {problem}")
            if not compile_option_allowed(opt):
                raise ValueError(
                    f"compile option {opt[:80]!r} is not accepted: only flags that change device code "
                    "generation may be passed, one per list item in the attached form (-maxrregcount=64, "
                    f"not -maxrregcount 64). Accepted: {ACCEPTED_COMPILE_OPTIONS}. Macros go in defines; "
                    "include paths, output files, host compiler and host-tool options are chosen by the server"
                )
        return v

    def compile_source(self) -> str:
        """The text handed to the compiler: the defines as `#define` lines ahead of the source, then a `#line`
        directive so compiler messages keep the source's own line numbers.

        Never as `-D` flags: nvcc runs its host compiler through a shell, so a define value such as `$(id)` on
        the command line would run on the server. In the source it is only preprocessor text."""
        source = self.source.removeprefix("\ufeff")  # a byte-order mark after the #define lines is an error
        if not self.defines:
            return source
        lines = [f"#define {name} {int(v) if isinstance(v, bool) else v}" for name, v in self.defines.items()]
        return "\n".join(lines) + '\n#line 1 "kernel.cu"\n' + source

    @model_validator(mode="after")
    def _one_place_per_macro(self) -> Kernel:
        flagged = {o[2:].split("=", 1)[0] for o in self.compile_options if o.startswith(("-D", "-U"))}
        both = sorted(flagged & set(self.defines))
        if both:
            raise ValueError(
                f"macro {both[0]} is set both in defines and by a -D/-U compile option: set it in one place "
                "(defines, for a tuning parameter)"
            )
        return self

    def source_hash(self) -> str:
        """Content hash of the source alone (a kernel family shares it across defines)."""
        return hashlib.sha256(self.source.encode("utf-8", "surrogatepass")).hexdigest()

    def content_key(self) -> str:
        """Hash of everything that changes the compiled binary and its launch (not the id)."""
        return self._content_key(_define_key)

    def earlier_content_key(self) -> str | None:
        """The content key this kernel had before define values were read as the compiler reads them (`"16"`
        kept as a string, True as true), where that differs from `content_key`: results stored under it are
        still this kernel's. None when the two agree (no define is a string or a bool)."""
        if not any(isinstance(v, str | bool) for v in self.defines.values()):
            return None
        earlier = self._content_key(lambda v: v)
        return earlier if earlier != self.content_key() else None

    def _content_key(self, define_key: Callable[[DefineValue], DefineValue]) -> str:
        payload = {
            "source": self.source_hash(),
            "entry": self.entry,
            "language": self.language,
            "launch": self.launch.model_dump() if self.launch else None,
            "defines": {k: define_key(self.defines[k]) for k in sorted(self.defines)},
            "compile_options": self.compile_options,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def family_key(self) -> str:
        """Kernels that differ only in defines and launch share a family (the online model's unit)."""
        payload = {"source": self.source_hash(), "entry": self.entry, "language": self.language}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


class _Arg(_Strict):
    """What every kernel argument has: a name (one line) and a dtype."""

    name: str = Field(max_length=128)
    dtype: Dtype

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _one_line(v, "argument name", 128)


class BufferArg(_Arg):
    """A device buffer argument."""

    shape: list[int] = Field(min_length=1, max_length=8)
    init: InitKind = "random_uniform"
    intent: Intent = "in"

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if any(d <= 0 for d in v):
            raise ValueError(f"buffer shape {v} has a non-positive dimension")
        if any(d > MAX_WORKLOAD_BYTES for d in v):
            # (Checked here, on each dimension: a product of huge ones cannot even be shown in GiB.)
            raise ValueError(
                f"a buffer dimension is over {MAX_WORKLOAD_BYTES:,} elements: workloads are limited to 64 GiB"
            )
        return v

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]


# Where each float type's rounding reaches infinity (its largest finite value plus half a unit in the last
# place): a scalar at or beyond it would be passed to the kernel as infinity.
_FLOAT_MAX = {"float16": 65520.0, "bfloat16": 2.0**127 * (2.0 - 2.0**-8), "float32": 2.0**128 - 2.0**103}


class ScalarArg(_Arg):
    """A by-value scalar argument."""

    value: int | float

    @field_validator("value")
    @classmethod
    def _value(cls, v: int | float, info: ValidationInfo) -> int | float:
        what = f"scalar {info.data.get('name', '?')}"
        _check_number(v, what, INT64_MIN, UINT64_MAX)
        dtype = info.data.get("dtype")
        if isinstance(dtype, str) and dtype.startswith(("int", "uint")):
            bits = int(dtype.removeprefix("u").removeprefix("int"))
            signed = not dtype.startswith("u")
            low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
            if not low <= v <= high:
                raise ValueError(f"{what}={v} does not fit {dtype} ({low} to {high})")
            if isinstance(v, float) and not v.is_integer():
                raise ValueError(
                    f"{what}={v} is not an integer, and {dtype} holds integers: pass a whole number"
                )
        elif dtype in _FLOAT_MAX and abs(v) >= _FLOAT_MAX[dtype]:
            raise ValueError(f"{what}={v} is beyond the largest finite {dtype}: it would become infinity")
        return v


def _arg_kind(value: Any) -> str | None:
    """A buffer has a shape, a scalar a value: validation errors then speak of the one the caller meant. One
    with neither is neither (None): refused with `_NO_ARG_KIND`, not as a buffer whose shape is missing."""
    if isinstance(value, dict):
        if "value" not in value and "shape" not in value:
            return None
        return "scalar" if "value" in value and "shape" not in value else "buffer"
    return "scalar" if isinstance(value, ScalarArg) else "buffer"


# The refusal of an argument with neither shape nor value ("buffer.shape: Field required" did not say that a
# scalar is sent with a value).
_NO_ARG_KIND = (
    "has neither shape nor value: send shape and dtype for an array (a buffer), value and dtype for a scalar"
)

WorkloadArg = Annotated[
    Annotated[BufferArg, Tag("buffer")] | Annotated[ScalarArg, Tag("scalar")],
    Discriminator(_arg_kind, custom_error_type="workload_arg_kind", custom_error_message=_NO_ARG_KIND),
]
MAX_WORKLOAD_BYTES = 64 * 2**30


class Workload(_Strict):
    """What the kernel runs on: ordered kernel arguments plus free-form problem sizes."""

    args: list[WorkloadArg] = Field(default_factory=list, max_length=64)
    problem: dict[str, int | float | str] = Field(default_factory=dict)
    name: str | None = Field(default=None, max_length=256)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else _one_line(v, "workload.name", 256)

    @field_validator("problem", mode="before")
    @classmethod
    def _problem_counted_first(cls, v: Any) -> Any:
        """The count before the entries, as for Kernel.defines."""
        if isinstance(v, dict) and len(v) > MAX_PROBLEM_ENTRIES:
            raise ValueError(_too_many_problem_entries(len(v)))
        return v

    @field_validator("problem")
    @classmethod
    def _problem(cls, v: dict[str, int | float | str]) -> dict[str, int | float | str]:
        if len(v) > MAX_PROBLEM_ENTRIES:
            raise ValueError(_too_many_problem_entries(len(v)))
        for key, value in v.items():
            _one_line(key, "workload.problem key", 128)
            if isinstance(value, str):
                _one_line(value, f"workload.problem[{key!r}]", 256)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"workload.problem[{key[:80]!r}] is {value}: sizes must be finite numbers "
                    "(NaN and infinity are not valid input)"
                )
            # Held to 64 bits like defines and scalars: sizes reach launch arithmetic and forecasters' prompts.
            _check_number(value, f"workload.problem[{key[:80]!r}]")
        # One form per meaning, so the key does not depend on how a client wrote the sizes: sorted by name,
        # and a whole float (4096.0) as the integer it is.
        return {k: _whole(v[k]) for k in sorted(v)}

    @model_validator(mode="after")
    def _sizes(self) -> Workload:
        total = sum(a.nbytes for a in self.args if isinstance(a, BufferArg))
        if total > MAX_WORKLOAD_BYTES:
            gib = f"{total / 2**30:.1f}" if total < 2**80 else f"about 2^{total.bit_length() - 31}"
            raise ValueError(f"workload buffers need {gib} GiB, over the 64 GiB limit: use smaller shapes")
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError("workload argument names must be unique")
        return self

    def key(self) -> str:
        """Stable hash of the workload (part of every measurement's cache key). `name` is a label and left
        out: naming a workload does not make its measurements new ones."""
        unnamed = self if self.name is None else self.model_copy(update={"name": None})
        return hashlib.sha256(unnamed.model_dump_json().encode()).hexdigest()[:32]

    # The ledger whose measurements alone this workload's history holds (Settings.isolate_ledgers), or None.
    _scope: str | None = PrivateAttr(default=None)

    def scoped(self, ledger: str | None) -> Workload:
        """This workload as `ledger` sees it where ledgers are isolated: the same inputs, its own history."""
        copy = self.model_copy()
        copy._scope = ledger
        return copy

    @property
    def scope(self) -> str | None:
        """The ledger whose own history this workload holds where ledgers are isolated (`scoped`), else None."""
        return self._scope

    def history_key(self) -> str:
        """What the store files measurements, forecasts and family models under: `key()`, and within an
        isolated ledger `<key>@<ledger>`. Measurers (and exports) use `key()`: the inputs are the same."""
        return self.key() if self._scope is None else f"{self.key()}{HISTORY_SCOPE_MARK}{self._scope}"

    def bytes_moved_floor(self) -> int:
        """Bytes that must cross DRAM at least once: inputs read, outputs written."""
        total = 0
        for a in self.args:
            if isinstance(a, BufferArg):
                total += a.nbytes * (2 if a.intent == "inout" else 1)
        return total


# ---------------------------------------------------------------- measurement results

# A result flag: the compiler ran out of time or was killed (a loaded machine, the OOM killer), so the
# "timeout" says nothing of the kernel: neither learned as its failure nor answered from (store._KERNELS_OWN).
COMPILE_INTERRUPTED = "compile_interrupted"
# A result flag: max_seconds ran out while the workload's inputs were still being generated and uploaded, before
# the kernel first ran: the timeout says nothing of the kernel (store._KERNELS_OWN), only of the workload's size.
INPUTS_UNFINISHED = "inputs_unfinished"
# Result flags of an ok measurement saying its runtime may not be the kernel's work: a median faster than the
# kernel's memory traffic allows (work skipped, inputs never read) or host time far above the events (work
# outside the timed stream). Such a measurement is stored, returned and charged, but nothing rests on it: no
# pair is decided on it (service._from_measurement), no family model learns it and no forecast is verified by
# it (store._SUSPECT), until a later measurement of the kernel without them.
SUSPECT_FLAGS = frozenset({"below_physical_floor", "events_disagree_with_wall_clock"})

MeasureStatus = Literal[
    "ok",
    "compile_error",
    "launch_error",
    "timeout",
    "wrong_output",
    "out_of_bounds_write",
    "worker_crashed",
    "out_of_memory",
]
Backend = Literal["replay", "pycuda", "fake"]


class RuntimeStats(BaseModel):
    """Runtime statistics in milliseconds."""

    median: float
    mean: float
    min: float
    p10: float
    p90: float
    std: float
    ci95_low: float = Field(description="95% interval of the median, low end")
    ci95_high: float = Field(description="95% interval of the median, high end")
    runs: int
    relative_noise: float = Field(default=0.0, description="half-width of the 95% interval over the median")


class Correctness(BaseModel):
    checked: bool = False
    passed: bool | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    input_sets: int = 0
    detail: str | None = None


class ResourceUsage(BaseModel):
    registers: int | None = None
    shared_mem_bytes: int | None = None
    spill_bytes: int | None = None
    occupancy: float | None = Field(default=None, description="theoretical occupancy 0..1")
    local_bytes: int | None = Field(
        default=None,
        description="local memory per thread in bytes (local arrays, stack frame, spills), as the driver reports "
        "it for the compiled kernel; None where not known (replay)",
    )


class DeviceProvenance(BaseModel):
    name: str
    backend: Backend
    compute_capability: str | None = None
    driver: str | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    throttle_reasons: list[str] = Field(default_factory=list)
    recording: str | None = Field(
        default=None,
        description="replay: the recording the result came from, as its file name and the start of its sha256 "
        "(A100.json.gz@sha256:1a2b3c4d5e6f7a8b)",
    )


class MeasureCost(BaseModel):
    gpu_seconds: float = Field(description="GPU-seconds charged to the ledger by this call")
    compile_seconds: float = Field(
        default=0.0, description="seconds spent compiling, recorded apart and not charged to the ledger"
    )
    cached: bool = Field(
        default=False, description="answered from an earlier measurement: nothing was charged"
    )
    max_seconds: float | None = Field(
        default=None,
        description="the cap on GPU-seconds the measurement ran under (a cached copy: the original's)",
    )
    max_runs: int | None = Field(default=None, description="the cap on timed runs the measurement ran under")


class MeasureResult(BaseModel):
    """What `measure_kernel` returns. A failing kernel is a result with a status, not an error."""

    kernel_id: str
    status: MeasureStatus
    message: str | None = None
    runtime_ms: RuntimeStats | None = None
    correctness: Correctness = Field(default_factory=Correctness)
    resources: ResourceUsage = Field(default_factory=ResourceUsage)
    device: DeviceProvenance
    cost: MeasureCost
    flags: list[str] = Field(
        default_factory=list,
        description="what qualifies the result: noise_target_not_reached, runs_capped_by_max_runs, "
        "runs_capped_by_max_seconds, too_few_runs_for_interval, below_physical_floor (faster than the memory "
        "traffic allows) and events_disagree_with_wall_clock (suspect: no verdict is decided, no model learns "
        "and no forecast is verified from such a measurement), clock_throttled, "
        "max_seconds_lowered_to_budget (no max_seconds given, and the ledger had less left than the default "
        "cap), timeout_under_lowered_cap (a timeout under a cap below the server's) and reference_failed (the "
        "reference kernel failed, not this one): neither is learned as the kernel's failure",
    )
    measurement_id: int | None = None


# ---------------------------------------------------------------- forecasts

Verdict = Literal["faster", "slower", "unsure"]
DecidedBy = Literal["forecast", "measurement", "cache"]


class CandidateForecast(BaseModel):
    id: str
    p_faster: float = Field(
        description="probability that this candidate is faster than the baseline if both compile and run (the "
        "mass of speedup_bins above 1); a chance that either fails is counted in confidence and the verdict, "
        "and said in the rationale"
    )
    speedup_bins: list[float] = Field(description="8 probabilities over log2 speedup bins (see bins)")
    expected_speedup: float = Field(
        description="t(baseline) / t(candidate), expected (geometric mean of the forecast distribution)"
    )
    verdict: Verdict = Field(
        description="faster / slower than the baseline, or unsure; for a measured pair (decided_by measurement "
        "or cache) unsure means the speedup's 95% interval includes 1"
    )
    decided_by: DecidedBy = Field(
        description="what settled the verdict: forecast (no GPU used), measurement (both kernels measured in "
        "this call) or cache (both measured before, free)"
    )
    rationale: str
    confidence: float = Field(
        description=(
            "calibrated probability of the more likely direction, either kernel's chance of failing to compile "
            "or run counted (a kernel that runs beats one that fails): what the verdict's threshold is "
            "compared with; max(p_faster, 1 - p_faster) when neither may fail"
        )
    )
    measured_speedup: float | None = Field(
        default=None,
        description="t(baseline) / t(candidate) as measured, where both kernels ran (decided_by "
        "measurement or cache); None otherwise",
    )


class ForecasterInfo(BaseModel):
    name: str
    version: str
    components: list[str] = Field(default_factory=list)
    answered: list[str] | None = Field(
        default=None,
        description="compare_kernels: the components that answered this call's forecasts (a configured one "
        "missing was skipped, see notes; none when every pair was answered from measurements)",
    )


class CompareResult(BaseModel):
    """What `compare_kernels` returns."""

    baseline: str
    hardware: str
    hardware_known: bool = Field(
        description="whether the GPU is in the specification table (gpu-specs resource); false: forecast "
        "without hardware-specific features, see notes"
    )
    candidates: list[CandidateForecast]
    ranking: list[str] = Field(
        description="all ids, fastest first (by expected speedup; a kernel measured failing, or more likely "
        "than not to fail, after every one that runs): the best guess now. To choose what to "
        "measure next in a search, use measure_next (measuring ranking's head every time gets stuck)"
    )
    measure_next: list[str] = Field(
        description="ids worth measuring, most valuable first (the chance and size of beating the fastest "
        "kernel measured so far among this call's families, the baseline's included; with nothing measured, the "
        "baseline): "
        "unsure and faster candidates, and slower ones whose wide forecast still leaves a real expected gain; "
        "while the baseline's tuning family has fewer than 10 measurements, its configurations come in a "
        "random order (a random start: too few points to rank by)"
    )
    forecaster: ForecasterInfo
    target_error: float
    gpu_seconds_charged: float = 0.0
    measurements: list[MeasureResult] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    bins: list[str] = Field(default_factory=list, description="the 8 bin labels, in log2 speedup")
