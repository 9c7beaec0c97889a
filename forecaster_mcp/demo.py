"""`forecaster-mcp demo`: start a server over stdio and drive it as an MCP client, in one screen."""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from forecaster_mcp.errors import BUDGET_EXHAUSTED_TEXT, OperatorError
from forecaster_mcp.server.client import ToolCaller, ToolCallFailed, connect_stdio, tool_failure
from forecaster_mcp.settings import Settings

if TYPE_CHECKING:
    from forecaster_mcp.measure.replay import ReplaySpace

_SHARED = Path(__file__).resolve().parents[2] / "shared/datasets/kernel_tuner_benchmark_hub/cachefiles"
_EXAMPLE = "convolution_milo/A100.json.gz"


def recording_hint() -> str:
    """A recording to try: the project's data folder beside this checkout when it is there (as a path from the
    current folder), else where Kernel Tuner cache files come from."""
    found = _SHARED / _EXAMPLE
    if found.is_file():
        return os.path.relpath(found)
    return (
        f"a Kernel Tuner cache file, e.g. cachefiles/{_EXAMPLE} of the AutoTuningAssociation/benchmark_hub "
        "repository on GitHub"
    )


def _row(c: dict[str, Any]) -> str:
    return (
        f"  {c['id']:<22} p_faster {c['p_faster']:5.2f}  ~{c['expected_speedup']:5.2f}x  "
        f"{c['verdict']:<7} {c['decided_by']}\n      {textwrap.shorten(c['rationale'], 160, placeholder=' …')}"
    )


async def _forecast_examples(call: ToolCaller, hardware: str) -> None:
    from forecaster_mcp.examples import load_examples

    print(f"\n== 1. Forecasts on bundled example kernels (hardware {hardware}; free, no GPU needed)")
    for suite in load_examples():
        if suite.name.startswith("bad"):
            continue
        kernels = [k.kernel.model_dump(exclude_none=True) for k in suite.kernels]
        out = await call(
            "compare_kernels",
            {
                "candidates": kernels,
                "workload": suite.workload.model_dump(exclude_none=True),
                "baseline": suite.reference_id,
                "hardware": hardware,
            },
        )
        print(f"{suite.name}: {suite.description}")
        print(f"  baseline {out['baseline']}; ranking {' > '.join(out['ranking'])}")
        for c in out["candidates"]:
            print(_row(c))
    info = out["forecaster"]
    answered = info.get("answered")
    # Who answered this call: a configured forecaster that was skipped (an unreachable API) is not named.
    shown = ", ".join(answered) if answered else f"{info['name']} {info['version']}"
    print(f"  forecaster: {shown}")
    for note in out.get("notes") or []:
        if "skipped" in note:
            print(f"  note: {note}")


async def _measure_without_gpu(call: ToolCaller) -> None:
    from forecaster_mcp.examples import load_examples

    suite = load_examples()[0]
    print("\n== 2. Measuring needs a GPU or a recording")
    try:
        await call(
            "measure_kernel",
            {
                "kernel": suite.kernels[0].kernel.model_dump(exclude_none=True),
                "workload": suite.workload.model_dump(),
            },
        )
        print("  measured on this machine's GPU")
    except ToolCallFailed as exc:
        print(f"  the server answers the agent: {exc}")
    print(
        "  To see the full loop (forecast -> measure the unsure -> the forecaster learns), pass a Kernel Tuner\n"
        f"  recording to replay: forecaster-mcp demo --replay {recording_hint()}"
    )


START_TRIES = 3  # starting configurations tried before the demo gives up on the search loop
POOL = 16  # candidates forecast per round


def _pick_space(replay: list[Path]) -> ReplaySpace:
    """The recording the demo searches: the first one (folders expanded as `serve --replay` does, files in name
    order) with a configuration that ran. OperatorError before any server starts when there is none."""
    from forecaster_mcp.measure.replay import ReplayMeasurer, load_space

    # The server the demo starts would refuse a file that is not a recording and exit before the client
    # connects (a "connection closed" traceback): read the headers here, as that server would, and say why.
    measurer = ReplayMeasurer(replay)
    problems: list[str] = [
        f"{p}: a `forecaster-mcp export` file replays only the kernels it holds, not a space to search"
        for p in replay
        if str(p).endswith(".jsonl")
    ]
    for header in measurer.headers():
        try:
            space = load_space(header.path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if any(e.ok for e in space.entries):
            return space
        n = len(space.entries)
        problems.append(
            f"{header.path}: "
            + (
                f"none of its {n} recorded configurations ran successfully"
                if n
                else "no configurations recorded"
            )
        )
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise OperatorError(
        f"no recording to search: {'; '.join(problems[:3])}{more}. The demo needs a Kernel Tuner cache file with "
        f"at least one configuration that ran (try {recording_hint()})"
    )


async def _replay_loop(call: ToolCaller, space: ReplaySpace, rounds: int = 6) -> None:
    recording = space.path
    valid = [e for e in space.entries if e.ok and e.time_ms is not None]
    rng = random.Random(7)
    source = f"// {space.kernel_name}: tuning space replayed from {recording.name} (source not bundled)\n"

    def kernel(kid: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"id": kid, "source": source, "entry": space.kernel_name, "defines": params}

    print(
        f"\n== 2. Forecast-first search over {len(space.entries)} recorded configurations of "
        f"{space.kernel_name} on {space.device} ({recording})"
    )
    spent = 0.0
    considered = 0
    best_ms: float | None = None
    untried = list(valid)
    for _ in range(min(START_TRIES, len(valid))):
        best = untried.pop(rng.randrange(len(untried))).params  # rng.choice(valid), never the same one twice
        first = await call("measure_kernel", {"kernel": kernel("start", best)})
        spent += first["cost"]["gpu_seconds"]
        considered += 1
        if first["status"] == "ok" and first["runtime_ms"] is not None:
            best_ms = first["runtime_ms"]["median"]
            print(f"  measured a random starting configuration to compare against: {best_ms:.4g} ms")
            break
        print(f"  starting configuration {best}: {first['status']} ({first.get('message') or 'no runtime'})")
    if best_ms is None:
        # Not raised: an error inside the client's task group would reach the operator as a traceback.
        print(
            f"  no starting configuration could be replayed ({considered} tried, {spent:.3f} GPU-seconds); "
            "the search needs one: pass another recording"
        )
        return
    for r in range(rounds):
        sample = rng.sample(space.entries, min(POOL, len(space.entries)))
        pool = [kernel(f"c{r}_{i}", e.params) for i, e in enumerate(sample)]
        out = await call("compare_kernels", {"candidates": [kernel("best", best), *pool], "baseline": "best"})
        considered += len(pool)
        decided = sum(c["verdict"] != "unsure" for c in out["candidates"])
        to_measure = [i for i in out["measure_next"] if i != "best"][:3]
        print(
            f"  round {r + 1}: {len(pool)} candidates, {decided} decided by forecast, measuring {len(to_measure)} "
            f"({', '.join(to_measure) or '-'})"
        )
        by_id = {k["id"]: k for k in pool}
        for kid in to_measure:
            res = await call("measure_kernel", {"kernel": by_id[kid]})
            spent += res["cost"]["gpu_seconds"]
            if res["status"] == "ok" and res["runtime_ms"]["median"] < best_ms:
                best_ms, best = res["runtime_ms"]["median"], by_id[kid]["defines"]
                print(f"    new best {kid}: {best_ms:.4g} ms")
            elif res["status"] != "ok":
                print(f"    {kid}: {res['status']}")
    space_best = min(e.time_ms for e in valid if e.time_ms is not None)
    print(
        f"  best found {best_ms:.4g} ms = {space_best / best_ms:.2f} of the space's best ({space_best:.4g} ms); "
        f"{considered} candidates considered for {spent:.3f} GPU-seconds"
    )


async def _demo(settings: Settings, space: ReplaySpace | None, home: Path, ledger: str | None) -> None:
    # The server replays only the recording the demo searches: its device is then the server's default one.
    replay = [space.path] if space is not None else []
    # Exactly that recording: not also those a FORECASTER_MCP_REPLAY in this environment names.
    no_env_replay = {"FORECASTER_MCP_REPLAY": ""}
    async with connect_stdio(home, replay=replay, ledger=ledger, extra_env=no_env_replay) as (client, call):
        tools = [t.name for t in (await client.list_tools()).tools]
        print(f"Started `forecaster-mcp serve` over stdio (state in {home}); tools: {', '.join(tools)}")
        await _forecast_examples(call, settings.hardware or "H100")
        if space is not None:
            await _replay_loop(call, space)
        else:
            await _measure_without_gpu(call)
        status = await call("budget_status", {})
        print(
            f"\n== 3. Budget (ledger {status['ledger']}): limit {status['limit_gpu_seconds']:.1f} GPU-s, "
            f"spent {status['spent_gpu_seconds']:.3f}, remaining {status['remaining_gpu_seconds']:.3f}; "
            f"{status['measurements']['count']} measurements ({status['measurements']['cache_hits']} cache hits); "
            f"{status['forecasts']['count']} forecasts, {status['forecasts']['decided']} decided, "
            f"{status['forecasts']['verified']} verified (decided, then both kernels measured)"
        )


def demo_command(settings: Settings, args: argparse.Namespace) -> int:
    """Run the demo in a throw-away state directory unless --home was given."""
    # --replay, else the recordings FORECASTER_MCP_REPLAY names (Settings.from_env, as for `serve`).
    replay = list(settings.replay)
    missing = [str(p) for p in replay if not p.exists()]
    if missing:
        hint = recording_hint()
        also = f" (try {hint})" if hint not in missing else ""
        print(f"forecaster-mcp demo: recording not found: {', '.join(missing)}{also}")
        return 2
    space = _pick_space(replay) if replay else None
    throw_away = args.home is None
    try:
        if not throw_away:
            anyio.run(_demo, settings, space, Path(args.home), None)
            return 0
        # A fresh state directory holds only the ledger a stdio server creates, `default`: a FORECASTER_MCP_LEDGER
        # naming another one (as the agent configurations set) could not exist there.
        with tempfile.TemporaryDirectory(prefix="forecaster-mcp-demo-") as tmp:
            anyio.run(_demo, settings, space, Path(tmp), "default")
        return 0
    except Exception as exc:
        # A refused tool call (an exhausted budget, a ledger that does not exist) ends the demo with the server's
        # own message, not with the traceback of the client's task group.
        failure = tool_failure(exc)
        if failure is None:
            raise
        hint = ""
        if throw_away and BUDGET_EXHAUSTED_TEXT in str(failure):
            hint = (
                f" (the demo's throw-away ledger 'default' gets FORECASTER_MCP_DEFAULT_LEDGER_GPU_SECONDS = "
                f"{settings.default_ledger_gpu_seconds:g} GPU-seconds: unset it or raise it)"
            )
        raise OperatorError(f"the demo stopped: the server refused a tool call: {failure}{hint}") from exc
