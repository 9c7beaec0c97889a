r"""An autonomous tuning loop that asks the forecaster first and measures only what it cannot decide.

It speaks plain MCP. By default it starts its own `forecaster-mcp serve --replay RECORDING` over stdio, in a
throw-away state folder, so it runs anywhere without a GPU (use the Python of the venv forecaster-mcp is in):

    .venv/bin/python agent_examples/search_loop.py path/to/space.json.gz --measurements 40

With `--url` it drives a running HTTP server instead (started with `serve --http --replay` of the same
recording), sending the bearer token in FORECASTER_MCP_TOKEN and charging that token's ledger:

    FORECASTER_MCP_TOKEN=fmcp_... .venv/bin/python agent_examples/search_loop.py space.json.gz \
        --url http://gpu-box:8765/mcp

An exhausted budget ends the loop (forecasts stay free; `--gpu-seconds` sets the budget of the server it
starts); it prints what it found and spent.
Copy it as the skeleton of your own loop: swap `propose()` for your kernel generator.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client


def load_space(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Kernel name and every configuration of a Kernel Tuner cache file (the candidates a tuner may try)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    keys = doc["tune_params_keys"]
    return doc["kernel_name"], [{k: entry[k] for k in keys} for entry in doc["cache"].values()]


class ToolRefused(Exception):
    """A tool answered with an error (an exhausted budget, a kernel not in the recording): the server's message."""


async def tool(client: Client, name: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    if result.is_error:
        raise ToolRefused(" ".join(getattr(c, "text", "") for c in result.content))
    assert result.structured_content is not None
    return result.structured_content


def server_env(home: str, gpu_seconds: float | None) -> dict[str, str]:
    """The environment of the stdio server this loop starts: the caller's FORECASTER_MCP_* settings and
    Anthropic key (a Claude forecaster, a measure cap), its own throw-away state folder and `default` ledger,
    whose limit is `gpu_seconds` when given."""
    own = ("FORECASTER_MCP_HOME", "FORECASTER_MCP_LEDGER", "FORECASTER_MCP_TOKEN")
    env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith(("FORECASTER_MCP_", "ANTHROPIC_")) and k not in own) or k in ("PATH", "HOME")
    }
    env["FORECASTER_MCP_HOME"] = home
    if gpu_seconds is not None:
        env["FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS"] = repr(gpu_seconds)
    return env


@asynccontextmanager
async def connect(
    recording: Path, url: str | None, token: str | None, gpu_seconds: float | None = None
) -> AsyncIterator[Client]:
    """A client of the server at `url` (bearer token), or of a stdio server this loop starts on `recording`
    with a budget of `gpu_seconds`."""
    if url is not None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
            async with Client(
                streamable_http_client(url, http_client=http), read_timeout_seconds=120
            ) as client:
                yield client
        return
    with tempfile.TemporaryDirectory() as home:
        server = StdioServerParameters(
            command=sys.executable,
            args=["-m", "forecaster_mcp", "serve", "--replay", str(recording)],
            env=server_env(home, gpu_seconds),
        )
        async with Client(server, read_timeout_seconds=120) as client:
            yield client


async def search(
    recording: Path,
    measurements: int,
    pool_size: int,
    seed: int,
    max_idle_rounds: int = 20,
    url: str | None = None,
    token: str | None = None,
    gpu_seconds: float | None = None,
) -> None:
    entry, configs = load_space(recording)
    # compare_kernels takes 64 kernels: the pool plus the best so far
    pool_size = max(1, min(pool_size, 63, len(configs)))
    rng = random.Random(seed)
    source = f"// {entry} (tuning space replayed from {recording.name})\n"

    def kernel(kid: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"id": kid, "source": source, "entry": entry, "defines": params}

    def key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(params.items()))

    measured: set[tuple[tuple[str, Any], ...]] = set()
    seen: set[tuple[tuple[str, Any], ...]] = set()  # distinct configurations forecast or measured

    def propose(n: int) -> list[dict[str, Any]]:
        fresh = [p for p in configs if key(p) not in measured]
        return rng.sample(fresh, min(n, len(fresh)))

    async with connect(recording, url, token, gpu_seconds) as client:
        # A token's ledger may have been spent on before (another run of the same agent): this run's spend is
        # what budget_status says at the end less what it said at the start.
        spent_before = (await tool(client, "budget_status", {}))["spent_gpu_seconds"]
        best: dict[str, Any] | None = None
        best_ms = float("inf")
        used = proposed = idle = 0
        refused: str | None = None
        while used < measurements and refused is None:
            pool = [kernel(f"c{proposed + i}", p) for i, p in enumerate(propose(pool_size))]
            if not pool:
                print("stopping: every configuration of the space is measured")
                break
            proposed += len(pool)
            if best is None:  # nothing measured yet: measure one to anchor the comparisons
                to_measure = [pool[0]]
            else:
                out = await tool(
                    client, "compare_kernels", {"candidates": [best, *pool], "baseline": best["id"]}
                )
                seen.update(key(k["defines"]) for k in pool)
                by_id = {k["id"]: k for k in pool}
                to_measure = [by_id[i] for i in out["measure_next"] if i in by_id][:2]
            # measure_next is empty when the forecaster is sure every proposal is slower than the best:
            # propose again, but do not spin forever on a search that has converged.
            idle = 0 if to_measure else idle + 1
            if not to_measure and idle >= max_idle_rounds:
                print(f"stopping: {idle} rounds in a row had nothing worth measuring")
                break
            for k in to_measure:
                if used >= measurements:
                    break
                try:
                    res = await tool(client, "measure_kernel", {"kernel": k})
                except ToolRefused as exc:  # e.g. the budget is spent: nothing ran, nothing was charged
                    refused = str(exc)
                    print(f"stopping: the server refused a measurement: {refused}")
                    break
                used += 1
                measured.add(key(k["defines"]))
                seen.add(key(k["defines"]))
                if res["status"] == "ok" and res["runtime_ms"]["median"] < best_ms:
                    best, best_ms = {**k, "id": "best"}, res["runtime_ms"]["median"]
                    print(f"measurement {used:3d}: new best {best_ms:.4g} ms ({k['id']})")
        status = await tool(client, "budget_status", {})
        found = f"best {best_ms:.4g} ms" if best is not None else "no configuration ran"
        print(
            f"{found} after {used} measurements, {len(seen)} candidates considered, "
            f"{status['spent_gpu_seconds'] - spent_before:.3f} GPU-seconds spent"
        )


def first_cause(exc: BaseException) -> BaseException:
    """The first error inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", type=Path)
    p.add_argument("--measurements", type=int, default=40, help="most measurements to make (default 40)")
    p.add_argument("--pool", type=int, default=32, help="candidates proposed per round (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu-seconds",
        type=float,
        help="budget of the stdio server this loop starts (default: the server's, 600 unless "
        "FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS says otherwise); with --url the token's ledger decides",
    )
    p.add_argument(
        "--max-idle-rounds", type=int, default=20, help="stop after this many rounds with nothing to measure"
    )
    p.add_argument(
        "--url",
        help="drive the HTTP server at this URL (e.g. http://gpu-box:8765/mcp; token in env FORECASTER_MCP_TOKEN) "
        "instead of starting a stdio server",
    )
    a = p.parse_args()
    try:
        load_space(a.recording)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        p.error(f"{a.recording} is not a readable Kernel Tuner cache file (.json or .json.gz): {exc!r}")
    if a.gpu_seconds is not None and (a.url is not None or not a.gpu_seconds >= 0):
        p.error(
            "--gpu-seconds is the budget of the server this loop starts: a number >= 0, and not with --url"
        )
    token = os.environ.get("FORECASTER_MCP_TOKEN", "").strip() or None  # a token file read with its newline
    if a.url is not None and not token:
        p.error(
            "--url needs a bearer token in FORECASTER_MCP_TOKEN (forecaster-mcp token issue --ledger NAME)"
        )
    try:
        anyio.run(
            search,
            a.recording,
            a.measurements,
            a.pool,
            a.seed,
            a.max_idle_rounds,
            a.url,
            token,
            a.gpu_seconds,
        )
    except Exception as exc:  # the client's task group wraps what went wrong: say it in one line
        cause = first_cause(exc)
        if isinstance(cause, ToolRefused):
            sys.exit(f"search_loop.py: the server refused a call: {cause}")
        if a.url is None:
            raise
        sys.exit(
            f"search_loop.py: cannot use the server at {a.url}: {type(cause).__name__}: {cause} (check the URL, "
            "and that FORECASTER_MCP_TOKEN is an active token: the MCP client reports a refused one as "
            "'Server returned an error response')"
        )


if __name__ == "__main__":
    main()
