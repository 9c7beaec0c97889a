"""The MCP surface: three tools, a resource and a prompt over a `Service`.

Tool functions know MCP and the service, nothing of vendors or SQL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import difflib
import errno
import inspect
import io
import ipaddress
import json
import logging
import os
import re
import shlex
import signal
import socket
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import IO, Annotated, Any, TypeVar, cast, get_args

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations
from pydantic import AnyHttpUrl, BeforeValidator, Field, StrictBool, ValidationError

from forecaster_mcp import __version__, bins
from forecaster_mcp.errors import AgentError, OperatorError
from forecaster_mcp.forecast.engine import one_line
from forecaster_mcp.forecast.selective import MAX_TARGET_ERROR, MIN_TARGET_ERROR
from forecaster_mcp.hardware import specs
from forecaster_mcp.models import (
    MAX_CANDIDATES,
    MIN_CANDIDATES,
    MIN_MEASURE_SECONDS,
    CompareResult,
    Kernel,
    MeasureResult,
    Workload,
    candidate_count_problem,
)
from forecaster_mcp.reports import BudgetStatus, GpuSpecRow
from forecaster_mcp.server.arg_errors import compact_validation_error, field_names
from forecaster_mcp.server.http_answers import Reworded
from forecaster_mcp.service import Service
from forecaster_mcp.settings import Settings, host_key
from forecaster_mcp.store.db import damaged

log = logging.getLogger(__name__)
T = TypeVar("T")
_F = TypeVar("_F", bound=Callable[..., Any])

INSTRUCTIONS = """\
forecaster-mcp forecasts whether one GPU kernel is faster than another, says how sure it is, and measures on a
metered GPU budget only when asked. Workflow: call compare_kernels first (free) with all your candidates and the
current best as baseline; trust verdicts 'faster'/'slower' (their error rate is kept under target_error); measure
only the ids in measure_next with measure_kernel (charged in GPU-seconds); check budget_status before long searches.
"""

WORKFLOW_PROMPT = """\
You are optimising a GPU kernel with a forecaster and a metered GPU budget.

1. Write several candidate kernels (or tuning-parameter variants: same source, different `defines`).
2. Call `compare_kernels` with all candidates (2-64), `baseline` = your current best, and `hardware` = the target
   GPU. Forecasts are free: in a tuning space, send as many untried variants per call as you can.
3. Read each candidate's `verdict`:
   - `faster` / `slower`: decided by the forecaster; the error rate among decided verdicts is kept below
     `target_error`. Drop the slower ones without measuring unless `measure_next` still lists them.
   - `unsure`: the forecaster cannot tell reliably.
   `measure_next` ranks the candidates worth a measurement, most valuable first (chance and size of beating
   the best kernel of their family measured so far, whichever baseline you named): the unsure and faster ones, and a slower one only while its forecast is wide enough that it
   might still win clearly (an untried corner of a tuning space). A search measures its head. An empty
   `measure_next` means none of these is worth a measurement: send other candidates instead.
4. Measure only the head of `measure_next` with `measure_kernel` (or pass `measure_if_unsure=true` with
   `max_measurements`: it measures the unsure ones in that order; one decided `faster` still needs its own
   `measure_kernel` to become your baseline). Each measurement is charged in GPU-seconds; identical re-measurements are free (cache),
   and an `idempotency_key` makes retries safe.
5. A measured kernel becomes the new baseline when it is faster. Every measurement also teaches the forecaster:
   tuning variants of a measured kernel family get sharper forecasts as you go.
6. Call `budget_status` to see what is left and how accurate the forecaster has been on your verified pairs.

The 8 speedup bins (S = t(baseline)/t(candidate), in log2 S):
""" + bins.describe()


class LedgerTokenVerifier:
    """Bearer tokens map to ledgers; unknown or revoked tokens are refused (401) before any tool runs."""

    def __init__(self, service: Service) -> None:
        self._service = service

    async def verify_token(self, token: str) -> AccessToken | None:
        if not token or len(token) > 512:
            return None
        ledger = await self._service.store.ledger_for_token(token)
        if ledger is None:
            return None
        return AccessToken(token=token, client_id=ledger, scopes=[])


def _annotations(title: str, *, read_only: bool) -> ToolAnnotations:
    # No tool destroys anything or reaches beyond this server; only budget_status is read-only
    # (compare_kernels records forecasts and may measure).
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=False,
        idempotent_hint=read_only,
        open_world_hint=False,
    )


def _refuse_unknown_arguments(ctx: Context, tool: Callable[..., Any]) -> None:
    """Refuse argument names the tool does not have.

    The SDK validates the arguments a tool declares and drops any others, so a misspelt one
    (`target_eror`, `idempotencykey`) would be ignored while the caller believes its cap or key applies.
    """
    raw = _raw_arguments(ctx)
    if raw is None:
        return
    valid = [name for name in inspect.signature(tool).parameters if name != "ctx"]
    problem = _unknown_arguments(tool.__name__, raw, valid)
    if problem is not None:
        raise ToolError(f"{problem}. Nothing was run or charged: resend with the names corrected.")


def _raw_arguments(ctx: Context) -> dict[Any, Any] | None:
    """The arguments as the client sent them (before validation and defaults), or None outside a request."""
    try:
        params = ctx.request_context.params
    except ValueError:  # invoked outside a request: there are no raw arguments
        return None
    raw = params.get("arguments") if params else None
    return raw if isinstance(raw, dict) else None


def _unknown_arguments(tool_name: str, raw: dict[Any, Any], valid: Sequence[str]) -> str | None:
    """What names in `raw` the tool does not take ("compare_kernels has no argument 'target_eror' (did you mean
    'target_error'?); its arguments are: ..."), or None when every one is in `valid`."""
    unknown = [str(k) for k in raw if k not in valid]
    if not unknown:
        return None
    named = []
    for name in unknown[:5]:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        named.append(f"{name[:40]!r}{hint}")
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return f"{tool_name} has no argument {', '.join(named)}{more}; its arguments are: {', '.join(valid)}"


def _refuse_past_the_hard_bound(value: Any) -> Any:
    """A candidates list past compare_kernels' hard length bound, refused with the contract's count (2 to 64)
    before its items are validated: pydantic's own message named the bound (256), so an agent that sent 300
    resent 256 and was refused again."""
    if isinstance(value, list) and len(value) > 4 * MAX_CANDIDATES:
        raise ValueError(candidate_count_problem(len(value)))
    return value


def _refuse_bool(value: Any) -> Any:
    """A number argument sent as true / false: pydantic reads it as 1 / 0, a cap or tolerance nobody wrote."""
    if isinstance(value, bool):
        raise ValueError(f"a number is wanted here, not {str(value).lower()}")
    return value


_NUMBER = BeforeValidator(_refuse_bool)


def _accepts_str(annotation: Any) -> bool:
    """Whether a field's type takes a string as it is (str, or a union with str in it)."""
    return annotation is str or str in get_args(annotation)


class _CompactArgumentErrors(FuncMetadata):
    """The SDK's argument validation, its errors summarised (arg_errors): same model, same checks."""

    def pre_parse_json(self, data: dict[str, Any]) -> dict[str, Any]:
        """The SDK's pre-parse (a list or object sent as JSON text is read as one), except for the string
        arguments it would misread: it parses every string of a field not typed exactly `str`, so
        `baseline: "null"` became no baseline (the first candidate's, silently) and `idempotency_key: "null"`
        no key (a retry was charged again), and `"[1]"` was refused as a list though a string was sent."""
        parsed = super().pre_parse_json(data)
        fields = self.arg_model.model_fields
        for key, value in data.items():
            field = fields.get(key)
            if isinstance(value, str) and field is not None and _accepts_str(field.annotation):
                parsed[key] = value
        return parsed

    def validate_arguments(self, arguments_to_validate: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_arguments(arguments_to_validate)
        except ValidationError as exc:
            # A required argument sent under another name (`kernels` for `candidates`) fails validation before
            # the tool can name it (_refuse_unknown_arguments): the names it does not take are said here too.
            tool_name = self.arg_model.__name__.removesuffix("Arguments")
            unknown = _unknown_arguments(tool_name, arguments_to_validate, list(self.arg_model.model_fields))
            raise compact_validation_error(
                exc, field_names(self.arg_model), [unknown] if unknown is not None else []
            ) from None


def _registered(mcp: MCPServer, tool: Callable[..., Any]) -> Any:
    """The SDK's record of a registered tool (its tool manager's: the SDK offers no public hook for what the
    two functions below change)."""
    registered = mcp._tool_manager.get_tool(tool.__name__)
    if registered is None:
        raise RuntimeError(f"tool {tool.__name__} is not registered")
    return registered


def _compact_argument_errors(mcp: MCPServer, tools: Sequence[Callable[..., Any]]) -> None:
    """Make each tool report argument errors as `arg_errors.summary` does: each tool's FuncMetadata gets the
    override as its class (fields unchanged)."""
    for tool in tools:
        _registered(mcp, tool).fn_metadata.__class__ = _CompactArgumentErrors


def _close_input_schemas(mcp: MCPServer, tools: Sequence[Callable[..., Any]]) -> None:
    """Publish `additionalProperties: false` on each tool's arguments, as `_refuse_unknown_arguments` enforces,
    so that a schema-driven client learns before calling that a misspelt name is an error. The SDK builds the
    schema from the signature and offers no option for it; its tool manager holds the schema it lists."""
    for tool in tools:
        _registered(mcp, tool).parameters["additionalProperties"] = False


async def _call(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return await fn()
    except AgentError as exc:
        raise ToolError(str(exc)) from exc
    except sqlite3.OperationalError as exc:
        # A full, read-only or long-locked state folder: the agent was told only "Error executing tool
        # measure_kernel", nothing it could act on or pass on. The operator gets the traceback in the log.
        log.warning("the state database failed a tool call", exc_info=True)
        raise ToolError(
            f"the server's state database cannot be used now ({one_line(str(exc), 200)}): tell the server's "
            "operator (its state folder may be full, read-only or locked); budget_status says what was charged"
        ) from exc
    except sqlite3.DatabaseError as exc:
        # A damaged file ("database disk image is malformed", as the CLI names it): the same blind "Error
        # executing tool" otherwise. Waiting does not mend it, so the agent is not told to retry. Other
        # DatabaseErrors (a constraint, a bug) stay internal errors.
        if not damaged(exc):
            raise
        log.error("the state database is damaged", exc_info=True)
        raise ToolError(
            f"the server's state database is damaged ({one_line(str(exc), 200)}): tell the server's operator "
            "(it must be recovered; retrying will not help)"
        ) from exc


# AuthSettings requires an issuer URL, but with no authorization-server provider and no resource_server_url the
# SDK neither serves nor advertises one (no OAuth metadata routes, no resource_metadata in 401 challenges), so this
# placeholder never reaches a client.
_UNUSED_ISSUER = AnyHttpUrl("http://127.0.0.1")


def build_server(service: Service, *, http: bool = False) -> MCPServer:
    """The MCP server over `service`. With `http=True`, every request must carry a bearer token."""
    auth_kwargs: dict[str, Any] = {}
    if http:
        # Tokens are static bearer tokens issued by `forecaster-mcp token issue`; there is no OAuth flow. So the
        # server publishes no OAuth protected-resource metadata: it could only name an authorization server that
        # does not exist, and clients would try (and fail) to log in there instead of sending their token.
        auth_kwargs = {
            "token_verifier": LedgerTokenVerifier(service),
            "auth": AuthSettings(issuer_url=_UNUSED_ISSUER, resource_server_url=None),
        }
    mcp = MCPServer(
        name="forecaster-mcp",
        title="GPU kernel forecaster",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level="WARNING",
        **auth_kwargs,
    )

    def ledger_for(requested: str | None) -> str:
        token = get_access_token()
        own = token.client_id if token is not None else service.settings.ledger
        if http and token is None:
            raise ToolError("this HTTP server needs a bearer token (Authorization: Bearer <token>)")
        if requested is not None and requested != own:
            raise ToolError(
                f"this connection is bound to ledger {own!r}; it cannot use ledger {requested[:80]!r}. "
                + (
                    "Omit `ledger`, or connect with that ledger's token."
                    if http
                    else "Omit `ledger`, or start this server with --ledger NAME (FORECASTER_MCP_LEDGER)."
                )
            )
        return own

    def progress_of(ctx: Context) -> Callable[[float, float | None, str | None], Awaitable[None]]:
        async def report(done: float, total: float | None, message: str | None) -> None:
            await ctx.report_progress(done, total, message)

        return report

    def tool(**options: Any) -> Callable[[_F], _F]:
        """mcp.tool with the docstring dedented: agents read the description as written, indentation and all."""

        def register(fn: _F) -> _F:
            mcp.tool(description=inspect.cleandoc(fn.__doc__ or ""), **options)(fn)
            return fn

        return register

    @tool(
        title="Forecast which kernels are faster",
        annotations=_annotations("Forecast which kernels are faster", read_only=False),
    )
    async def compare_kernels(
        candidates: Annotated[
            list[Kernel],
            # A hard length bound well above the contract's (the service says "2 to 64" for 65 to 256): pydantic
            # stops at it instead of validating, and reporting, every item of a list of millions, which took
            # one 95 MiB request to 24 GB of server memory. Past it, the same "2 to 64" (not "at most 256").
            BeforeValidator(_refuse_past_the_hard_bound),
            Field(
                description=f"{MIN_CANDIDATES} to {MAX_CANDIDATES} kernels; ids unique (default k0, k1, ...)",
                max_length=4 * MAX_CANDIDATES,
                json_schema_extra={"minItems": MIN_CANDIDATES, "maxItems": MAX_CANDIDATES},
            ),
        ],
        ctx: Context,
        workload: Annotated[
            Workload, Field(description="what the kernels run on; problem sizes are shown to forecasters")
        ] = Workload(),  # noqa: B008 - frozen model, safe as a default
        baseline: Annotated[
            str | None,
            Field(
                description="id of the baseline, one of the candidates (its kernel is in the list); default the first"
            ),
        ] = None,
        hardware: Annotated[
            str | None,
            Field(
                description="target GPU, e.g. 'H100' or 'A100-80GB' (names in the forecaster://gpu-specs "
                "resource); default the server's measurement device or configured GPU"
            ),
        ] = None,
        target_error: Annotated[
            float | None,
            _NUMBER,
            Field(
                description="largest acceptable error rate among decided verdicts (default the server's "
                "setting, 0.1 unless configured; answers give the one used; at least "
                f"{MIN_TARGET_ERROR:g}, below {MAX_TARGET_ERROR:g})",
                json_schema_extra={"minimum": MIN_TARGET_ERROR, "exclusiveMaximum": MAX_TARGET_ERROR},
            ),
        ] = None,
        measure_if_unsure: Annotated[
            # Strict: it spends budget, so "yes", "1" or 1 from a sloppy client is refused, not read as true.
            StrictBool,
            Field(description="measure unsure candidates on the GPU, charged to your budget (true or false)"),
        ] = False,
        max_measurements: Annotated[
            int,
            _NUMBER,
            Field(
                description=f"cap on measurements when measure_if_unsure (0 to {MAX_CANDIDATES})",
                json_schema_extra={"minimum": 0, "maximum": MAX_CANDIDATES},
            ),
        ] = 4,
        ledger: Annotated[
            str | None, Field(description="must match this connection's ledger if given")
        ] = None,
    ) -> CompareResult:
        """Forecast, for every candidate, the probability it is faster than the baseline and a verdict (faster /
        slower / unsure) whose error rate stays under target_error. Free unless measure_if_unsure. Act on
        `measure_next`: the candidates worth a GPU measurement, most valuable first (chance and size of beating
        the best kernel measured so far): unsure and faster ones, and slower ones whose wide forecast still
        leaves a real expected gain; measure those with measure_kernel and trust the other decided verdicts."""
        _refuse_unknown_arguments(ctx, compare_kernels)
        own = ledger_for(ledger)
        result = await _call(
            lambda: service.compare(
                ledger=own,
                candidates=candidates,
                workload=workload,
                baseline=baseline,
                hardware=hardware,
                target_error=target_error,
                measure_if_unsure=measure_if_unsure,
                max_measurements=max_measurements,
                progress=progress_of(ctx),
            )
        )
        sent = _raw_arguments(ctx) or {}
        if "max_measurements" in sent and "measure_if_unsure" not in sent and max_measurements > 0:
            # The cap of a measuring the caller did not ask for: one sent alone expected measurements. Not when
            # the caller wrote measure_if_unsure: false itself (a client sending every argument, defaults
            # included) or a cap of 0: it asked for none, and is not to be told to spend budget.
            result.notes.append(
                f"max_measurements {max_measurements} was not used and nothing was measured: it caps "
                "measure_if_unsure, which was not sent (false); pass measure_if_unsure=true to measure the unsure "
                "candidates"
            )
        return result

    @tool(
        title="Measure a kernel on the GPU",
        annotations=_annotations("Measure a kernel on the GPU", read_only=False),
    )
    async def measure_kernel(
        kernel: Annotated[Kernel, Field(description="the kernel; launch is required on a real GPU")],
        ctx: Context,
        workload: Annotated[
            Workload, Field(description="arguments (required on a real GPU) and sizes")
        ] = Workload(),  # noqa: B008
        reference: Annotated[
            Kernel | None, Field(description="correctness oracle run on the same inputs")
        ] = None,
        atol: Annotated[
            float,
            _NUMBER,
            Field(
                description="absolute tolerance of the output check: |got - want| <= atol + rtol*|want|",
                json_schema_extra={"minimum": 0},
            ),
        ] = 1e-5,
        rtol: Annotated[
            float,
            _NUMBER,
            Field(
                description="relative tolerance of the output check (see atol) of floating-point outputs; for "
                "float16 and bfloat16 at least one unit in their last place (2^-10, 2^-7). Integer and bool "
                "outputs are compared with atol alone (exactly, at the default)",
                json_schema_extra={"minimum": 0},
            ),
        ] = 1e-3,
        max_seconds: Annotated[
            float | None,
            _NUMBER,
            Field(
                description=f"cap on GPU-seconds for this measurement (at least {MIN_MEASURE_SECONDS:g}), reserved "
                "from your budget up front and the unused part released; maximum the server's cap (30 s unless "
                "configured), default that cap or what your budget has left, whichever is less",
                json_schema_extra={"minimum": MIN_MEASURE_SECONDS},
            ),
        ] = None,
        max_runs: Annotated[
            int,
            _NUMBER,
            Field(description="cap on timed runs (at least 1)", json_schema_extra={"minimum": 1}),
        ] = 1000,
        idempotency_key: Annotated[
            str | None,
            Field(
                description="retries with the same key are answered from the first, never re-charged; a call "
                "you cancel while its job is on the device is charged the device time it used and keeps no "
                "result, so a retry then measures (and is charged) again"
            ),
        ] = None,
        hardware: Annotated[
            str | None,
            Field(
                description="device to measure on; default the one compare_kernels forecasts for when not told "
                "(the server's configured GPU where it measures on it, else its first device)"
            ),
        ] = None,
        ledger: Annotated[
            str | None, Field(description="must match this connection's ledger if given")
        ] = None,
    ) -> MeasureResult:
        """Measure one kernel on a GPU (or a replay recording), charging GPU-seconds to your ledger.
        A kernel that fails to compile, hangs or gives wrong output is a result with a status, not an error."""
        _refuse_unknown_arguments(ctx, measure_kernel)
        own = ledger_for(ledger)
        return await _call(
            lambda: service.measure(
                ledger=own,
                kernel=kernel,
                workload=workload,
                reference=reference,
                atol=atol,
                rtol=rtol,
                max_seconds=max_seconds,
                max_runs=max_runs,
                idempotency_key=idempotency_key,
                hardware=hardware,
                progress=progress_of(ctx),
            )
        )

    @tool(
        title="GPU budget and forecaster record",
        annotations=_annotations("GPU budget and forecaster record", read_only=True),
    )
    async def budget_status(
        ctx: Context,
        ledger: Annotated[
            str | None, Field(description="must match this connection's ledger if given")
        ] = None,
    ) -> BudgetStatus:
        """Your ledger, free to ask: limit_gpu_seconds, spent_gpu_seconds, reserved_gpu_seconds (held by
        measurements running now) and remaining_gpu_seconds; measurements (count, cache hits, failures); forecasts
        (decided, deferred as unsure, and how many a measurement verified right); gpu_seconds_saved by forecasts
        and cache; llm: Claude's tokens and cost_usd (zero when the server forecasts without Claude); calibration
        (Brier score on the verified pairs); the devices this server measures on."""
        _refuse_unknown_arguments(ctx, budget_status)
        own = ledger_for(ledger)
        return await _call(lambda: service.budget_status(own))

    @mcp.resource(
        "forecaster://gpu-specs",
        name="gpu-specs",
        title="GPU specifications known to the forecaster",
        mime_type="application/json",
    )
    def gpu_specs() -> str:
        """Every GPU the forecaster has a specification row for (SMs, L2, bandwidth, peak throughput)."""
        rows: list[GpuSpecRow] = service.gpu_specs()
        return json.dumps([r.model_dump() for r in rows], indent=1)

    _close_input_schemas(mcp, (compare_kernels, measure_kernel, budget_status))
    _compact_argument_errors(mcp, (compare_kernels, measure_kernel, budget_status))

    @mcp.prompt(name="forecast_first", title="Forecast first, measure when unsure")
    def forecast_first() -> str:
        """How to use the forecaster and the GPU budget together in a kernel-optimisation loop."""
        return WORKFLOW_PROMPT

    return mcp


# ---------------------------------------------------------------------- running


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _check_ledger_name(name: str) -> None:
    # The rule `ledger create` enforces: a name it would refuse can never exist, and would only fail later.
    from forecaster_mcp.store.db import check_ledger_name

    check_ledger_name(name, "--ledger (env FORECASTER_MCP_LEDGER)")


def _check_address(host: str, port: int) -> str:
    """The host to bind (IPv6 brackets removed); OperatorError for a port out of range or a malformed host."""
    if not 1 <= port <= 65535:
        raise OperatorError(f"--port must be between 1 and 65535, got {port}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    labels = bare.removesuffix(".").split(".")
    # A name whose last label is all digits is a mistyped IPv4 address (999.1.1.1), not a host name.
    if len(bare) > 253 or labels[-1].isdigit() or not all(_HOST_LABEL.fullmatch(x) for x in labels):
        raise OperatorError(
            f"--host {host[:80]!r} is not an IP address or host name: pass e.g. 127.0.0.1 (this machine only) "
            "or 0.0.0.0 (every interface)"
        )
    return bare


def _listen(host: str, port: int) -> list[socket.socket]:
    """Bind the HTTP port now, before the service opens: a busy port is a one-line error, not a traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OperatorError(
            f"--host {host[:80]!r}: cannot resolve it ({exc.strerror}); pass an IP address"
        ) from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):  # as asyncio's create_server binds a name
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # IPv6 only, except for `::`, every interface: IPv4 too (dual stack), as the start-up line says
                # (`http://127.0.0.1:PORT/mcp` on this machine). A name such as localhost binds its IPv4 address
                # on a socket of its own.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if _every_interface(host) else 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} is already in use on {host} (another server?): stop it or pass another --port"
        elif exc.errno == errno.EACCES:
            why = (
                f"permission denied for {where} (ports below 1024 need privileges): pass --port 1024 or above"
            )
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"{host} is not an address of this machine: pass 127.0.0.1, 0.0.0.0 or one of its addresses"
        else:
            why = f"{exc.strerror or exc}"
        raise OperatorError(f"cannot listen on {where}: {why}") from exc
    return sockets


def _every_interface(host: str) -> bool:
    """Whether `host` is an unspecified address (0.0.0.0, ::): listen on every interface."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


# The names a client on this machine reaches a loopback server by (any port), as the MCP SDK allows by default.
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def transport_security(host: str, allowed_hosts: Sequence[str]) -> TransportSecuritySettings:
    """The MCP SDK's DNS-rebinding check for a server listening on `host` (brackets removed): requests are
    answered only for these Host headers (else 421) and, from a browser, these Origins (else 403).

    On a loopback address, as the SDK and the MCP specification have it: this machine's names, plus
    `allowed_hosts` (the name a TLS reverse proxy passes on). On another address only with `allowed_hosts`
    (the names clients use cannot be guessed), with the address itself (every interface: this machine's loopback
    names); without them there is no check.
    The bearer token is checked first either way: the list is a second line, for a token that reached a
    browser page, and the specification's requirement that a server validate Origin."""
    names = list(allowed_hosts)
    if _loopback(host) or (names and _every_interface(host)):  # listening on every interface: loopback too
        names += _LOOPBACK_NAMES
    if _loopback(host) or (names and not _every_interface(host)):
        names.append(f"[{host}]" if ":" in host else host)
    if not names:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts: list[str] = []
    origins: list[str] = []
    for name in dict.fromkeys(host_key(n) for n in names):  # as _ComparableHost gives the request's Host
        bare, sep, port = ("", "", "") if name.endswith("]") else name.rpartition(":")
        if sep:
            hosts.append(name)
            origins += [f"http://{name}", f"https://{name}"]
            # A client leaves the scheme's own port out of Host, and a browser out of Origin: behind a proxy on 443,
            # `--allowed-host mcp.example.com:443` is asked for as `mcp.example.com`.
            # So does `:*` (any port) answer the name without one.
            if port in ("80", "443", "*"):
                hosts.append(bare)
            if port == "*":
                origins += [f"http://{bare}", f"https://{bare}"]
            origins += {"80": [f"http://{bare}"], "443": [f"https://{bare}"]}.get(port, [])
        else:  # no port named: any port, or none (a proxy on 443 passes `mcp.example.com`)
            hosts += [name, f"{name}:*"]
            origins += [
                f"{scheme}://{name}{any_port}" for scheme in ("http", "https") for any_port in ("", ":*")
            ]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts,
        allowed_origins=list(dict.fromkeys(origins)),
    )


class _ComparableHost:
    """ASGI wrapper that gives the app the request's Host header as `settings.host_key` writes the allowed ones
    (lower case, no trailing dot), so that the SDK's exact comparison treats the header as the case-insensitive
    name it is: `Host: LOCALHOST:8765` or `localhost.:8765` (this machine, by a name the DNS-rebinding check
    cannot mean to refuse) was refused (421)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") in ("http", "websocket"):
            headers = scope.get("headers") or []
            fixed = [
                (name, host_key(value.decode("latin-1")).encode("latin-1"))
                if name == b"host"
                else (name, value)
                for name, value in headers
            ]
            if fixed != list(headers):
                scope = {**scope, "headers": fixed}
        await self.app(scope, receive, send)


class _RefusedHostHint(logging.Filter):
    """The SDK's one-line warning for a refused Host or Origin, with what the operator can do about it: behind a
    reverse proxy every request was refused (421) with only "Invalid Host header: mcp.example.com" to go on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for header, code in (("Host", 421), ("Origin", 403)):
            prefix = f"Invalid {header} header: "
            if message.startswith(prefix):
                value = message[len(prefix) :][:100]
                record.msg, record.args = (
                    "refused a request (%d) for %s %r: not a name this server answers to; if clients reach it "
                    "by that name (a reverse proxy that passes on the Host it was asked for), add "
                    "`serve --allowed-host NAME` (env FORECASTER_MCP_ALLOWED_HOSTS)",
                    (code, header, value),
                )
        return True


def _shown_url(host: str, port: int) -> str:
    if _every_interface(host):
        return f"port {port} of every interface, path /mcp (on this machine: http://127.0.0.1:{port}/mcp)"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/mcp"


async def _check_startup(service: Service, settings: Settings, *, http: bool) -> None:
    """Refuse a stdio ledger that does not exist (every call would fail, free forecasts included); warn on
    stderr about a default GPU the spec table does not know (every forecast would quietly lose its hardware
    features)."""
    if not http and await service.store.get_ledger(settings.ledger) is None:
        raise OperatorError(
            f"ledger {settings.ledger!r} does not exist: create it with `forecaster-mcp ledger create "
            f"{shlex.quote(settings.ledger)} --gpu-seconds N`, or leave out --ledger (FORECASTER_MCP_LEDGER) to "
            "use 'default'"
        )
    try:
        default = service.resolve_hardware(None)
    except AgentError as exc:
        raise OperatorError(f"--hardware {settings.hardware!r}: {exc}") from exc
    unknown_gpu = settings.hardware is not None and default.spec is None
    if settings.hardware is not None and default.device_of is None and service.devices():
        print(
            f"forecaster-mcp: warning: --hardware {settings.hardware!r} is none of the devices this server "
            f"measures on ({', '.join(service.devices())}): forecasts default to {default.name} and never learn "
            "from those measurements; leave out --hardware (FORECASTER_MCP_HARDWARE) to forecast for the "
            "measured device",
            file=sys.stderr,
        )
    if unknown_gpu:
        assert settings.hardware is not None
        close = specs.suggest(settings.hardware, limit=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        print(
            f"forecaster-mcp: warning: --hardware {settings.hardware!r} is not a GPU this server knows{hint}; "
            "forecasts for it will have no hardware-specific features",
            file=sys.stderr,
        )


async def serve(
    settings: Settings,
    *,
    http: bool,
    host: str = "127.0.0.1",
    port: int = 8765,
    sockets: Sequence[socket.socket] = (),
) -> None:
    """Open the service once, serve until stopped, close it. HTTP serves on `sockets` (bound by `_listen`)."""
    import uvicorn

    service = await Service.open(settings, http=http)
    try:
        await _check_startup(service, settings, http=http)
        server = build_server(service, http=http)
        async with anyio.create_task_group() as tg:
            # Parse recordings in the background so the first tools/list is not kept waiting.
            tg.start_soon(service.preload)
            if http:
                print(
                    f"forecaster-mcp: serving streamable HTTP at {_shown_url(host, port)} (at most "
                    f"{settings.max_concurrent_compiles} compiles at once: FORECASTER_MCP_MAX_CONCURRENT_COMPILES)",
                    file=sys.stderr,
                )
                # What MCPServer.run_streamable_http_async does, on the sockets bound before the service opened
                # (without any, uvicorn binds host:port itself).
                app = server.streamable_http_app(
                    host=host,
                    max_request_body_size=MAX_HTTP_BODY_BYTES,
                    transport_security=transport_security(host, settings.allowed_hosts),
                )
                logging.getLogger("mcp.server.transport_security").addFilter(_RefusedHostHint())
                _limit_sessions_per_ledger(server.session_manager, settings.max_sessions_per_ledger)
                config = uvicorn.Config(
                    _ComparableHost(Reworded(app, max_body_bytes=MAX_HTTP_BODY_BYTES)),
                    host=host,
                    port=port,
                    log_level="warning",
                    timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_S,
                )
                logging.getLogger("uvicorn.error").addFilter(_CancelledAtShutdown())
                for name in ("uvicorn.error", "mcp.server.streamable_http"):
                    logging.getLogger(name).addFilter(_ClientHungUp())
                await _server_that_returns_on_signals(uvicorn, config).serve(sockets=list(sockets) or None)
            else:
                tg.start_soon(_cancel_on_signals, tg.cancel_scope)
                await _run_stdio(server)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await service.close()


def _limit_sessions_per_ledger(manager: Any, limit: int) -> None:
    """At most `limit` open sessions per ledger (the tokens' client_id): the SDK's one limit is server-wide
    (10,000, idle ones kept 30 minutes), so one token opening sessions in a loop locked every other ledger out
    ("Too many open sessions") for half an hour. A ledger at its limit is refused the same way (503) while the
    others still open theirs. Wraps the SDK session manager's admission step (mcp 2.x); where that is not
    there, the server-wide limit alone stays, with a warning."""
    admit = getattr(manager, "_admit_session", None)
    owners = getattr(manager, "_session_owners", None)
    live = getattr(manager, "_server_instances", None)
    if admit is None or not isinstance(owners, dict) or not isinstance(live, dict):
        log.warning("this mcp version admits sessions differently: no per-ledger session limit")
        return

    def admit_within_limit(requestor: Any) -> Any:
        if requestor is not None:
            who = requestor.get("client_id")
            held = sum(1 for sid, owner in owners.items() if sid in live and owner.get("client_id") == who)
            if held >= limit:
                log.warning("ledger %r holds %d open sessions, its limit: a new one is refused", who, held)
                return None
        return admit(requestor)

    manager._admit_session = admit_within_limit


class _CancelledAtShutdown(logging.Filter):
    """uvicorn's account of the calls a shutdown cancels, in one line: it logged each as an ERROR with a
    CancelledError traceback ("Exception in ASGI application"), which read as a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        if "timeout graceful shutdown exceeded" in record.getMessage():
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = (
                "stopping: the calls still running after %g s are cancelled (a measurement is charged the device "
                "time it used)",
                (HTTP_SHUTDOWN_GRACE_S,),
            )
        return True


def _holds_only(exc: BaseException, is_it: Callable[[BaseException], bool]) -> bool:
    """Whether `exc` is one `is_it` accepts, or (anyio's task groups wrap what they raise) a group of only such."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_holds_only(inner, is_it) for inner in exc.exceptions)
    return is_it(exc)


def _client_disconnect(exc: BaseException | None) -> bool:
    """Whether `exc` is (or, through task groups, holds only) starlette's ClientDisconnect."""
    return exc is not None and _holds_only(exc, lambda e: type(e).__name__ == "ClientDisconnect")


class _ClientHungUp(logging.Filter):
    """A client that hangs up while it sends its request (a search client's timeout), in one line: the SDK
    ("Error handling POST request") or, on its newer protocol path, uvicorn ("Exception in ASGI application")
    logged each as an ERROR with a ClientDisconnect traceback, which read as a crash in a busy server's log.
    The request was never read whole, so nothing of it ran or was charged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _client_disconnect(record.exc_info[1] if record.exc_info else None):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = (
                "a client disconnected before its request was read whole: nothing of it ran or was charged",
                (),
            )
        return True


def _server_that_returns_on_signals(uvicorn: Any, config: Any) -> Any:
    """uvicorn's server, except that the SIGTERM / SIGINT it shut down for is not raised again once it has:
    raised, it killed the process before `serve` closed the service (the store never closed, its WAL left
    behind). `serve` returns instead, the service closes, and the command exits.

    A second Ctrl-C does not skip the orderly stop either: uvicorn's "force quit" returned without cancelling the
    calls in flight, so the service closed under them (a "the store is closed" traceback for each, their holds
    left open and released free at the next start, the device time used never charged). The stop takes at most
    HTTP_SHUTDOWN_GRACE_S and the cancellation; a third Ctrl-C still forces it, for a call that cannot be
    cancelled."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        _interrupts = 0

        def handle_exit(self, sig: int, frame: Any) -> None:
            self._interrupts += sig == signal.SIGINT
            super().handle_exit(sig, frame)
            if self._interrupts < 3:
                self.force_exit = False

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()  # what uvicorn re-raises after its own clean-up

    return Server(config)


# How long SIGTERM / SIGINT let the calls in flight finish before they are cancelled (a measurement on the device
# is charged what it used, as on stdio). uvicorn's default waits for every open request, so a server asked to stop
# during a compare that measures kept serving it for minutes, and a second Ctrl-C closed the store under it.
HTTP_SHUTDOWN_GRACE_S = 3

# What one HTTP request may carry: compare_kernels takes 64 kernels of up to 1 MB of source each, about 1.5 MB
# each once JSON-escaped. The SDK's default (4 MiB) refused 64 sources of 70 KB with a bare 413 that clients
# show as "Server returned an error response"; stdio has no such limit.
MAX_HTTP_BODY_BYTES = 96 * 2**20


# A JSON `\u` escape of a UTF-16 surrogate (D800-DFFF); paired ones are fine, lone ones are what breaks.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Scanned left to right: an escaped backslash (so `\\ud800` is text, not an escape), a high-low pair (kept),
# or a lone surrogate escape (replaced).
_ESCAPE_TOKEN = re.compile(
    r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)


def _lone_to_replacement(match: re.Match[str]) -> str:
    token = match.group()
    return "\\ufffd" if len(token) == 6 else token


def without_lone_surrogates(line: str) -> str:
    """One JSON-RPC line with each lone UTF-16 surrogate escape (`"\\ud800"`) replaced by `"\\ufffd"`.

    mcp 2.3's stdio transport drops a line it cannot validate without replying, and pydantic refuses lone
    surrogates, so one such escape (what `json.dumps` writes for a file read with errors="surrogateescape")
    would leave the client waiting forever. Replaced, the request is answered: U+FFFD is what the transport
    already puts for bytes that are not UTF-8. Lines without such an escape are returned as they are.

    The replacement is textual, in one linear scan: re-parsing the line would fail (and a RecursionError end
    the server) on lines Python's json cannot load, such as a very deep nesting or an integer of more than 4300
    digits (which the SDK cannot parse either: `_answer_unparsed` replies to those); everything but the lone
    escapes stays byte for byte.
    """
    if not _SURROGATE_ESCAPE.search(line):
        return line
    return _ESCAPE_TOKEN.sub(_lone_to_replacement, line)


async def _cancel_on_signals(scope: anyio.CancelScope) -> None:
    """SIGTERM / SIGINT end a stdio server as EOF does: the call in flight is cancelled (a measurement on the
    device is charged what it used), the service closes, the command exits 0. Without this SIGTERM killed the
    process with its hold open (released free at the next start) and its WAL left behind."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


class _WireLines:
    """The wire's lines through `without_lone_surrogates` (an async-iterable stand-in for the SDK's stdin),
    read by a daemon thread: a worker thread blocked in read() when serving ends (a signal, not EOF) kept the
    process from exiting until one more line arrived."""

    def __init__(self, text: IO[str]) -> None:
        self._text = text
        # The lines yielded whose parsed message (or parse error) has not been taken yet, oldest first: the SDK
        # turns each line into exactly one item, but may read the next line before the previous item is
        # handled, so "the line yielded last" named the wrong request (its id) now and then.
        self._pending: collections.deque[str] = collections.deque()

    def take(self) -> str:
        """The line the item just received from the SDK was parsed from (one per item, in order)."""
        return self._pending.popleft() if self._pending else ""

    async def __aiter__(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        def put(line: str | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
                loop.call_soon_threadsafe(queue.put_nowait, line)

        def pump() -> None:
            try:
                for line in self._text:
                    put(line)
            except (OSError, ValueError):
                pass
            finally:
                put(None)

        threading.Thread(target=pump, name="stdio-wire", daemon=True).start()
        while (line := await queue.get()) is not None:
            self._pending.append(line)
            yield without_lone_surrogates(line)


# How far into an unparsable line its top-level "id" is looked for (a request names it near the start).
_ID_SCAN_CHARS = 65536
_ID_VALUE = re.compile(r'\s*:\s*(-?[0-9]{1,18}(?![0-9.eE])|"(?:[^"\\]|\\.){0,200}")')


def top_level_id(line: str) -> str | int | None:
    """The `"id"` member of the JSON object `line` starts with, read without parsing the line (it could not be
    parsed): a key at depth 1, outside strings, in the first _ID_SCAN_CHARS characters; None if not found."""
    depth, i, n = 0, 0, min(len(line), _ID_SCAN_CHARS)
    while i < n:
        ch = line[i]
        if ch == '"':
            end = i + 1
            while end < n and line[end] != '"':
                end += 2 if line[end] == "\\" else 1
            if depth == 1 and line[i + 1 : end] == "id" and (m := _ID_VALUE.match(line, end + 1)):
                value = m.group(1)
                try:
                    parsed = json.loads(value)
                except ValueError:
                    return None
                return parsed if isinstance(parsed, str | int) else None
            i = end + 1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        i += 1
    return None


async def _answer_unparsed(read_stream: Any, inner: Any, write_stream: Any, lines: _WireLines) -> None:
    """Forward the SDK's parsed messages to the server; answer each line it could not parse with a JSON-RPC
    parse error (the request's id when it can be read, else null). mcp 2.3's stdio transport hands such a line
    to the session, which drops it without a reply, so the client waited for ever (HTTP answers 400 -32700)."""
    from mcp.shared.message import SessionMessage
    from mcp.types import ErrorData, JSONRPCError

    async with inner:
        async for item in read_stream:
            line = lines.take()
            if not isinstance(item, Exception):
                await inner.send(item)
                continue
            text = str(item)
            detail = text.splitlines()[0][:200] if text.strip() else type(item).__name__
            log.warning("stdio: a line that is not a JSON-RPC message this server can parse: %s", detail)
            message = (
                f"Parse error: the line is not a JSON-RPC message this server can read ({detail}). Nesting deeper "
                "than about 190 levels and integers of more than 4300 digits are refused: flatten the value or "
                "send it as a string."
            )
            reply = JSONRPCError(
                jsonrpc="2.0", id=top_level_id(line), error=ErrorData(code=-32700, message=message)
            )
            await write_stream.send(SessionMessage(reply))


async def _run_stdio(server: MCPServer) -> None:
    """MCPServer.run_stdio_async, reading stdin through `without_lone_surrogates`.

    As the SDK does for its own stdin, fd 0 points at the null device while serving, so no child process
    (nvcc, the GPU worker) can read the wire; the wire is read from a duplicate, and fd 0 is restored after.
    """
    from mcp.server.stdio import stdio_server

    wire = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        # closefd=False: the reader thread may still block on the duplicate when serving ends.
        text = io.TextIOWrapper(os.fdopen(wire, "rb", closefd=False), encoding="utf-8", errors="replace")
        lines = _WireLines(text)
        async with stdio_server(stdin=cast("anyio.AsyncFile[str]", lines)) as (read_stream, write_stream):
            from mcp.shared._context_streams import create_context_streams

            inner_send, inner_read = create_context_streams[Any](0)
            lowlevel = server._lowlevel_server
            async with anyio.create_task_group() as tg:
                tg.start_soon(_answer_unparsed, read_stream, inner_send, write_stream, lines)
                await lowlevel.run(inner_read, write_stream, lowlevel.create_initialization_options())
                tg.cancel_scope.cancel()
    finally:
        os.dup2(wire, 0)


def serve_command(settings: Settings, args: argparse.Namespace) -> int:
    """`forecaster-mcp serve [--http --host H --port P] [--replay PATH]... [--ledger NAME]`."""
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    _check_ledger_name(settings.ledger)
    if not args.http:
        try:
            anyio.run(lambda: serve(settings, http=False))
        except (BrokenPipeError, BaseExceptionGroup) as exc:
            if not _holds_only(exc, lambda e: isinstance(e, BrokenPipeError)):
                raise
            # The client closed its end of stdout: the service is closed (serve's finally), as at EOF.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error flushing at exit
            log.warning("the client stopped reading the server's output: server stopped")
        return 0
    host = _check_address(args.host, args.port)
    sockets = _listen(host, args.port)
    try:
        anyio.run(lambda: serve(settings, http=True, host=host, port=args.port, sockets=sockets))
    finally:
        for sock in sockets:
            sock.close()
    return 0
