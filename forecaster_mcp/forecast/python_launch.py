"""The launch a Python source gives its CUDA kernel from Python: CuPy's `kernel(grid, block, args)` and PyCUDA's
`func(*args, block=..., grid=...)`.

host_launch reads `<<<grid, block>>>` in C++ (a .cu file's host code, the wrapper in a load_inline string); a
CuPy or PyCUDA kernel is launched by a Python call instead, and without that launch the static prior knows
neither its block size (occupancy, waves) nor how many threads share the work. A launch is read from the calls
of a name bound to the kernel (`k = cp.RawKernel(code, "relu")`, `f = mod.get_function("relu")`, or
`self.k = ...`), or of the naming call itself, when each dimension works out to a whole number from:

- integer literals, and names given one value in the function making the call, else in the module;
- the workload's `problem` sizes and scalar `args` by name (the function's parameters are its callers': only the
  workload says them), and a buffer argument's `x.size`, `x.numel()`, `len(x)`, `x.shape[i]`, `x.size(i)`;
- `+ - * // % << >>`, `min`, `max`, `int(...)`, `math.ceil(a / b)`, and `cdiv` / `triton.cdiv`.

Anything else (a name assigned twice, or bound otherwise: an import, a def, `except ... as`, `global` in another
function; a float, a value known only at run time, calls that disagree) leaves that part unknown. Nothing is run.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Iterator, Mapping

from forecaster_mcp.forecast import features
from forecaster_mcp.forecast.host_launch import (
    MAX_DEPTH,
    MAX_SITES,
    Dim3,
    SourceLaunch,
    _agreed,
    _Names,
    _valid_block,
    _valid_grid,
)
from forecaster_mcp.models import Workload

_PY_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
}
_CEIL_DIV = frozenset({"cdiv", "ceil_div", "ceildiv", "div_up", "divup"})
_LIMIT = 2**64  # a launch dimension is at most 2^31 - 1: anything this big is no launch anyone means
# Expressions nested this deep, through names too, are not read: the evaluator recurses (about three frames a
# level), and `1 + 1 + ...` of 600 terms, 1.2 KB, went past Python's recursion limit of 1000. A launch nests a
# handful of levels.
_MAX_NESTING = 100


class _Unknown(Exception):
    """A value the source does not say plainly."""


class _Scope:
    """The names one function (or the module) assigns, with the function's parameters and the module around it."""

    def __init__(
        self, body: list[ast.stmt], params: frozenset[str], outer: _Scope | None, declared: frozenset[str]
    ) -> None:
        self.params = params
        self.outer = outer
        self.assigned: dict[str, list[ast.expr | None]] = {}  # None: changed in a way that is not read
        for name in declared:  # `global n` / `nonlocal n` somewhere: set from another function
            self.assigned[name] = [None]
        for node in _own_nodes(body):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._bind(node.target, node.value)
            elif isinstance(node, ast.AugAssign | ast.For | ast.AsyncFor | ast.NamedExpr | ast.comprehension):
                # `n += 1`, a loop variable, `(n := ...)`: set at run time. A comprehension's variable is its
                # own, but a launch in it would read this scope's: taken as unknown here.
                self._changed(node.target)
            elif isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if item.optional_vars is not None:
                        self._changed(item.optional_vars)
            elif isinstance(node, ast.Delete):
                for target in node.targets:
                    self._changed(target)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    self._unknown(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self._unknown(node.name)
            elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name is not None:
                self._unknown(node.name)  # `except E as n`, `case n:`, `case [*n]`
            elif isinstance(node, ast.MatchMapping) and node.rest is not None:
                self._unknown(node.rest)

    def _unknown(self, name: str) -> None:
        self.assigned.setdefault(name, []).append(None)

    def _changed(self, target: ast.expr) -> None:
        for name in _names_in(target):
            self._unknown(name)

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.assigned.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) else None
            starred = any(isinstance(t, ast.Starred) for t in target.elts)  # `*n, m = 1, 2`: n is [1]
            if values is not None and len(values) == len(target.elts) and not starred:
                for t, v in zip(target.elts, values, strict=True):
                    self._bind(t, v)
            else:
                self._changed(target)


def _names_in(target: ast.expr) -> Iterator[str]:
    for node in ast.walk(target):
        if isinstance(node, ast.Name):
            yield node.id


def _own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of `body`, not looking into the functions and classes it defines (their names are their own)."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


class _Evaluator:
    """Whole-number values of Python expressions in one scope, from the source and the workload."""

    def __init__(self, scope: _Scope, names: _Names) -> None:
        self.scope = scope
        self.names = names  # host_launch's reading of the workload: sizes and buffer shapes by name
        self._memo: dict[tuple[int, str], int | None] = {}
        self._nesting = 0  # value() calls open, through names too

    def value(self, node: ast.expr, depth: int = 0) -> int:
        if depth > MAX_DEPTH or self._nesting >= _MAX_NESTING:
            raise _Unknown
        self._nesting += 1
        try:
            result = self._value(node, depth)
        finally:
            self._nesting -= 1
        if not -_LIMIT <= result < _LIMIT:
            raise _Unknown
        return result

    def _value(self, node: ast.expr, depth: int) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return self._name(node.id, self.scope, depth)
        if isinstance(node, ast.BinOp):
            op = _PY_BINARY.get(type(node.op))
            if op is None:
                raise _Unknown
            a, b = self.value(node.left, depth), self.value(node.right, depth)
            if isinstance(node.op, ast.LShift | ast.RShift) and not 0 <= b < 64:
                raise _Unknown
            try:
                return op(a, b)
            except ArithmeticError as exc:
                raise _Unknown from exc
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = self.value(node.operand, depth)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.Subscript):
            return self._subscript(node, depth)
        if isinstance(node, ast.Attribute) and node.attr == "size" and isinstance(node.value, ast.Name):
            return math.prod(self._shape(node.value.id))  # a CuPy or NumPy array's element count
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise _Unknown

    def _name(self, name: str, scope: _Scope, depth: int) -> int:
        key = (id(scope), name)
        if key not in self._memo:
            self._memo[key] = None  # a name defined by itself (`n = n + 1` read back) is not known
            try:
                self._memo[key] = self._name_value(name, scope, depth + 1)
            except _Unknown:
                pass
        found = self._memo[key]
        if found is None:
            raise _Unknown
        return found

    def _name_value(self, name: str, scope: _Scope, depth: int) -> int:
        workload = self.names.workload_size(name)
        if name in scope.params:
            if workload is not None:
                return workload
            raise _Unknown  # the caller's: only the workload could say
        values = scope.assigned.get(name)
        if values is None:
            if scope.outer is not None:
                return self._name(name, scope.outer, depth)
            if workload is not None:
                return workload
            raise _Unknown
        if len(values) != 1 or values[0] is None:
            raise _Unknown
        outer, self.scope = self.scope, scope
        try:
            value = self.value(values[0], depth)
        finally:
            self.scope = outer
        # A test size the source sets (`n = 1 << 20`) is not the size the kernel is forecast at, when the workload
        # sizes that name otherwise.
        if workload is not None and workload != value:
            raise _Unknown
        return value

    def _shape(self, name: str) -> list[int]:
        # The workload's buffer is the function's parameter, or a name the source never binds: one it binds is its
        # own (`x = x.reshape(-1, 4)`, a test's `x = cp.zeros(1 << 20)`), of a shape the workload does not say.
        scope: _Scope | None = self.scope
        while scope is not None and name not in scope.params:
            if name in scope.assigned:
                raise _Unknown
            scope = scope.outer
        if scope is not None and name in scope.assigned:
            raise _Unknown
        shape = self.names.shape(name)
        if shape is None:
            raise _Unknown
        return shape

    def _subscript(self, node: ast.Subscript, depth: int) -> int:
        # `x.shape[0]`
        base = node.value
        if not (
            isinstance(base, ast.Attribute) and base.attr == "shape" and isinstance(base.value, ast.Name)
        ):
            raise _Unknown
        return _extent(self._shape(base.value.id), self.value(node.slice, depth))

    def _call(self, node: ast.Call, depth: int) -> int:
        if node.keywords:
            raise _Unknown
        func = node.func
        args = node.args
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, method = func.value.id, func.attr
            if method == "numel" and not args:
                return math.prod(self._shape(owner))  # torch
            if method == "size" and len(args) == 1:  # torch's x.size(i)
                return _extent(self._shape(owner), self.value(args[0], depth))
            if owner == "math" and method == "ceil" and len(args) == 1:
                inner = args[0]
                if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Div):
                    return _ceil_div(self.value(inner.left, depth), self.value(inner.right, depth))
                raise _Unknown
            if method in _CEIL_DIV and len(args) == 2:  # triton.cdiv(n, 256)
                return _ceil_div(self.value(args[0], depth), self.value(args[1], depth))
            raise _Unknown
        if not isinstance(func, ast.Name):
            raise _Unknown
        if func.id == "len" and len(args) == 1 and isinstance(args[0], ast.Name):
            return self._shape(args[0].id)[0]
        if func.id == "int" and len(args) == 1:
            return self.value(args[0], depth)
        if func.id in ("min", "max") and len(args) >= 2:
            values = [self.value(a, depth) for a in args]
            return min(values) if func.id == "min" else max(values)
        if func.id in _CEIL_DIV and len(args) == 2:
            return _ceil_div(self.value(args[0], depth), self.value(args[1], depth))
        raise _Unknown

    def dims(self, node: ast.expr) -> Dim3 | None:
        """A launch dimension: a tuple or list of one to three numbers, a number (x), or a name given one."""
        # A tuple a name is given is read in the scope that gives it (`BLOCK = (T,)` in the module: the module's T).
        scope = self.scope
        for _ in range(MAX_DEPTH):
            if not isinstance(node, ast.Name):
                break
            found = _assigned(node.id, scope)
            if found is None or not isinstance(found[0], ast.Tuple | ast.List):
                break
            node, scope = found
        outer, self.scope = self.scope, scope
        try:
            if isinstance(node, ast.Tuple | ast.List):
                if not 1 <= len(node.elts) <= 3:
                    return None
                parts = [self.value(e) for e in node.elts]
                full = parts + [1] * (3 - len(parts))
                return (full[0], full[1], full[2])
            return (self.value(node), 1, 1)
        except _Unknown:
            return None
        finally:
            self.scope = outer


def _assigned(name: str, scope: _Scope | None) -> tuple[ast.expr, _Scope] | None:
    """The one value `name` is given where `scope` sees it, with the scope giving it; None for a parameter, a name
    given none or several."""
    while scope is not None:
        if name in scope.params:
            return None
        values = scope.assigned.get(name)
        if values is not None:
            value = values[0] if len(values) == 1 else None
            return (value, scope) if value is not None else None
        scope = scope.outer
    return None


def _extent(shape: list[int], i: int) -> int:
    """`shape[i]`, Python's negative indices too; unknown past its dimensions."""
    if not -len(shape) <= i < len(shape):
        raise _Unknown
    return shape[i]


def _ceil_div(a: int, b: int) -> int:
    if b == 0:
        raise _Unknown
    return -(-a // b)


def _dotted(node: ast.expr) -> str | None:
    """`k` or `self.k` as a string; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _bound_kernel(value: ast.expr | None) -> str | None:
    """The kernel a value names (`cp.RawKernel(code, "relu")`, `mod.get_function("relu")`), else None."""
    return features.launched_name(value) if isinstance(value, ast.Call) else None


def _attribute_handles(module: ast.Module) -> dict[tuple[int, str], list[str | None]]:
    """What `self.k = ...` binds, by the class it is bound in (its id; 0 outside any) and `self.k`: the kernel each
    assignment names, None for one naming none."""
    out: dict[tuple[int, str], list[str | None]] = {}
    stack: list[tuple[ast.AST, int]] = [(module, 0)]
    while stack:
        node, owner = stack.pop()
        if isinstance(node, ast.ClassDef):
            owner = id(node)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and (name := _dotted(target)) is not None:
                    out.setdefault((owner, name), []).append(_bound_kernel(node.value))
        stack.extend((child, owner) for child in ast.iter_child_nodes(node))
    return out


def _names_kernel(bound: list[str | None], kernel: str) -> bool | None:
    """Whether a handle given these values is `kernel`: True, False, or None (`kernel` one of several)."""
    if kernel not in bound:
        return False
    return True if all(b == kernel for b in bound) else None


def _sites(module: ast.Module, kernel: str) -> Iterator[tuple[ast.Call, _Scope, bool]]:
    """Each call that may launch `kernel`, with the scope it is made in and whether it surely does. A handle
    (`k`, `self.k`) is the kernel its scope binds it to: `k` by Python's scopes (another function's `k` bound to
    another kernel, or a parameter `k`, is not it), `self.k` by the class binding it, else by every binding of
    it; one bound to this kernel and to another (or to something else) may launch either."""
    attributes = _attribute_handles(module)
    anywhere: dict[str, list[str | None]] = {}
    for (_, name), values in attributes.items():
        anywhere.setdefault(name, []).extend(values)
    declared = frozenset(
        name
        for node in ast.walk(module)
        if isinstance(node, ast.Global | ast.Nonlocal)
        for name in node.names
    )
    top = _Scope(module.body, frozenset(), None, declared)

    def handle(func: ast.expr, scope: _Scope, owner: int) -> bool | None:
        if isinstance(func, ast.Call):  # the naming call itself: `cp.RawKernel(code, "relu")(grid, ...)`
            return _bound_kernel(func) == kernel
        if isinstance(func, ast.Name):
            found: _Scope | None = scope
            while found is not None and func.id not in found.params and func.id not in found.assigned:
                found = found.outer
            if found is None or func.id in found.params:
                return False  # never bound here, or the caller's (`def launch(kern, ...)`): not read
            return _names_kernel([_bound_kernel(v) for v in found.assigned[func.id]], kernel)
        dotted = _dotted(func)
        if dotted is None or "." not in dotted:
            return False
        # Bound in its class, else in a base class or from outside: any binding of it.
        return _names_kernel(attributes.get((owner, dotted), anywhere.get(dotted, [])), kernel)

    def visit(body: list[ast.stmt], scope: _Scope, owner: int) -> Iterator[tuple[ast.Call, _Scope, bool]]:
        for node in _own_nodes(body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                params = frozenset(p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]) | frozenset(
                    p.arg for p in (a.vararg, a.kwarg) if p is not None
                )
                yield from visit(node.body, _Scope(node.body, params, scope, declared), owner)
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, scope, id(node))
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in _PREPARED_CALLS:
                    func = func.value  # PyCUDA's f.prepared_call(grid, block, ...): a launch of f
                launches = handle(func, scope, owner)
                if launches is not False:
                    yield node, scope, launches is True

    yield from visit(module.body, top, 0)


# PyCUDA's launches of a prepared function: grid and block first (a stream third for the async one).
_PREPARED_CALLS = frozenset({"prepared_call", "prepared_async_call", "prepared_timed_call"})


def python_launches(module: ast.Module, kernel: str) -> bool:
    """Whether the module's Python calls `kernel` (read or not), or may."""
    return next(_sites(module, kernel), None) is not None


def python_launch(module: ast.Module, kernel: str, workload: Workload | None) -> SourceLaunch | None:
    """The launch the Python calls of `kernel` (module doc) agree on; None where none is read."""
    names = _Names("", {}, workload)
    grids: list[Dim3 | None] = []
    blocks: list[Dim3 | None] = []
    shared: list[int | None] = []
    for count, (call, scope, surely) in enumerate(_sites(module, kernel)):
        if count >= MAX_SITES:
            return None
        evaluator = _Evaluator(scope, names)
        keywords: Mapping[str | None, ast.expr] = {k.arg: k.value for k in call.keywords}
        positional = list(call.args)
        prepared = isinstance(call.func, ast.Attribute) and call.func.attr in _PREPARED_CALLS
        if not surely:
            block_node = None  # a handle bound to this kernel and another: either's launch
        elif None in keywords:
            block_node = None  # `**cfg`: its grid, block or shared memory said at run time
        elif prepared:  # PyCUDA: f.prepared_call(grid, block, *args, shared_size=...)
            grid_node = positional[0] if positional else None
            block_node = positional[1] if len(positional) > 1 else None
            grid = evaluator.dims(grid_node) if grid_node is not None else None
            shared_node = keywords.get("shared_size")
        elif "block" in keywords and not keywords.keys() & {"args", "shared_mem"}:
            # PyCUDA: func(*args, block=(...), grid=(...), shared=...), its grid one block by default
            grid_node, block_node = keywords.get("grid"), keywords["block"]
            grid = evaluator.dims(grid_node) if grid_node is not None else (1, 1, 1)
            shared_node = keywords.get("shared")
        else:  # CuPy: kernel(grid, block, args, shared_mem=...), by position or keyword
            grid_node = keywords.get("grid", positional.pop(0) if positional else None)
            block_node = keywords.get("block", positional.pop(0) if positional else None)
            grid = evaluator.dims(grid_node) if grid_node is not None else None
            shared_node = keywords.get("shared_mem")
        if block_node is None:  # a launch not read is one that may disagree with the rest
            grids.append(None)
            blocks.append(None)
            shared.append(None)
            continue
        grids.append(_valid_grid(grid))
        blocks.append(_valid_block(evaluator.dims(block_node)))
        if shared_node is None:
            shared.append(0)
        else:
            try:
                shared.append(evaluator.value(shared_node))
            except _Unknown:
                shared.append(None)
    if not blocks:
        return None
    found = SourceLaunch(_agreed(grids), _agreed(blocks), _agreed(shared))
    return found if found.grid is not None or found.block is not None else None
