"""The launch a Python source gives its kernel from Python: CuPy's `kernel(grid, block, args)`, PyCUDA's
`func(*args, block=..., grid=...)`, and Triton's `kernel[grid](*args, BLOCK=..., num_warps=...)` (or the
`kernel.run(*args, grid=grid, warmup=False)` it calls).

host_launch reads `<<<grid, block>>>` in C++ (a .cu file's host code, the wrapper in a load_inline string); a
CuPy or PyCUDA kernel is launched by a Python call instead, and without that launch the static prior knows
neither its block size (occupancy, waves) nor how many threads share the work. A launch is read from the calls
of a name bound to the kernel (`k = cp.RawKernel(code, "relu")`, `f = mod.get_function("relu")`, or
`self.k = ...`; a function's `global k; k = cp.RawKernel(...)` binds the module's k, one more binding of it beside
the module's own; a placeholder `k = None` is none, never launched), of the naming call itself, or of a getter's
call (`get()(grid, block, args)`, `k = get()`: a function the name is bound to alone, plain or under functools'
`cache` / `lru_cache` (by any name it is imported as), returning the kernel, a handle of it, or another such call;
a method's, `self.get()`, one under any other decorator, a generator or a coroutine is not read: no launch), when
each dimension works out to a whole number from:

- integer literals, and names given one value in the function making the call, else in the module;
- the workload's `problem` sizes and scalar `args` by name (the function's parameters are its callers': only the
  workload says them, or a default no call in the module passes, of a function the module uses only by calling
  it: `_Callers.defaults`; or the one constant every call passes, by position or keyword, a default counting for
  a call leaving it out: `_launch(x, out, 256)` from the entry's forward, a literal, an expression of them, a
  module constant bound once and nowhere else; not of the entry itself, a dunder method or `forward`, a function
  decorated, named in a string (`getattr`), taking `*args` / `**kwargs`, calling itself, or called unpacking
  its arguments: `_Callers._agreed`; one the function sets itself, `n //= 2`, is none of these; nor the
  workload's where a call passes it another value, `f(cp.zeros(32))`: `_Callers.forwarded`; a buffer every
  call passes one made like the workload's has its shape, `out = cp.empty_like(x); f(x, out)`:
  `_Callers.shaped_like`; of a Triton kernel entry, its module's own test code, a self-test or a benchmark,
  passes no such other value: `_Callers._tested`), and a buffer argument's `x.size`, `x.numel()`, `len(x)`,
  `x.shape[i]`, `x.size(i)`;
- `+ - * // % << >>`, `min`, `max`, `int(...)`, `math.ceil(a / b)`, and `cdiv` / `triton.cdiv`.

An array made like another (`out = torch.empty_like(x)`, `x.clone()`) has that one's shape. Anything else (a name
assigned twice, or bound otherwise: an import, a def, `except ... as`, a value a function gives it through `global`;
a float, a value known only at run time, calls that disagree) leaves that part unknown. Nothing is run.

A Triton kernel (`@triton.jit`: the entry itself, or the one kernel a wrapper sent as the entry launches once) is
launched as programs of num_warps warps (`triton_launch`; a `.run` with `warmup=True` compiles and launches
nothing): the grid a tuple, or a grid function (`lambda meta: ...`, `def grid(meta)`, defaults read where it is
made) whose `meta` holds the launch's arguments by the kernel's parameter names, its defaults (a literal or a
module constant) for those the launch leaves out; num_warps the launch's, else 4, Triton's default. What
`@triton.autotune` picks is known where every config agrees, what `@triton.heuristics` sets never; any other
decorator, `**kwargs`, or num_ctas other than 1 (clusters: more blocks than programs) leaves it unknown. Its shared
memory is the compiler's choice: unknown. A launch through another name for it (`k = kernel; k[grid](...)`) is one
of its launches; one held otherwise (`self.k = kernel`, `launch(kernel, x)`, a table) may be launched anywhere: its
launch unknown. A launch in a lambda (`do_bench(lambda: kernel[grid](...))`) is one like any other, of a Triton or
any other kernel; not in one bound to a name nothing else names (`warm = lambda: k(...)`, never called:
`_Module.unused_lambdas`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from forecaster_mcp.forecast import features
from forecaster_mcp.forecast.host_launch import (
    MAX_DEPTH,
    MAX_SITES,
    Dim3,
    SourceLaunch,
    _agreed,
    _valid_block,
    _valid_grid,
    _WorkloadNames,
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
        self,
        body: list[ast.stmt],
        params: frozenset[str],
        outer: _Scope | None,
        declared: frozenset[str],
        nonlocals: frozenset[str] = frozenset(),
    ) -> None:
        self.params = params
        # Whether its parameters are what callers not seen pass (a lambda's): never the workload's by name.
        self.unseen_callers = False
        self.outer = outer
        self.declared = declared
        # The names some `nonlocal` declares (a part of `declared`): the module's, passed to its scope alone.
        self.nonlocals: frozenset[str] = outer.nonlocals if outer is not None else nonlocals
        self.assigned: dict[str, list[ast.expr | None]] = {}  # None: changed in a way that is not read
        # A grid function's parameters with defaults: each read where the function is made (`lambda meta, t=n:`).
        self.given: dict[str, tuple[ast.expr, _Scope]] = {}
        # A function's parameters whose defaults no call in the module passes (`_Callers.defaults`), read where it
        # is made; unknown where the workload's size of that name says otherwise.
        self.defaults: dict[str, tuple[ast.expr, _Scope]] = {}
        # A function's parameters some call in the module passes other than as the workload's of that name (`f(x)`
        # from the entry, `x` the entry's own): not the workload's (`_Callers.forwarded`).
        self.passed: frozenset[str] = frozenset()
        # Those of them a buffer made like the workload's of another name is passed (`out = cp.empty_like(x);
        # f(x, out)`: f's out is x's shape), by that name (`_Callers.shaped_like`).
        self.like: dict[str, str] = {}
        self.functions: dict[
            str, list[ast.FunctionDef | ast.AsyncFunctionDef]
        ] = {}  # Triton's `def grid(meta)`
        # Its calls, and the functions, lambdas and classes it defines, in order: what `_calls` visits, read in this
        # walk.
        self.visited: list[ast.Call | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda] = []
        # A function's bindings of the names it declares `global`: the module's, credited to it (`_Module`).
        self.globals: dict[str, list[ast.expr | None]] = {}
        declared_global: set[str] = set()
        if outer is None:
            for name in declared:  # `global n` / `nonlocal n` somewhere: the module's n set from a function
                self.assigned[name] = [None]
        for node in _own_nodes(body):
            if isinstance(
                node, ast.Call | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
            ):
                self.visited.append(node)
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
            elif isinstance(node, ast.Global) and outer is not None:
                declared_global.update(node.names)
            elif isinstance(node, ast.Global | ast.Nonlocal):
                # `nonlocal n`: unknown already (`declared`), once more as this function's own.
                for name in node.names:
                    self._unknown(name)
            elif isinstance(node, features.BINDERS):
                # An import, a def or class, `except E as n`, `case n:`, `case [*n]`, `case {**n}`.
                for name in features.bindings(node):
                    self._unknown(name)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.functions.setdefault(node.name, []).append(node)
        for name in declared_global:
            # `global n`: each n it binds is the module's, none its own (a lookup of n here goes on to the module);
            # but a `global n` of its parameter n (a source Python refuses, though ast parses it) is one it sets.
            self.globals[name] = self.assigned.pop(name, [])
            self.functions.pop(name, None)
            if name in params:
                self._unknown(name)
        if outer is not None:
            # A function's own n is its own beside another's `global n` (the module's), but `nonlocal n` somewhere
            # may be in a function inside it: set from there. Only the names it binds (a parameter too) are looked
            # at (each scope taking every declared name made thousands of functions each declaring one a quadratic
            # read).
            for name in (self.assigned.keys() | params) & self.nonlocals:
                self._unknown(name)

    def sets(self, name: str) -> bool:
        """Whether this function sets its parameter `name` itself: its body binds it, or a function in it may
        (`nonlocal name` somewhere). A `global name` is never a parameter's: Python refuses it in the parameter's
        own function, and in any other it names the module's."""
        return name in self.assigned or name in self.nonlocals

    def binds(self, name: str) -> bool:
        return name in self.params or name in self.given or name in self.assigned

    def binder(self, name: str) -> _Scope | None:
        """The scope `name` is read from here: this one or the nearest around it that binds it; None for none."""
        scope: _Scope | None = self
        while scope is not None and not scope.binds(name):
            scope = scope.outer
        return scope

    def sole_def(self, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The one def this scope binds `name` to, where nothing else binds it; None otherwise."""
        defs = self.functions.get(name, [])
        return defs[0] if len(defs) == 1 and self.assigned.get(name) == [None] else None

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

    def __init__(self, scope: _Scope, names: _WorkloadNames) -> None:
        self.scope = scope
        self.names = names  # the workload's sizes and buffer shapes by name
        self.meta: _Meta | None = None  # a Triton grid function's `meta`, while its grid is read
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
        if (name in scope.given or name in scope.params) and scope.sets(name):
            # A parameter its own function sets (`n = 4096`, `n //= 2`, `if n > m: n = m`): whether the launch sees
            # its callers' value, its default or the function's is not known here (host_launch's `changed`).
            raise _Unknown
        if name in scope.given:
            return self._value_in(*scope.given[name], depth)
        workload = self.names.size(name)
        if name in scope.params and scope.unseen_callers:
            raise _Unknown  # `f = lambda n: k(...); f(1024)`: not the workload's n
        if name in scope.passed:
            workload = None  # `f(32)`, `f(x.size)`: the caller's, not the workload's n
        if name in scope.params:
            default = None
            if name in scope.defaults:
                try:
                    default = self._value_in(*scope.defaults[name], depth)
                except _Unknown:
                    pass  # `block=None`: the workload's, if it says
            if workload is None:
                if default is None:
                    raise _Unknown  # the caller's: only the workload could say
                return default
            if default is not None and workload != default:
                raise _Unknown
            return workload
        values = scope.assigned.get(name)
        if values is None:
            if scope.outer is not None:
                return self._name(name, scope.outer, depth)
            if workload is not None:
                return workload
            raise _Unknown
        if len(values) != 1 or values[0] is None:
            raise _Unknown
        value = self._value_in(values[0], scope, depth)
        # A test size the source sets (`n = 1 << 20`) is not the size the kernel is forecast at, when the workload
        # sizes that name otherwise.
        if workload is not None and workload != value:
            raise _Unknown
        return value

    def _value_in(self, node: ast.expr, scope: _Scope, depth: int) -> int:
        """`node`'s value read where it is written."""
        outer, self.scope = self.scope, scope
        try:
            return self.value(node, depth)
        finally:
            self.scope = outer

    def _shape(self, name: str) -> list[int]:
        # The workload's buffer is the function's parameter, or a name the source never binds: one it binds is its
        # own (`x = x.reshape(-1, 4)`, a test's `x = cp.zeros(1 << 20)`), of a shape the workload does not say,
        # unless it is made like another (`out = torch.empty_like(x)`, `x.clone()`): that one's.
        scope: _Scope | None = self.scope
        for _ in range(MAX_DEPTH):
            scope = scope.binder(name) if scope is not None else None
            if scope is None or (name in scope.params and not scope.sets(name)):
                if scope is not None and (scope.unseen_callers or name in scope.passed):
                    # `f = lambda x: k(...); f(cp.zeros(1024))`, `def f(x)` called `f(cp.zeros(32))`: not the
                    # workload's x; `out = cp.empty_like(x); f(x, out)`: f's out is the workload's x's shape
                    if scope.unseen_callers or name not in scope.like:
                        raise _Unknown
                    name = scope.like[name]
                shape = self.names.shape(name)
                if shape is None:
                    raise _Unknown
                return shape
            value: ast.expr | None
            if name in scope.given and not scope.sets(name):  # one its grid function sets: the body's
                value, scope = scope.given[name]
            else:
                # Set in its function (`sets`): a grid function's given one, nonlocal elsewhere, is in no list.
                values = scope.assigned.get(name, [])
                value = values[0] if len(values) == 1 else None
            like = _made_like(value)
            if like is None:
                raise _Unknown
            name = like
        raise _Unknown

    def _subscript(self, node: ast.Subscript, depth: int) -> int:
        base = node.value
        meta = self.meta
        if (
            meta is not None
            and isinstance(base, ast.Name)
            and base.id == meta.name
            and self.scope is meta.scope
        ):
            # A Triton grid function's `meta["BLOCK_SIZE"]`
            key = node.slice
            if not (isinstance(key, ast.Constant) and type(key.value) is str):
                raise _Unknown
            found = meta.values.get(key.value)
            if found is None:
                raise _Unknown
            if isinstance(found, int):
                return found
            # Each `meta['a']` is the same argument: read once (a grid of thousands of them, each of an argument
            # of thousands of terms, took seconds).
            memo = key.value
            if memo not in meta.read:
                meta.read[memo] = None  # `meta['a']` in the argument of `a` itself: not known
                try:
                    meta.read[memo] = self._value_in(*found, depth + 1)
                except _Unknown:
                    pass
            value = meta.read[memo]
            if value is None:
                raise _Unknown
            return value
        # `x.shape[0]`
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

    def dims(self, node: ast.expr, number: bool = True) -> Dim3 | None:
        """A launch dimension: a tuple or list of one to three numbers, a number (x; not with `number` False), or
        a name given one."""
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
            return (self.value(node), 1, 1) if number else None
        except _Unknown:
            return None
        finally:
            self.scope = outer


def _assigned(name: str, scope: _Scope | None) -> tuple[ast.expr, _Scope] | None:
    """The one value `name` is given where `scope` sees it, with the scope giving it; None for a parameter, a name
    given none or several."""
    while scope is not None:
        if name in scope.given:
            # A grid function's defaulted parameter its body sets: the default or the body's (`_name_value`).
            return scope.given[name] if not scope.sets(name) else None
        if name in scope.defaults:
            return scope.defaults[name]
        if name in scope.params:
            return None
        values = scope.assigned.get(name)
        if values is not None:
            value = values[0] if len(values) == 1 else None
            return (value, scope) if value is not None else None
        scope = scope.outer
    return None


# Made with another array's shape: torch's, CuPy's or NumPy's `empty_like(x)` and its kin, `x.clone()`, `x.copy()`.
_LIKE = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"})
_COPIES = frozenset({"clone", "copy"})


def _made_like(value: ast.expr | None) -> str | None:
    """The name of the array `value` has the shape of (`torch.empty_like(x)`, `x.clone()`, `x` itself), else None."""
    if isinstance(value, ast.Name):
        return value.id
    if not isinstance(value, ast.Call):
        return None
    func = value.func
    called = _last_name(func)
    if called in _LIKE and value.args and isinstance(value.args[0], ast.Name):
        # NumPy's and CuPy's `zeros_like(x, shape=...)` is of another shape.
        return value.args[0].id if all(k.arg != "shape" for k in value.keywords) else None
    if called in _COPIES and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id if not value.args and not value.keywords else None
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


def _is_none(value: ast.expr | None) -> bool:
    """Whether `value` is `None` as written: a handle's placeholder (`k = None` until set up), never launched (a
    call of it raises), so no binding a launch that runs can be made through."""
    return isinstance(value, ast.Constant) and value.value is None


def _handle_values(values: Iterable[ast.expr | None]) -> list[str | None]:
    """The kernels a handle's bindings name (`_bound_kernel`), its `None` placeholders left out."""
    return [_bound_kernel(v) for v in values if not _is_none(v)]


def _attribute_handles(read: _Module) -> dict[tuple[int, str], list[str | None]]:
    """What `self.k = ...` binds, by the class it is bound in (its id; 0 outside any) and `self.k`: the kernel each
    assignment names, None for one naming none (`self.k = None`, a placeholder: none)."""
    out: dict[tuple[int, str], list[str | None]] = {}
    for node, owner in read.nodes:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and (name := _dotted(target)) is not None:
                    out.setdefault((owner, name), []).extend(_handle_values([node.value]))
    return out


def _agreed_kernel(answers: Iterable[bool | None]) -> bool | None:
    """Whether values each of which is the kernel (True), is not (False) or may be (None) are: True where all are,
    False where none is or may be (none at all), else None."""
    found = set(answers)
    return False if found <= {False} else True if found == {True} else None


# functools' caches: a function so decorated returns what its body returns.
_CACHES = frozenset({"cache", "lru_cache"})


def _caches(decorator: ast.expr, modules: Collection[str], caches: Collection[str]) -> bool:
    """Whether `decorator` is functools' `cache` or `lru_cache` (`@functools.lru_cache(maxsize=None)`, `@cache`),
    functools going by `modules` (`import functools as ft`: `@ft.cache`) and those caches by `caches` (`from
    functools import lru_cache as lru`: `@lru`): `_functools_caches`."""
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(node, ast.Attribute):
        return node.attr in _CACHES and isinstance(node.value, ast.Name) and node.value.id in modules
    return isinstance(node, ast.Name) and node.id in caches


def _functools_caches(read: _Module) -> tuple[frozenset[str], frozenset[str]]:
    """The names functools goes by (`import functools`, `import functools as ft`), and those its `cache` and
    `lru_cache` go by (`from functools import cache`, `lru_cache as lru`), each where the module binds that name
    there alone: `from functools import wraps as cache`, `import fasttools as functools`, or a `cache` bound
    otherwise too, is none of them."""
    bound: dict[str, int] = {}
    for node, _ in read.nodes:
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound[node.id] = bound.get(node.id, 0) + 1
        elif isinstance(node, features.BINDERS):
            for name in features.bindings(node):
                bound[name] = bound.get(name, 0) + 1
    modules, names = _imported_names(read, "functools")
    return (
        frozenset(n for n in modules if bound.get(n) == 1),
        frozenset(n for n, name in names.items() if name in _CACHES and bound.get(n) == 1),
    )


def _sites(
    read: _Module, kernel: str, defaults: bool = True, entry: str | None = None
) -> Iterator[tuple[ast.Call, _Scope, bool]]:
    """Each call that may launch `kernel`, with the scope it is made in and whether it surely does. A handle
    (`k`, `self.k`) is the kernel its scope binds it to: `k` by Python's scopes (another function's `k` bound to
    another kernel, or a parameter `k`, is not it), `self.k` by the class binding it, else by every binding of
    it; one bound to this kernel and to another (or to something else) may launch either. A binding to `None` is
    no launch's (`_is_none`). `defaults`, `entry`: `_calls`'."""
    attributes = _attribute_handles(read)
    anywhere: dict[str, list[str | None]] = {}
    for (_, name), values in attributes.items():
        anywhere.setdefault(name, []).extend(values)

    # Each handle's answer by where it is bound (its scope, kept here so that no other takes its id; or its class)
    # and its name: read once, not at each call (a handle rebound before each of its 3,300 calls read all its
    # bindings at each, 10 s for 54 KB).
    named: dict[tuple[_Scope, str], bool | None] = {}
    dotted_in: dict[tuple[int, str], bool | None] = {}
    getters: dict[int, bool | None] = {}  # a getter's answer by its def (`read` keeps it, so its id)
    functools, caches = _functools_caches(read)

    def value(node: ast.expr | None, scope: _Scope, depth: int) -> bool | None:
        """Whether a handle's binding, or what a getter returns, is the kernel (None: maybe)."""
        if isinstance(node, ast.Call):
            # The naming call itself, `cp.RawKernel(code, "relu")`, else a getter's, `get()`.
            bound = _bound_kernel(node)
            return bound == kernel if bound is not None else getter(node, scope, depth)
        return by_name(node.id, scope, depth) if isinstance(node, ast.Name) else False

    def by_name(handle: str, scope: _Scope, depth: int) -> bool | None:
        found: _Scope | None = scope
        while found is not None and handle not in found.params and handle not in found.assigned:
            found = found.outer
        if found is None or handle in found.params:
            return False  # never bound here, or the caller's (`def launch(kern, ...)`): not read
        if (found, handle) not in named:
            if depth >= MAX_DEPTH:
                # Names bound to names (or getters' calls) past this many: not read, so may be the kernel. Not
                # False: the answers read before this one are kept, and one of them is not "no kernel".
                return None
            named[found, handle] = False  # bound to itself (`k = k`): no kernel of its own
            bindings = found.assigned[handle]
            named[found, handle] = _agreed_kernel(
                value(v, found, depth + 1) for v in bindings if not _is_none(v)
            )
        return named[found, handle]

    def getter(call: ast.Call, scope: _Scope, depth: int) -> bool | None:
        """`get()`: what the function `get` returns, where the source binds that name to it alone and it is
        plain or cached (functools' `cache`, `lru_cache`), not a generator's or a coroutine's."""
        func = call.func
        binding = scope.binder(func.id) if isinstance(func, ast.Name) else None
        defined = binding.sole_def(func.id) if binding is not None and isinstance(func, ast.Name) else None
        if (
            binding is None
            or not isinstance(defined, ast.FunctionDef)
            or not all(_caches(d, functools, caches) for d in defined.decorator_list)
        ):
            return False
        if id(defined) not in getters:
            if depth >= MAX_DEPTH:
                return None  # as a name's
            getters[id(defined)] = False  # returning its own call (`return get()`): no kernel of its own
            own = list(_own_nodes(defined.body))
            if any(isinstance(n, ast.Yield | ast.YieldFrom) for n in own):
                return False
            inner = _Scope(defined.body, _parameters(defined.args), binding, binding.declared)
            returned = [n.value for n in own if isinstance(n, ast.Return) and not _is_none(n.value)]
            getters[id(defined)] = _agreed_kernel(value(v, inner, depth + 1) for v in returned)
        return getters[id(defined)]

    def handle(func: ast.expr, scope: _Scope, owner: int) -> bool | None:
        if isinstance(func, ast.Call | ast.Name):
            return value(func, scope, 0)
        dotted = _dotted(func)
        if dotted is None or "." not in dotted:
            return False
        # Bound in its class, else in a base class or from outside: any binding of it.
        key = (owner, dotted)
        if key not in dotted_in:
            dotted_in[key] = _agreed_kernel(
                b == kernel for b in attributes.get(key, anywhere.get(dotted, []))
            )
        return dotted_in[key]

    for call, scope, owner in _calls(read, defaults, entry):
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _PREPARED_CALLS:
            func = func.value  # PyCUDA's f.prepared_call(grid, block, ...): a launch of f
        launches = handle(func, scope, owner)
        if launches is not False:
            yield call, scope, launches is True


class _Module:
    """A module as read: its nodes, each with the class it is in (its id; 0 outside any), walked once for every pass
    that reads them all (a 56 KB module of 700 functions was walked nine times a read), and its scope."""

    def __init__(self, module: ast.Module) -> None:
        self.tree = module
        self.kernel_names: dict[str, tuple[frozenset[str], bool]] = {}  # `_kernel_names`, by kernel
        self._unused: set[int] | None = None  # `unused_lambdas`
        # In ast.walk's order (breadth first), the class each is in carried along.
        self.nodes: list[tuple[ast.AST, int]] = []
        # The functions saying `global` (theirs, not one inside them), and the names a class body declares so.
        declaring: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        in_classes: set[str] = set()
        queue: deque[tuple[ast.AST, int, ast.AST]] = deque([(module, 0, module)])
        while queue:
            node, owner, scope = queue.popleft()
            self.nodes.append((node, owner))
            if isinstance(node, ast.Global):
                if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                    declaring[id(scope)] = scope
                elif isinstance(scope, ast.ClassDef):
                    in_classes.update(node.names)
            inner = id(node) if isinstance(node, ast.ClassDef) else owner
            within = (
                node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else scope
            )
            queue.extend((child, inner, within) for child in ast.iter_child_nodes(node))
        nonlocals = frozenset(
            name for node, _ in self.nodes if isinstance(node, ast.Nonlocal) for name in node.names
        )
        # A class body's `global n` binds the module's n from a body not read here: set elsewhere, unknown; so is
        # any n a `nonlocal` names.
        self.top = _Scope(module.body, frozenset(), None, nonlocals | in_classes, nonlocals)
        top = self.top
        for function in declaring.values():
            # What a function binds a name it declares `global` to is the module's binding of that name: one more
            # beside the module's own, read as any name bound more than once is. A value is read in the scope that
            # gives it, not the module's: one is credited as written only where that scope does not matter (a
            # kernel its literal names, `cp.RawKernel(src, "relu")`); any other is a value set at run time.
            declarer = _Scope(function.body, _parameters(function.args), top, top.declared)
            for name, values in declarer.globals.items():
                top.assigned.setdefault(name, []).extend(
                    v if _bound_kernel(v) is not None or _is_none(v) else None for v in values
                )

    def unused_lambdas(self) -> set[int]:
        """The lambdas (their ids) bound by `name = lambda ...` in a function or the module, not a class body, to a
        name nothing else in the module names: no other use of the name (a call, passed on, `del`, `global`),
        attribute of it (`self.name`) or string of it (`getattr(m, "name")`), and no `eval`, `exec`, `locals`,
        `globals` or `vars` anywhere. Never called, they launch nothing. Read once a module."""
        if self._unused is not None:
            return self._unused
        in_classes = {
            id(statement)
            for node, _ in self.nodes
            if isinstance(node, ast.ClassDef)
            for statement in node.body
        }
        bound: dict[str, list[ast.Lambda]] = {}
        named: dict[str, int] = {}
        for node, _ in self.nodes:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Lambda)
                and id(node) not in in_classes
            ):
                bound.setdefault(node.targets[0].id, []).append(node.value)
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if name is not None:
                named[name] = named.get(name, 0) + 1
            elif isinstance(node, ast.Global | ast.Nonlocal):
                for declared in node.names:
                    named[declared] = named.get(declared, 0) + 2
        if any(named.get(dynamic) for dynamic in ("eval", "exec", "locals", "globals", "vars")):
            self._unused = set()
        else:
            self._unused = {
                id(value)
                for name, values in bound.items()
                if named.get(name, 0) == len(values)  # the binding targets alone
                for value in values
            }
        return self._unused


def _parameters(a: ast.arguments) -> frozenset[str]:
    return frozenset(p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]) | frozenset(
        p.arg for p in (a.vararg, a.kwarg) if p is not None
    )


def _defaulted(a: ast.arguments) -> list[tuple[int | None, ast.arg, ast.expr | None]]:
    """The parameters that may have a default: each positional one given one, with its position, and each
    keyword-only one (position None), its default None where it has none."""
    positional = [*a.posonlyargs, *a.args]
    first = len(positional) - len(a.defaults)
    return [
        *((first + i, p, d) for i, (p, d) in enumerate(zip(positional[first:], a.defaults, strict=True))),
        *((None, p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)),
    ]


def _last_name(node: ast.AST) -> str | None:
    """The name a name or an attribute ends in (`run`, `self.launch`: `launch`); None for any other node."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


# Calls of one name past this many are not read (each defaulted parameter of each function of that name is checked
# against each): its defaults are taken as passed.
_MAX_CALLS = 64


class _Callers:
    """The module's calls by the name called (`run(...)`, `self.run(...)`; a class's instance called, `model(x)`,
    as its `__call__` and `forward`), each with whether a method's `self` is bound before the call's own
    arguments (a call through an attribute, `self.launch(x)`, or of an instance). Read once a module."""

    def __init__(self, read: _Module, kernel_entry: bool = False) -> None:
        self.calls: dict[str, list[tuple[ast.Call, bool]]] = {}
        # The entry is a Triton kernel: the harness launches it and calls none of the module's functions, so calls
        # made by the module's own test code (`_tested`) pass none of its arguments.
        self.kernel_entry = kernel_entry
        nodes = [node for node, _ in read.nodes]
        classes = {n.name for n in nodes if isinstance(n, ast.ClassDef)}
        # Those whose instances may be called: a `__call__` or `forward` of its own, or a base's.
        callable_classes = {
            n.name
            for n in nodes
            if isinstance(n, ast.ClassDef)
            and (
                n.bases
                or n.keywords
                or any(
                    isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and f.name in ("__call__", "forward")
                    for f in n.body
                )
            )
        }
        self.classes = classes
        # How many times each name is bound anywhere (a module constant passed is bound once, by the module), and
        # the one-word strings (`getattr(m, "_launch")`, `__all__`: a function named there may be called so).
        self.bound: dict[str, int] = {}
        self.strings: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                self.bound[node.id] = self.bound.get(node.id, 0) + 1
            elif isinstance(node, features.BINDERS):
                for name in features.bindings(node):
                    self.bound[name] = self.bound.get(name, 0) + 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                self.strings.add(node.value)
        self._module = _Evaluator(read.top, _WorkloadNames(None))  # the module's constants, no workload
        # The names (`m`) and attributes (`self.m`: `m`) bound to an instance: `Op()`, or what its methods give
        # (`Op().cuda()`, `.to(device).eval()`: torch's return the instance itself; calls of another's counted too
        # leave only fewer defaults read).
        instances: set[str] = set()
        assigned: set[int] = set()  # the values bound so
        for node in nodes:
            if isinstance(node, ast.Assign | ast.AnnAssign) and _makes_instance(node.value, classes):
                assigned.add(id(node.value))
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    named = _dotted(target)
                    if named is not None:
                        instances.add(named.rsplit(".", 1)[-1])
        # Names used otherwise than called (`partial(run, block=128)`, `map(run, xs)`, `torch.compile(run)`,
        # `self.fn = self.launch`, an instance passed, `torch.compile(m)`): their callers are not the calls of the
        # name, so their defaults are not known. A name reached through (`m.eval()`, `k[grid]`) is no such use.
        self.escaped: set[str] = set()
        reached = {
            id(n.func) if isinstance(n, ast.Call) else id(n.value)
            for n in nodes
            if isinstance(n, ast.Call | ast.Attribute | ast.Subscript)
        }
        naming = _naming_a_class(nodes)
        for node in nodes:
            if id(node) in reached or id(node) in assigned:
                continue
            if isinstance(node, ast.Call) and _makes_instance(node, callable_classes):
                # An instance made (or moved: `Op().cuda()`) and passed on, not bound (`torch.compile(Op())`,
                # `[Op().to(device)]`): called with anything.
                self.escaped.update(("__call__", "forward"))
                continue
            if not isinstance(getattr(node, "ctx", None), ast.Load):
                continue
            used = _last_name(node)
            if used is not None:
                self.escaped.add(used)
                if isinstance(node, ast.Name) and (
                    used in instances or (used in callable_classes and id(node) not in naming)
                ):
                    # An instance, or a class held by another name (`M = Op; M()(x, 128)`, `make(Op)`): its
                    # instances called where not seen.
                    self.escaped.update(("__call__", "forward"))
        self._binders = _call_binders(read.tree)
        self._forwarded: dict[tuple[int, str], bool] = {}
        self._shaped: dict[tuple[int, str], str | None] = {}
        for node in nodes:
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            named = _last_name(func)
            if named is not None:
                self.calls.setdefault(named, []).append((node, isinstance(func, ast.Attribute)))
            fresh = isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id in classes
            if named in instances or fresh:  # `m(x)`, `self.m(x)`, `Op()(x)`
                for method in ("__call__", "forward"):  # torch's Module.__call__ calls forward
                    self.calls.setdefault(method, []).append((node, True))

    def defaults(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool, entry: str | None = None
    ) -> dict[str, ast.expr]:
        """The values the module's calls of `node` give its parameters: the defaults no call of its name passes
        (by position, by keyword, or maybe, through `*args` / `**kwargs`), and the one constant every call passes
        (`_agreed`). One called from outside only keeps its defaults: an agent's entry (`forward(x)`, `run(x)`) is
        called with the workload's inputs, its tuning knobs (`block=256`) left as written. Calls are matched by
        name alone: another function of that name's calls count too. A name used otherwise than called
        (`partial(run, block=128)`, `callbacks = [run]`) keeps no default: who calls it, with what, is not seen.
        `method`: `node` is a method; `entry`: the name the harness calls (its self-test's calls are not its)."""
        calls = self.calls.get(node.name, [])
        if len(calls) > _MAX_CALLS or node.name in self.escaped:
            return {}
        out: dict[str, ast.expr] = {}
        for index, param, default in _defaulted(node.args):
            if default is None or any(
                _passes(call, index, param.arg, method and bound) for call, bound in calls
            ):
                continue
            out[param.arg] = default
        out.update(self._agreed(node, method, entry, calls, out))
        return out

    def forwarded(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
        param: str,
        method: bool,
        entry: str | None,
        depth: int = 0,
    ) -> bool:
        """Whether `node`'s parameter `param` is the workload's of that name (`x`, `n`) as far as the module's calls
        say: where the function is called from outside (the entry, a dunder method or `forward`; or none of its
        calls seen), or every call passes it a name the source leaves unbound (its caller's, as the entry's
        parameters), or a parameter of that name of the caller's own that is the workload's (`def run(x): f(x)`).
        Not where a call passes anything else (`f(cp.zeros(32))`, `f(x[:32])`, `f(*xs)`), leaves it out, or passes
        a name the caller sets (`x = cp.zeros(32); f(x)`); nor of a lambda, or a function used otherwise than
        called (`map(f, xs)`): who calls it, with what, is not seen. `method`: `node` is a method."""
        if isinstance(node, ast.Lambda):
            return False
        name = node.name
        if _called_from_outside(name, entry):
            return True
        calls = self._counted(name)
        if not calls:
            return True
        if name in self.escaped or len(calls) > _MAX_CALLS or depth >= MAX_DEPTH:
            return False
        key = (id(node), param)
        if key in self._forwarded:
            return self._forwarded[key]
        self._forwarded[key] = False  # passed on to itself (`def f(x): f(x)`): none of its own
        named, index = _slot(node, param)
        if not named:
            return False  # `*args`, `**kwargs`
        for call, bound in calls:
            if _unpacks(call):
                return False
            passed = _argument(call, index, param, method and bound)
            if not isinstance(passed, ast.Name) or not self._forwarded_at(
                call, passed.id, param, entry, depth
            ):
                return False
        self._forwarded[key] = True
        return True

    def _counted(self, name: str) -> list[tuple[ast.Call, bool]]:
        """The calls of `name` that say what its parameters are: all of them, but a Triton kernel entry's module's
        test code's (`_tested`)."""
        calls = self.calls.get(name, [])
        return [c for c in calls if not self._tested(c[0])] if self.kernel_entry else calls

    def _tested(self, call: ast.Call) -> bool:
        """Whether `call` is made by the module's own test code: at its top level (a self-test, guarded by
        `__name__ == "__main__"` or not), or in a module-level function (a lambda in it too) no call of its name is
        made to and not used otherwise (`@triton.testing.perf_report def benchmark(...)`, run as
        `benchmark.run()`). Not in a class, a method, a nested function, or a function called by name (`main()`:
        it may be a wrapper passing its own arguments on: `add(x)` calling `_add(x[:32])`)."""
        binder = self._binders.get(id(call))
        while binder is not None and isinstance(binder.function, ast.Lambda):
            binder = binder.outer
        if binder is None:
            return False
        function = binder.function
        if function is None:
            return binder.outer is None  # the module's own statements, not a class body's
        module = binder.outer
        return (
            isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
            and not binder.method
            and module is not None
            and module.function is None
            and module.outer is None
            and function.name not in self.calls
            and function.name not in self.escaped
        )

    def _forwarded_at(self, call: ast.Call, name: str, param: str, entry: str | None, depth: int) -> bool:
        """Whether the name `name` `call` passes its callee's `param` is the workload's `param`: a name no scope
        around the call binds (what the source leaves to its caller, as the entry's parameters), or a parameter
        `param` of the function making it that is (`forwarded`)."""
        binder = self._binders.get(id(call))
        if binder is None:
            return False  # a call not placed (a decorator's, a default's)
        for _ in range(_MAX_NESTING):
            if binder is None:
                return True
            if name in binder.binds:
                return False
            if name in binder.params:
                function = binder.function
                return (
                    name == param
                    and function is not None
                    and self.forwarded(function, name, binder.method, entry, depth + 1)
                )
            binder = binder.outer
        return False

    def shaped_like(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
        param: str,
        method: bool,
        entry: str | None,
        depth: int = 0,
    ) -> str | None:
        """The workload's buffer `node`'s parameter `param` has the shape of, as far as the module's calls say: its
        own name's where it is the workload's (`forwarded`); else the one every call passes a name made like
        (`out = cp.empty_like(x); _launch(x, out)`, x the entry's: x's). None where a call passes anything else
        (`cp.empty(32)`, `cp.empty_like(x[:32])`, a name bound twice or otherwise), or calls disagree."""
        if self.forwarded(node, param, method, entry, depth):
            return param
        if isinstance(node, ast.Lambda):
            return None
        calls = self._counted(node.name)
        if not calls or node.name in self.escaped or len(calls) > _MAX_CALLS or depth >= MAX_DEPTH:
            return None
        key = (id(node), param)
        if key in self._shaped:
            return self._shaped[key]
        self._shaped[key] = None  # passed on to itself: none of its own
        named, index = _slot(node, param)
        if not named:
            return None  # `*args`, `**kwargs`
        found: set[str | None] = set()
        for call, bound in calls:
            if _unpacks(call):
                return None
            passed = _argument(call, index, param, method and bound)
            found.add(
                self._shaped_at(call, passed.id, entry, depth) if isinstance(passed, ast.Name) else None
            )
            if None in found or len(found) > 1:
                return None
        like = found.pop() if found else None
        self._shaped[key] = like
        return like

    def _shaped_at(self, call: ast.Call, name: str, entry: str | None, depth: int) -> str | None:
        """The workload's buffer the name `name` `call` passes has the shape of: its own where no scope around the
        call binds it, the one its function's parameter of that name has (`shaped_like`), or, one the scope binds
        once to an array made like another (`_made_like`), that one's."""
        binder = self._binders.get(id(call))
        if binder is None:
            return None  # a call not placed (a decorator's, a default's)
        for _ in range(_MAX_NESTING):
            if binder is None:
                return name
            if name in binder.binds:
                name_ = _made_like(binder.values.get(name))
                if name_ is None:
                    return None
                name = name_  # read where the scope binds it: from this scope out
                continue
            if name in binder.params:
                function = binder.function
                if function is None:
                    return None
                return self.shaped_like(function, name, binder.method, entry, depth + 1)
            binder = binder.outer
        return None

    def _agreed(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef,
        method: bool,
        entry: str | None,
        calls: list[tuple[ast.Call, bool]],
        left_out: Collection[str],
    ) -> dict[str, ast.expr]:
        """The parameters of `node` every call passes as one constant (`_launch(x, out, 256)`, `block=BLOCK`,
        `2 * WARP`; a default counting for a call leaving it out), not left out by all of them (`left_out`). None
        where the function may be called otherwise than by the calls of its name: the entry, a dunder method or
        `forward` (called through its instance), one decorated, named in a string (`getattr`), or taking `*args` /
        `**kwargs`; nor where a call unpacks its arguments, calls it from its own body, or (of a method) not
        through an instance (`Op.launch(self, ...)`), nor (of a function) through an attribute."""
        a = node.args
        name = node.name
        if (
            not calls
            or _called_from_outside(name, entry)
            or node.decorator_list
            or name in self.strings
            or a.vararg is not None
            or a.kwarg is not None
        ):
            return {}
        span = ((node.lineno, node.col_offset), (node.end_lineno or 0, node.end_col_offset or 0))
        for call, _ in calls:
            func = call.func
            if (
                span[0] <= (call.lineno, call.col_offset) <= span[1]
                or _unpacks(call)
                or (method and not isinstance(func, ast.Attribute))
                or (method and isinstance(func, ast.Attribute) and _dotted(func.value) in self.classes)
                or (not method and not isinstance(func, ast.Name))
            ):
                return {}
        positional = [*a.posonlyargs, *a.args]
        defaults: dict[str, ast.expr] = {p.arg: d for _, p, d in _defaulted(a) if d is not None}
        params = [(i, p) for i, p in enumerate(positional)] + [(None, p) for p in a.kwonlyargs]
        out: dict[str, ast.expr] = {}
        for index, param in params[1:] if method else params:
            if param.arg in left_out:
                continue
            values: set[int | None] = set()
            for call, _ in calls:
                passed = _argument(call, index, param.arg, method)
                given = passed if passed is not None else defaults.get(param.arg)
                values.add(self._constant(given) if given is not None else None)
                if None in values or len(values) > 1:
                    break
            else:
                value = values.pop()
                if value is not None:
                    out[param.arg] = ast.Constant(value)
        return out

    def _constant(self, node: ast.expr) -> int | None:
        """`node`'s value where it is a constant of the module: literals, and names only the module binds, once
        (`BLOCK = 256`; a function's own BLOCK, or a parameter of that name anywhere, may be the one passed)."""
        if any(isinstance(n, ast.Name) and self.bound.get(n.id) != 1 for n in ast.walk(node)):
            return None
        try:
            return self._module.value(node)
        except _Unknown:
            return None


class _Binder:
    """The names a call sees where it is made: its function's (a lambda's; None: the module's or a class body's)
    parameters and the names it binds otherwise, whether that function is a method, and the scope around it."""

    def __init__(
        self,
        function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | None,
        params: frozenset[str],
        binds: frozenset[str],
        method: bool,
        outer: _Binder | None,
        in_class: bool,
    ) -> None:
        self.function = function
        self.params = params
        self.binds = binds
        # The names it binds once, by `name = value` alone (`out = torch.empty_like(x)`): that value.
        self.values: dict[str, ast.expr] = {}
        self.method = method
        self.outer = outer
        # The scope a function defined here sees around it: a class body's names are not seen from its methods.
        self.enclosing: _Binder | None = outer if in_class else self


def _call_binders(module: ast.Module) -> dict[int, _Binder]:
    """Each call's `_Binder`, by the call's id: the module's, a function's, a lambda's or a class body's own calls
    (not a decorator's or a default's: those none)."""
    out: dict[int, _Binder] = {}
    pending: list[
        tuple[
            list[ast.stmt],
            ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | None,
            bool,
            bool,
            _Binder | None,
        ]
    ] = [(module.body, None, False, False, None)]
    while pending:
        body, function, method, in_class, outer = pending.pop()
        own = list(_own_nodes(body))
        counted: dict[str, int] = {}
        values: dict[str, ast.expr] = {}
        for node in own:
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                counted[node.id] = counted.get(node.id, 0) + 1
            elif isinstance(node, features.BINDERS):
                for name in features.bindings(node):
                    counted[name] = counted.get(name, 0) + 1
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                values[node.targets[0].id] = node.value
        params = _parameters(function.args) if function is not None else frozenset()
        binder = _Binder(function, params, frozenset(counted), method, outer, in_class)
        binder.values = {name: value for name, value in values.items() if counted[name] == 1}
        for node in own:
            if isinstance(node, ast.Call):
                out[id(node)] = binder
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                pending.append((node.body, node, in_class, False, binder.enclosing))
            elif isinstance(node, ast.Lambda):
                pending.append(([ast.Expr(node.body)], node, False, False, binder.enclosing))
            elif isinstance(node, ast.ClassDef):
                pending.append((node.body, None, False, True, binder.enclosing))
    return out


# Calls a class is named in without making or holding an instance of it.
_CLASS_CHECKS = frozenset({"super", "isinstance", "issubclass"})


def _naming_a_class(nodes: Iterable[ast.AST]) -> set[int]:
    """The nodes (by id) that name a class without holding it: a base of another class (its instances are that
    class's), an annotation, an argument of `super`, `isinstance`, `issubclass`."""
    out: set[int] = set()
    for node in nodes:
        roots: list[ast.expr | None] = []
        if isinstance(node, ast.ClassDef):
            roots = [*node.bases]
        elif isinstance(node, ast.arg | ast.AnnAssign):
            roots = [node.annotation]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            roots = [node.returns]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CLASS_CHECKS:
            roots = [*node.args]
        for root in roots:
            if root is not None and id(root) not in out:  # one walked already (`isinstance(isinstance(...))`)
                out.update(id(n) for n in ast.walk(root))
    return out


def _makes_instance(value: ast.expr | None, classes: Collection[str]) -> bool:
    """Whether `value` makes an instance of one of the module's `classes` (`Op(...)`), or calls a method of one
    (`Op().cuda()`, `Op().to(device).eval()`)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        value = value.func.value
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes


def _argument(call: ast.Call, index: int | None, name: str, bound: bool) -> ast.expr | None:
    """The argument `call` passes the parameter `name` (at position `index`; None: keyword only), the callee's
    `self` bound first when `bound`; None where it leaves it out (no `*args` or `**kwargs` in it)."""
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    at = index - bound if index is not None else None
    return call.args[at] if at is not None and 0 <= at < len(call.args) else None


def _slot(node: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> tuple[bool, int | None]:
    """Whether `param` is a named parameter of `node` (not what `*args` / `**kwargs` collect), and its place among
    the positional ones (None: keyword-only)."""
    a = node.args
    positional = [p.arg for p in [*a.posonlyargs, *a.args]]
    if param in positional:
        return True, positional.index(param)
    return any(p.arg == param for p in a.kwonlyargs), None


def _unpacks(call: ast.Call) -> bool:
    """Whether `call` unpacks arguments (`f(*xs)`, `f(**kw)`): which parameters they are is not seen."""
    return any(isinstance(arg, ast.Starred) for arg in call.args) or any(k.arg is None for k in call.keywords)


def _called_from_outside(name: str, entry: str | None) -> bool:
    """Whether a function of that name is called from outside the module's calls: the entry (the harness's),
    `forward` (torch's Module.__call__ calls it) or a dunder method (Python's)."""
    return name == entry or name == "forward" or (name.startswith("__") and name.endswith("__"))


def _passes(call: ast.Call, index: int | None, name: str, bound: bool) -> bool:
    """Whether `call` may pass the parameter `name` (at position `index`; None: keyword only), the callee's `self`
    bound first when `bound`."""
    if _unpacks(call) or any(k.arg == name for k in call.keywords):
        return True
    return index is not None and len(call.args) + bound > index


def _calls(
    read: _Module, defaults: bool = True, entry: str | None = None, kernel_entry: bool = False
) -> Iterator[tuple[ast.Call, _Scope, int]]:
    """Each call in the module's functions, lambdas and classes, with the scope it is made in and the class it is
    made in (its id; 0 outside any). Without `defaults`, no scope has its `defaults` read (the
    module's calls, `_Callers`): only a value needs them, not whether a call is made. `entry`: the name the
    harness calls, whose parameters no call in the module gives a constant (`_Callers.defaults`); `kernel_entry`:
    it is a Triton kernel, whose module's test code's calls say nothing of the workload (`_Callers._tested`)."""
    top = read.top
    callers: _Callers | None = None

    def visit(
        nodes: Iterable[ast.AST], scope: _Scope, owner: int, in_class: bool
    ) -> Iterator[tuple[ast.Call, _Scope, int]]:
        nonlocal callers
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = _Scope(node.body, _parameters(node.args), scope, top.declared)
                if defaults and inner.params:
                    callers = _Callers(read, kernel_entry) if callers is None else callers
                    inner.defaults = {
                        name: (default, scope)
                        for name, default in callers.defaults(node, in_class, entry).items()
                        if not inner.sets(name)  # `block = 128` in the function: not the default
                    }
                    inner.passed = frozenset(
                        p for p in inner.params if not callers.forwarded(node, p, in_class, entry)
                    )
                    for p in inner.passed:
                        like = callers.shaped_like(node, p, in_class, entry)
                        if like is not None:
                            inner.like[p] = like
                yield from visit(inner.visited, inner, owner, False)
            elif isinstance(node, ast.Lambda):
                if id(node) in read.unused_lambdas():
                    continue  # `f = lambda n: k(...)`, f never named again: never called
                # `do_bench(lambda: kernel[grid](...))`: a launch like any other, its parameters its callers' (no
                # default of them read, nor the workload's of their names: who calls it, with what, is not seen).
                inner = _Scope([ast.Return(node.body)], _parameters(node.args), scope, top.declared)
                inner.unseen_callers = True
                yield from visit(inner.visited, inner, owner, False)
            elif isinstance(node, ast.ClassDef):
                # A class body is no scope of its own here (its names are not read): walked for its calls alone.
                yield from visit(_own_nodes(node.body), scope, id(node), True)
            elif isinstance(node, ast.Call):
                yield node, scope, owner

    yield from visit(top.visited, top, 0, False)


# PyCUDA's launches of a prepared function: grid and block first (a stream third for the async one).
_PREPARED_CALLS = frozenset({"prepared_call", "prepared_async_call", "prepared_timed_call"})


def python_launches(module: ast.Module, kernel: str) -> bool:
    """Whether the module's Python calls `kernel` (read or not), or may."""
    return next(_sites(_Module(module), kernel, defaults=False), None) is not None


def python_launch(
    module: ast.Module, kernel: str, workload: Workload | None, entry: str | None = None
) -> SourceLaunch | None:
    """The launch the Python calls of `kernel` (module doc) agree on; None where none is read. `entry`: the
    function or class the harness calls (its parameters are its caller's, whatever the module's own calls pass)."""
    names = _WorkloadNames(workload)
    grids: list[Dim3 | None] = []
    blocks: list[Dim3 | None] = []
    shared: list[int | None] = []
    for count, (call, scope, surely) in enumerate(_sites(_Module(module), kernel, entry=entry)):
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


# ---------------------------------------------------------------- Triton: `kernel[grid](...)`

# Triton's defaults: a program is 4 warps, and one CTA (num_ctas: a cluster of CTAs per program, Hopper on).
_TRITON_WARPS = 4
_TRITON_CTAS = 1
# Autotuner configs past this many are not read: the launch is the one of them it picks at run time.
_MAX_CONFIGS = 256


class _Meta:
    """What a Triton grid function's `meta` holds while its grid is read: the launch's arguments by the kernel's
    parameter names (each with the scope it is written in), a value the decorators set (an int), or None for a
    value chosen at run time."""

    def __init__(self, scope: _Scope, name: str, values: Mapping[str, tuple[ast.expr, _Scope] | int | None]):
        self.scope = scope  # the grid function's: `meta` is its parameter
        self.name = name
        self.values = values
        self.read: dict[str, int | None] = {}  # the values read of `values`, None: not known


class _Decorated:
    """What a Triton kernel's decorators set: `tuned` the values they give launch arguments (autotune's, where
    every config agrees; None where chosen at run time: configs that disagree, heuristics), `opaque` when which
    arguments they set is not known (configs made at run time)."""

    def __init__(self) -> None:
        self.tuned: dict[str, int | None] = {}
        self.opaque = False


def _triton_names(read: _Module) -> tuple[frozenset[str], dict[str, str]]:
    """The names triton goes by (`triton`, `import triton as tr`), and those imported from it (`from triton import
    jit as J`: J -> jit)."""
    modules, names = _imported_names(read, "triton")
    return modules | {"triton"}, names


def _imported_names(read: _Module, module: str) -> tuple[frozenset[str], dict[str, str]]:
    """The names the top-level `module` is imported as (`import functools`, `import functools as ft`), and those
    imported from it (`from functools import lru_cache as lru`: lru -> lru_cache)."""
    modules: set[str] = set()
    names: dict[str, str] = {}
    for node, _ in read.nodes:
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == module)
        elif isinstance(node, ast.ImportFrom) and node.module == module and not node.level:
            names.update((a.asname or a.name, a.name) for a in node.names)
    return frozenset(modules), names


def _triton_call(node: ast.expr, modules: frozenset[str], names: Mapping[str, str]) -> str | None:
    """Which of triton's names `node` is (`triton.jit`, `jit` imported from it, `triton.jit(...)`), else None."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
        return node.attr
    return names.get(node.id) if isinstance(node, ast.Name) else None


def _triton_kernel(
    read: _Module, entry: str, names: _WorkloadNames
) -> tuple[ast.FunctionDef, _Decorated] | None:
    """The module's Triton kernel `entry` (a `@triton.jit` function the module binds that name to alone) and what
    its decorators set; None for any other (numba's `@cuda.jit` is launched `kernel[blocks, threads]`), or one
    another decorator wraps (its launch may be anything)."""
    kernel = read.top.sole_def(entry)
    if not isinstance(kernel, ast.FunctionDef):
        return None
    modules, imported = _triton_names(read)
    decorated = _Decorated()
    evaluator = _Evaluator(read.top, names)
    called = [_triton_call(d, modules, imported) for d in kernel.decorator_list]
    if "jit" not in called:
        return None
    for decorator, name in zip(kernel.decorator_list, called, strict=True):
        if name == "autotune" and isinstance(decorator, ast.Call):
            _read_configs(read, decorator, evaluator, decorated, modules, imported)
        elif name == "heuristics" and isinstance(decorator, ast.Call):
            # Each value a function of the arguments, called at run time.
            table = decorator.args[0] if decorator.args else None
            keys = table.keys if isinstance(table, ast.Dict) else [None]
            if any(not isinstance(k, ast.Constant) or type(k.value) is not str for k in keys):
                decorated.opaque = True
            decorated.tuned.update(
                (k.value, None) for k in keys if isinstance(k, ast.Constant) and type(k.value) is str
            )
        elif name != "jit":
            return None
    return kernel, decorated


def _read_configs(
    read: _Module,
    decorator: ast.Call,
    evaluator: _Evaluator,
    decorated: _Decorated,
    modules: frozenset[str],
    imported: Mapping[str, str],
) -> None:
    """`@triton.autotune(configs=[triton.Config({...}, num_warps=...), ...])`: a value every config gives alike is
    known, any other chosen at run time."""
    node = _configs_of(decorator)
    if isinstance(node, ast.Name):
        # A list named once, and used only as autotune's configs: not one changed (`CONFIGS.append(...)`,
        # `CONFIGS[0] = ...`, `prune(CONFIGS)`) after it is written.
        found = _assigned(node.id, evaluator.scope)
        changed = found is None or _used_otherwise(read, node.id, modules, imported)
        node = None if changed or found is None else found[0]
    if not isinstance(node, ast.List | ast.Tuple) or not 1 <= len(node.elts) <= _MAX_CONFIGS:
        decorated.opaque = True
        return
    configs: list[dict[str, int | None]] = []
    for config in node.elts:
        if not isinstance(config, ast.Call) or _triton_call(config, modules, imported) != "Config":
            decorated.opaque = True
            return
        keywords: dict[str | None, ast.expr] = {k.arg: k.value for k in config.keywords}
        # Config(kwargs, num_warps=4, num_stages=3, num_ctas=1, ...): its options by position too.
        keywords.update(
            (k, v) for k, v in zip(_CONFIG_POSITIONS, config.args[1:], strict=False) if k is not None
        )
        table = keywords.pop("kwargs", config.args[0] if config.args else None)
        if (
            None in keywords
            or not isinstance(table, ast.Dict)
            or any(isinstance(a, ast.Starred) for a in config.args)
        ):
            decorated.opaque = True
            return
        pairs: list[tuple[str, ast.expr]] = []
        for key, value in zip(table.keys, table.values, strict=True):
            if not isinstance(key, ast.Constant) or type(key.value) is not str:  # `**other`
                decorated.opaque = True
                return
            # Its own num_warps and num_ctas (4 and 1 unless given) are the launch's, not a meta-parameter's.
            if key.value not in ("num_warps", "num_ctas"):
                pairs.append((key.value, value))
        pairs += [(k, v) for k, v in keywords.items() if k in ("num_warps", "num_ctas")]
        given: dict[str, int | None] = {"num_warps": _TRITON_WARPS, "num_ctas": _TRITON_CTAS}
        if len(config.args) > len(_CONFIG_POSITIONS):
            given["num_ctas"] = None  # Triton 2.0's Config had no num_ctas: the fourth was its pre_hook
        for name, value in pairs:
            try:
                given[name] = evaluator.value(value)
            except _Unknown:
                given[name] = None
        configs.append(given)
    for option in {k for c in configs for k in c}:
        decorated.tuned[option] = _agreed([c.get(option) for c in configs])


# triton.Config's parameters after its kwargs, by position (num_stages: not read).
_CONFIG_POSITIONS = ("num_warps", None, "num_ctas")


def _configs_of(autotune: ast.Call) -> ast.expr | None:
    """An autotune call's configs: its keyword, else its first argument."""
    node = next((k.value for k in autotune.keywords if k.arg == "configs"), None)
    return autotune.args[0] if node is None and autotune.args else node


def _used_otherwise(read: _Module, name: str, modules: frozenset[str], imported: Mapping[str, str]) -> bool:
    """Whether the module reads `name` other than as an autotune's configs (`@triton.autotune(configs=name)`)."""
    as_configs = reads = 0
    for node, _ in read.nodes:
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
            reads += 1
        elif isinstance(node, ast.Call) and _triton_call(node, modules, imported) == "autotune":
            configs = _configs_of(node)
            as_configs += isinstance(configs, ast.Name) and configs.id == name
    return reads != as_configs


def _grid_function(
    node: ast.expr | ast.FunctionDef | ast.AsyncFunctionDef, scope: _Scope
) -> tuple[ast.expr, _Scope, str] | None:
    """A grid function's returned expression, the scope it is read in and its `meta` parameter's name: `lambda
    meta: (...)` or a `def` whose last statement returns the grid, Triton calling it with meta alone; None for
    anything else."""
    if isinstance(node, ast.Lambda):
        body: list[ast.stmt] = []
        returned: ast.expr | None = node.body
    elif isinstance(node, ast.FunctionDef) and not node.decorator_list and node.body:
        body = node.body
        last = body[-1]
        returned = last.value if isinstance(last, ast.Return) else None
        own = list(_own_nodes(body))
        if sum(isinstance(n, ast.Return) for n in own) != 1 or any(
            isinstance(n, ast.Yield | ast.YieldFrom | ast.Await) for n in own
        ):
            return None
    else:
        return None
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    if returned is None or not positional or len(a.defaults) < len(positional) - 1 or None in a.kw_defaults:
        return None
    meta = positional[0].arg
    rest = frozenset(p.arg for p in (a.vararg, a.kwarg) if p is not None)
    inner = _Scope(body, frozenset({meta}) | rest, scope, scope.declared)
    inner.given = {p.arg: (d, scope) for _, p, d in _defaulted(a) if p.arg != meta and d is not None}
    if meta in inner.assigned:
        return None
    return returned, inner, meta


def _triton_grid(
    evaluator: _Evaluator, node: ast.expr, meta: Mapping[str, tuple[ast.expr, _Scope] | int | None]
) -> Dim3 | None:
    """A Triton launch's grid in programs: a tuple (or a name given one), or a grid function of `meta`."""
    scope = evaluator.scope
    target: ast.expr | ast.FunctionDef | ast.AsyncFunctionDef = node
    for _ in range(MAX_DEPTH):
        if not isinstance(target, ast.Name):
            break
        found = _assigned(target.id, scope)
        if found is None:
            # `def grid(meta): ...`, the name bound to nothing else
            binding = scope.binder(target.id)
            defined = binding.sole_def(target.id) if binding is not None else None
            if binding is None or defined is None:
                return None
            target, scope = defined, binding
            break
        target, scope = found
    function = _grid_function(target, scope)
    outer = evaluator.scope, evaluator.meta
    try:
        if function is None:
            evaluator.scope = scope
            return evaluator.dims(target, number=False) if isinstance(target, ast.Tuple | ast.List) else None
        returned, evaluator.scope, name = function
        evaluator.meta = _Meta(evaluator.scope, name, meta)
        return evaluator.dims(returned, number=False)
    finally:
        evaluator.scope, evaluator.meta = outer


def triton_launches(module: ast.Module, entry: str) -> bool:
    """Whether the module's Python launches its Triton kernel `entry` (`entry[grid](...)`), or the one its wrapper
    `entry` launches, read or not."""
    read = _Module(module)
    found = _entry_kernel(read, entry, _WorkloadNames(None))
    return found is not None and next(_triton_sites(read, found[0], defaults=False), None) is not None


def _entry_kernel(
    read: _Module, entry: str, names: _WorkloadNames
) -> tuple[str, ast.FunctionDef, _Decorated] | None:
    """The Triton kernel `entry` runs, its definition and what its decorators set (`_triton_kernel`): itself, a
    `@triton.jit` function; or, a Python wrapper (`def add(x, y): ... add_kernel[grid](...)`), the one kernel it
    launches once (`_wrapped_kernel`). None for any other."""
    found = _triton_kernel(read, entry, names)
    if found is not None:
        return entry, *found
    kernel = _wrapped_kernel(read.top, entry)
    found = _triton_kernel(read, kernel, names) if kernel is not None else None
    return (kernel, *found) if kernel is not None and found is not None else None


def _wrapped_kernel(top: _Scope, entry: str) -> str | None:
    """The kernel a module's undecorated function `entry` launches (`name[grid](...)`), where it makes one such
    call, of a module-level name, run once: not in a loop, a comprehension or a function of its own (a grid
    function's body may hold no launch). None for any other: two kernels, a subscript call of anything else
    (`ops[0](x)`), a launch run many times, the wrapper's own `add_kernel`."""
    wrapper = top.sole_def(entry)
    if wrapper is None or wrapper.decorator_list:
        return None
    inner = _Scope(wrapper.body, _parameters(wrapper.args), top, top.declared)
    launched: list[str] = []
    stack: list[tuple[ast.AST, bool]] = [(statement, False) for statement in wrapper.body]
    while stack:
        node, repeated = stack.pop()
        launcher = _launcher(node.func) if isinstance(node, ast.Call) else None
        if launcher is not None:
            target = launcher[0]
            if repeated or not isinstance(target, ast.Name) or inner.binds(target.id):
                return None
            launched.append(target.id)
            if len(launched) > 1:
                return None
        repeated = repeated or isinstance(
            node,
            ast.For
            | ast.AsyncFor
            | ast.While
            | ast.ListComp
            | ast.SetComp
            | ast.DictComp
            | ast.GeneratorExp
            | ast.FunctionDef
            | ast.AsyncFunctionDef
            | ast.Lambda
            | ast.ClassDef,
        )
        stack.extend((child, repeated) for child in ast.iter_child_nodes(node))
    return launched[0] if launched else None


def _kernel_names(read: _Module, kernel: str) -> tuple[frozenset[str], bool]:
    """The names the module's Triton kernel `kernel` may go by (its own, and those a plain `k = kernel` binds to it
    or to such a name, anywhere), and whether it goes otherwise too, where launches of it are not read: one of
    those names used other than launched or reached through (`kernel[grid]`, `kernel.run`, `kernel.fn`), bound to
    an attribute (`self.k = kernel`) or put in anything else (`launch(kernel, x)`, `{"add": kernel}`), or a
    launcher of it made and not called there (`launch = kernel[grid]`). Read once a module and kernel."""
    if kernel in read.kernel_names:
        return read.kernel_names[kernel]
    reached: set[int] = set()
    bound_to: dict[str, list[str]] = {}  # a name -> the names `target = name` binds to it
    loads: list[ast.Name] = []
    launchers: list[ast.expr] = []  # `name[grid]`, `name.__getitem__(grid)`
    for node, _ in read.nodes:
        if isinstance(node, ast.Subscript | ast.Attribute):
            reached.add(id(node.value))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                launchers.append(node)
        elif isinstance(node, ast.Call):
            reached.add(id(node.func))
            if (launcher := _launcher(node)) is not None and isinstance(launcher[0], ast.Name):
                launchers.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                reached.add(id(node.value))
                bound_to.setdefault(node.value.id, []).append(node.targets[0].id)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads.append(node)
    names = {kernel}
    queue = [kernel]
    while queue:
        for alias in bound_to.get(queue.pop(), []):
            if alias not in names:
                names.add(alias)
                queue.append(alias)
    # A launcher not called where it is made (`launch = kernel[grid]`, `partial(kernel[grid], x)`) is held too.
    escapes = any(n.id in names and id(n) not in reached for n in loads) or any(
        (found := _launcher(s)) is not None
        and isinstance(found[0], ast.Name)
        and found[0].id in names
        and id(s) not in reached
        for s in launchers
    )
    read.kernel_names[kernel] = frozenset(names), escapes
    return read.kernel_names[kernel]


def _triton_sites(
    read: _Module, kernel: str, defaults: bool = True, entry: str | None = None
) -> Iterator[tuple[ast.Call, _Scope, bool]]:
    """The calls that may launch the module's Triton kernel `kernel`, each with the scope it is made in and whether
    it surely does: not a `kernel.run(..., warmup=True)`, which compiles it and launches nothing. A launch through
    another name for it (`k = kernel; k[grid](...)`, `_kernel_names`) is one where that name, where it is called,
    is bound to the kernel alone; one bound to it and to something else may be. `defaults`, `entry`: `_calls`'."""
    top = read.top
    names, _ = _kernel_names(read, kernel)
    for call, scope, _ in _calls(read, defaults, entry, kernel_entry=entry == kernel):
        func = call.func
        # `kernel[grid](...)`, or the JITFunction.run it calls: `kernel.run(..., grid=grid, warmup=False)`
        run = isinstance(func, ast.Attribute) and func.attr == "run"
        if isinstance(func, ast.Attribute) and run:
            if any(_is_true(k.value) for k in call.keywords if k.arg == "warmup"):
                continue
            func = func.value
        launcher = _launcher(func)  # `kernel[grid]`, `kernel.__getitem__(grid)`
        if launcher is None and not run:
            continue
        if launcher is not None:
            func = launcher[0]
        if not isinstance(func, ast.Name) or func.id not in names:
            continue
        if func.id == kernel:
            if scope.binder(kernel) is top:  # not a function's own `kernel`
                yield call, scope, True
            continue
        binder = scope.binder(func.id)
        if binder is None or func.id in binder.params or func.id in binder.given:
            continue  # not bound here, or a parameter: the caller's (`launch(kern, ...)`: the kernel escapes)
        values = [v for v in binder.assigned.get(func.id, []) if not _is_none(v)]
        aliases = [isinstance(v, ast.Name) and v.id in names for v in values]
        surely = (
            all(isinstance(v, ast.Name) and v.id == kernel for v in values) and binder.binder(kernel) is top
        )
        if surely and values:
            yield call, scope, True
        elif any(aliases) or None in values:
            yield call, scope, False


def _launcher(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """The kernel and grid of a Triton launcher, `kernel[grid]` or `kernel.__getitem__(grid)`; None for anything
    else."""
    if isinstance(node, ast.Subscript):
        return node.value, node.slice
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__getitem__"
        and len(node.args) == 1
        and not isinstance(node.args[0], ast.Starred)
        and not node.keywords
    ):
        return node.func.value, node.args[0]
    return None


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def triton_launch(module: ast.Module, entry: str, workload: Workload | None) -> SourceLaunch | None:
    """The launch the module's `kernel[grid](...)` and `kernel.run(..., grid=..., warmup=False)` calls of its
    Triton kernel agree on (module doc): `entry`, or the kernel its wrapper `entry` launches; the grid its
    programs, a block of num_warps warps (Triton's default 4; 32 threads a warp here, the GPU's warp size in
    features), its shared memory the compiler's (unknown). None where none is read."""
    names = _WorkloadNames(workload)
    read = _Module(module)
    found = _entry_kernel(read, entry, names)
    if found is None:
        return None
    kernel, definition, decorated = found
    a = definition.args
    parameters = [p.arg for p in [*a.posonlyargs, *a.args]]
    defaults = _kernel_defaults(a, read.top)
    grids: list[Dim3 | None] = []
    warps: list[int | None] = []
    if _kernel_names(read, kernel)[1]:
        grids.append(None)  # launched where not read: any launch
        warps.append(None)
    for count, (call, scope, surely) in enumerate(_triton_sites(read, kernel, entry=entry)):
        if count >= MAX_SITES:
            return None
        if not surely:
            grids.append(None)  # maybe another kernel's launch
            warps.append(None)
            continue
        evaluator = _Evaluator(scope, names)
        keywords = list(call.keywords)
        launcher = _launcher(call.func)
        if launcher is not None:
            grid_node: ast.expr | None = launcher[1]
        else:  # kernel.run(*args, grid, warmup, **kwargs), both by keyword
            given = {k.arg: k.value for k in keywords}
            warmup = given.get("warmup")  # not True: _triton_sites
            grid_node = given.get("grid")
            if not (isinstance(warmup, ast.Constant) and warmup.value is False):
                grid_node = None  # a warmup not known: launched or not
            keywords = [k for k in keywords if k.arg not in ("grid", "warmup")]
        if decorated.opaque or grid_node is None or any(k.arg is None for k in keywords):
            grids.append(None)  # `**cfg`, or configs made at run time: any argument may be set there
            warps.append(None)
            continue
        # What the launch leaves out is the parameter's default (Triton binds the call's arguments to the
        # signature), what it passes its own, what the decorators set theirs.
        meta: dict[str, tuple[ast.expr, _Scope] | int | None] = dict(defaults)
        for parameter, arg in zip(parameters, call.args, strict=False):
            if isinstance(arg, ast.Starred):
                break
            meta[parameter] = (arg, scope)
        meta.update((k.arg, (k.value, scope)) for k in keywords if k.arg is not None)
        meta.update(decorated.tuned)
        options = {
            key: _option(meta, key, default, evaluator)
            for key, default in (("num_warps", _TRITON_WARPS), ("num_ctas", _TRITON_CTAS))
        }
        w = options["num_warps"]
        warps.append(
            w if w is not None and w > 0 and w & (w - 1) == 0 else None
        )  # a power of two, or no launch
        grid = _triton_grid(evaluator, grid_node, meta) if options["num_ctas"] == 1 else None
        grids.append(_valid_grid(grid))
    if not grids:
        return None
    grid = _agreed(grids)
    agreed_warps = _agreed(warps)
    block = _valid_block((agreed_warps * 32, 1, 1)) if agreed_warps is not None else None
    if grid is None and block is None:
        return None
    return SourceLaunch(grid, block, None, agreed_warps if block is not None else None)


def _kernel_defaults(a: ast.arguments, top: _Scope) -> dict[str, tuple[ast.expr, _Scope] | int | None]:
    """A Triton kernel's parameter defaults, read in the module (`BLOCK_SIZE: tl.constexpr = 1024`, `= BLOCK`): a
    literal or a name; any other (`= make_block()`) a value not known. Not the launch's options (num_warps,
    num_ctas): a parameter of that name is no option."""
    out: dict[str, tuple[ast.expr, _Scope] | int | None] = {}
    for _, parameter, default in _defaulted(a):
        if default is None or parameter.arg in ("num_warps", "num_ctas"):
            continue
        plain = isinstance(default, ast.Name) or (
            isinstance(default, ast.Constant) and type(default.value) is int
        )
        out[parameter.arg] = (default, top) if plain else None
    return out


def _option(
    meta: Mapping[str, tuple[ast.expr, _Scope] | int | None], key: str, default: int, evaluator: _Evaluator
) -> int | None:
    """A launch option (num_warps, num_ctas): the decorators', else the call's, else Triton's default."""
    if key not in meta:
        return default
    found = meta[key]
    if found is None or isinstance(found, int):
        return found
    try:
        return evaluator._value_in(*found, 0)
    except _Unknown:
        return None
