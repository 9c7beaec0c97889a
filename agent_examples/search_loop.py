"""An autonomous tuning loop that asks the forecaster first and measures only what it cannot decide.

It speaks plain MCP (any server URL or a stdio command works the same way). By default it starts
`forecaster-mcp serve --replay RECORDING` over stdio, so it runs anywhere without a GPU:

    python agent_examples/search_loop.py path/to/space.json.gz --measurements 40

Copy it as the skeleton of your own loop: swap `propose()` for your kernel generator.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters


def load_space(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Kernel name and every configuration of a Kernel Tuner cache file (the candidates a tuner may try)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    keys = doc["tune_params_keys"]
    return doc["kernel_name"], [{k: entry[k] for k in keys} for entry in doc["cache"].values()]


async def tool(client: Client, name: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    if result.is_error:
        raise RuntimeError(" ".join(getattr(c, "text", "") for c in result.content))
    assert result.structured_content is not None
    return result.structured_content


async def search(
    recording: Path, measurements: int, pool_size: int, seed: int, max_idle_rounds: int = 20
) -> None:
    entry, configs = load_space(recording)
    pool_size = min(pool_size, 63)  # compare_kernels takes 64 kernels: the pool plus the best so far
    rng = random.Random(seed)
    source = f"// {entry} (tuning space replayed from {recording.name})\n"

    def kernel(kid: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"id": kid, "source": source, "entry": entry, "defines": params}

    def propose(n: int) -> list[dict[str, Any]]:
        return rng.sample(configs, n)

    with tempfile.TemporaryDirectory() as home:
        server = StdioServerParameters(
            command=sys.executable,
            args=["-m", "forecaster_mcp", "serve", "--replay", str(recording)],
            env={"FORECASTER_MCP_HOME": home},
        )
        async with Client(server, read_timeout_seconds=120) as client:
            best: dict[str, Any] | None = None
            best_ms = float("inf")
            used = considered = idle = 0
            while used < measurements:
                pool = [kernel(f"c{considered + i}", p) for i, p in enumerate(propose(pool_size))]
                considered += len(pool)
                if best is None:  # nothing measured yet: measure one to anchor the comparisons
                    to_measure = [pool[0]]
                else:
                    out = await tool(
                        client, "compare_kernels", {"candidates": [best, *pool], "baseline": best["id"]}
                    )
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
                    res = await tool(client, "measure_kernel", {"kernel": k})
                    used += 1
                    if res["status"] == "ok" and res["runtime_ms"]["median"] < best_ms:
                        best, best_ms = {**k, "id": "best"}, res["runtime_ms"]["median"]
                        print(f"measurement {used:3d}: new best {best_ms:.4g} ms ({k['id']})")
            status = await tool(client, "budget_status", {})
            print(
                f"best {best_ms:.4g} ms after {used} measurements, {considered} candidates considered, "
                f"{status['spent_gpu_seconds']:.3f} GPU-seconds spent"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", type=Path)
    p.add_argument("--measurements", type=int, default=40)
    p.add_argument("--pool", type=int, default=32, help="candidates proposed per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-idle-rounds", type=int, default=20, help="stop after this many rounds with nothing to measure"
    )
    a = p.parse_args()
    anyio.run(search, a.recording, a.measurements, a.pool, a.seed, a.max_idle_rounds)


if __name__ == "__main__":
    main()
