"""Settings: every field has an environment variable FORECASTER_MCP_<FIELD> (lists of paths: os.pathsep-separated;
lists of host names: comma-separated). Values lose the whitespace around them (paths: only line breaks)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from forecaster_mcp.compile_slots import MEASURE_COMPILE_WAIT_S, default_limit
from forecaster_mcp.errors import OperatorError, validation_message
from forecaster_mcp.models import MIN_MEASURE_SECONDS
from forecaster_mcp.store.db import MAX_GPU_SECONDS

ENV_PREFIX = "FORECASTER_MCP_"
# A Host header value as `serve --allowed-host` takes it: a name or IPv4 address, or a bracketed IPv6 address, then
# optionally `:PORT` or `:*` (any port).
_HOST_VALUE = re.compile(
    r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]+\])(?::(?:[0-9]{1,5}|\*))?"
)
# Settings that name files: they lose only surrounding line breaks (`_trimmed`).
_PATH_SETTINGS = frozenset({"home", "replay", "nvcc"})


def host_key(host: str) -> str:
    """A Host header value as the server compares it: lower case, without the trailing dot of a fully qualified
    name (`MCP.Example.com.:443` is `mcp.example.com:443`). A host name is case-insensitive and its trailing dot
    names the same host: an operator's `--allowed-host MCP.example.com` never equalled the lower-case Host a
    browser or nginx's `$host` sends, and every request was refused (421)."""
    host = host.lower()
    if host.startswith("["):  # a bracketed IPv6 address: no name to end in a dot
        return host
    name, sep, port = host.partition(":")
    return (name.rstrip(".") or name) + sep + port


# FORECASTER_MCP_* variables read elsewhere, not settings: a client's bearer token, the test suite's switches.
OTHER_VARIABLES = frozenset({"TOKEN", "FORBID_REAL_API", "GPU_TESTS", "GPU_LOCK_SCOPE"})


def _trimmed(value: object, path: bool) -> object:
    """A setting's value without the whitespace around it: values come from env files, mounted secrets and
    `$(cat file)`, whose trailing newline or stray space is never part of a name, number, choice, model or host
    (a ledger "run-42\n" was refused, a GPU "H100\n" unknown, a measurer "replay\n" not a choice). A path loses
    only line breaks: a file name may begin or end with a space, never in practice with a line break (a home
    ".../forecaster\n" became a new, empty state folder)."""
    if isinstance(value, Path):
        return Path(str(value).strip("\r\n"))
    if isinstance(value, str):
        return value.strip("\r\n") if path else value.strip()
    return value


def default_home() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("forecaster-mcp", appauthor=False))


class Settings(BaseModel):
    home: Path = Field(default_factory=default_home, description="state directory (database, caches)")
    ledger: str = Field(default="default", description="ledger a stdio server charges")
    default_ledger_gpu_seconds: float = Field(
        default=600.0,
        ge=0,
        le=MAX_GPU_SECONDS,
        allow_inf_nan=False,
        description="limit of the 'default' ledger when a stdio server creates it",
    )
    replay: list[Path] = Field(default_factory=list, description="Kernel Tuner cache files to replay")
    replay_realtime: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="wall-clock seconds a replayed measurement takes per recorded GPU-second",
    )
    measurer: Literal["auto", "replay", "pycuda", "none"] = "auto"
    hardware: str | None = Field(default=None, description="default GPU for forecasts")
    target_error: float = Field(default=0.1, ge=1e-4, lt=0.5)  # selective.MIN/MAX_TARGET_ERROR
    max_measure_seconds: float = Field(
        default=30.0,
        ge=MIN_MEASURE_SECONDS,
        allow_inf_nan=False,
        description="cap on one measurement's GPU time",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="with serve --http: the Host headers (and their http/https origins) the server answers, beside "
        "its own address; a request with another Host gets 421 (the MCP SDK's DNS-rebinding check)",
    )
    max_sessions_per_ledger: int = Field(
        default=100,
        ge=1,
        le=10_000,
        description="open MCP sessions one ledger's tokens may hold on an HTTP server at once",
    )
    anthropic_api_key: str | None = None
    claude_model: str = "claude-sonnet-5-5"
    claude_samples: int = Field(default=3, ge=1, le=16)
    forecast_timeout_s: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="a remote forecaster (Claude) still answering a compare_kernels after this long is skipped "
        "with a note (a slow or hanging API must not hold the agent; the local forecaster answers)",
    )
    nvcc: str | None = Field(default=None, description="path to nvcc; default: found on PATH")
    max_concurrent_compiles: int = Field(
        default_factory=default_limit,
        ge=1,
        le=1024,
        description="nvcc runs the server process allows at once, forecasts' ptxas compiles and measurements' "
        "compiles together (each may use 8 GiB of memory); default half the CPUs, at least 2. A compile past it "
        "waits: a forecast within its ptxas wait, then without ptxas features; a measurement up to "
        f"{MEASURE_COMPILE_WAIT_S:g} s, uncharged and without the GPU, then refused (nothing charged)",
    )
    isolate_ledgers: bool = Field(
        default=False,
        description="each ledger sees only its own measurements: its cache hits, measured answers and family "
        "models (for evaluations of several agents on one server); calibration still pools every ledger",
    )
    model_cache_mb: float = Field(
        default=512.0,
        gt=0,
        allow_inf_nan=False,
        description="memory the local forecaster's fitted family models may hold (a family of 1,500 "
        "measurements takes about 36 MB); the least recently used are dropped and refitted when asked again",
    )

    @model_validator(mode="before")
    @classmethod
    def _without_surrounding_whitespace(cls, values: object) -> object:
        """Every setting, from the environment or the command line, as `_trimmed`; a list loses entries left
        empty (`FORECASTER_MCP_REPLAY=a.json:\n`)."""
        if not isinstance(values, dict):
            return values
        out: dict[str, object] = {}
        for name, value in values.items():
            path = name in _PATH_SETTINGS
            if isinstance(value, list):
                out[name] = [t for v in value if (t := _trimmed(v, path)) != ""]
            else:
                out[name] = _trimmed(value, path)
        return out

    @property
    def db_path(self) -> Path:
        return self.home / "forecaster.sqlite3"

    @field_validator("home", "nvcc")
    @classmethod
    def _tilde_is_the_users_home(cls, path: Path | str | None) -> Path | str | None:
        """`~/...` as the user's home: an IDE's JSON config passes it as written (no shell expands it), and the
        server then kept its state in a folder named `~` under the IDE's working directory, not where the
        operator commands, run from a shell, create ledgers and tokens."""
        if isinstance(path, Path):
            return path.expanduser()
        return os.path.expanduser(path) if path is not None else None

    @field_validator("allowed_hosts")
    @classmethod
    def _host_header_values(cls, hosts: list[str]) -> list[str]:
        """Each entry as a client's Host header has it (`mcp.example.com`, `mcp.example.com:8443`, `[::1]:*`):
        a URL or a path would never equal a Host header, and the server would refuse every request for it."""
        out = []
        for raw in hosts:
            host = raw.strip()
            if not host:
                continue
            if not _HOST_VALUE.fullmatch(host):
                hint = (
                    " (a URL: pass its host alone)"
                    if "/" in host
                    else " (an IPv6 address goes in brackets: [::1], [::1]:8443)"
                    if host.count(":") > 1 and not host.startswith("[")
                    else ""
                )
                raise ValueError(
                    f"{host[:80]!r} is not a Host header value{hint}: pass a name or address as clients reach "
                    "the server, with :PORT or :* if they name a port, e.g. mcp.example.com or [::1]:8443 "
                    "(--allowed-host, env FORECASTER_MCP_ALLOWED_HOSTS, comma-separated)"
                )
            out.append(host_key(host))
        return out

    @field_validator("anthropic_api_key")
    @classmethod
    def _one_token_key(cls, key: str | None) -> str | None:
        """The key as one token: a trailing newline (from an env file or a mounted secret) stripped, a key with
        spaces or control characters inside refused. It was sent as is, and the API's refusal of the header
        read as "the API could not be reached" (never the key itself in the message)."""
        if key is None:
            return None
        key = key.strip()
        if not key:
            return None
        if any(ch.isspace() or not ch.isprintable() for ch in key):
            raise ValueError(
                "the Anthropic API key has a space or control character inside it: set it to the key alone"
            )
        return key

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> Settings:
        """Read FORECASTER_MCP_* variables (and ANTHROPIC_API_KEY), then apply non-None overrides."""
        env = dict(os.environ if environ is None else environ)
        values: dict[str, object] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None or not raw.strip():  # set to nothing (or a lone newline): unset
                continue
            if field.annotation == list[Path]:
                values[name] = [p for p in raw.split(os.pathsep) if p]
            elif field.annotation == list[str]:
                values[name] = raw.split(",")  # a Host header value holds no comma (nor os.pathsep's ":")
            else:
                values[name] = raw
        if "anthropic_api_key" not in values and env.get("ANTHROPIC_API_KEY"):
            values["anthropic_api_key"] = env["ANTHROPIC_API_KEY"]
        for key, value in overrides.items():
            if value is not None and value != []:
                values[key] = value
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field_name = ".".join(str(p) for p in first["loc"])
            raise OperatorError(
                f"bad setting {field_name} (env {ENV_PREFIX}{field_name.upper()}): {validation_message(first)}"
            ) from exc


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """A line for each FORECASTER_MCP_* variable of the environment that names no setting (a misspelt one would be
    ignored without a word), with the setting it is closest to, if any."""
    import difflib

    env = os.environ if environ is None else environ
    names = [name.upper() for name in Settings.model_fields]
    lines = []
    for var in sorted(env):
        name = var[len(ENV_PREFIX) :]
        if not var.startswith(ENV_PREFIX) or name in names or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
        lines.append(f"{var[:80]} is not a setting{hint}: it is ignored")
    return lines
