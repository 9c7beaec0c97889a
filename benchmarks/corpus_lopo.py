"""Leave-one-problem-out estimate of the static prior on measured pairs of different kernels (not in CI).

    python benchmarks/corpus_lopo.py benchmarks/corpus/measured/h200_2026-11-29.jsonl [--lam 3] [--anchors 0.5]

For each problem of the corpus in turn, the weights of `features.FITTED_TERMS` are refitted (ridge on log2
speedup minus the hand-set part of `prior_shift`) on the other problems' pairs, and the held-out problem's pairs
are forecast as `prior_shift` would with those weights, its spread the training residuals' rms. This is the
honest figure for kernels of problems the fit never saw; `forecaster-mcp eval` on the same pairs is in-sample.
Registers and shared memory come from the measured lines (what ptxas reported on the GPU machine), so the
figures do not depend on the nvcc of the machine running this. Also prints the weights fitted on all pairs.

--load-inline sends each kernel as KernelBench writes it: a Python module compiling the CUDA with torch's
load_inline, the launch in the C++ wrapper of its CUDA string; --cupy as a CuPy RawKernel launched from Python.
Both must give the figures with the launches.

--anchors SHARE measures that share of each workload's kernels (drawn at random, --draws times) and forecasts the
pairs of one measured and one unmeasured kernel twice, with features.anchored_log2_ms (the forecaster's own code,
with the fold's weights and spread): from the pair's measured kernel alone (the plain prior), and anchored on every
measured kernel of the workload, as a store holding an agent's earlier kernels is.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from corpus_pairs import build_pairs, read_measured  # noqa: E402

from forecaster_mcp.forecast import features, metrics  # noqa: E402
from forecaster_mcp.forecast.ptxas import measured_entry  # noqa: E402
from forecaster_mcp.hardware.specs import lookup  # noqa: E402
from forecaster_mcp.models import Kernel  # noqa: E402

NAMES = [name for name, _, _ in features.FITTED_TERMS]


def _features(kernel: Kernel, resources: dict[str, Any] | None, hardware: str) -> features.StaticFeatures:
    return features.kernel_features(kernel, None, lookup(hardware), measured_entry(kernel, resources))


# What an agent's whole .cu file adds to its kernel: a launcher, and a main that fills the inputs, times the
# kernel and checks it in double precision (loops, divisions, fp64: none of them the kernel's).
_HOST_MAIN = """
#include <cstdio>
#include <cstdlib>
#include <cmath>
int main() {
  const int n = 1 << 20;
  float* h = (float*)malloc(n * sizeof(float));
  for (int i = 0; i < n; ++i) h[i] = rand() / (float)RAND_MAX;
  for (int rep = 0; rep < 10; ++rep) launch_ENTRY();
  double err = 0.0;
  for (int i = 0; i < n; i += 7) err = fmax(err, fabs(2.0 * h[i] - h[(i * 2) % n]) / 3.0);
  printf("max error %g\\n", err);
  return 0;
}
"""


def host_launched(kernel: dict[str, Any]) -> dict[str, Any]:
    """The kernel without its `launch`, as a whole .cu file an agent sends: its source followed by host code
    launching it with that launch and a main checking it (`_HOST_MAIN`). What `--host-launch` forecasts."""
    launch = kernel["launch"]
    grid, block = ([*launch[k], 1, 1][:3] for k in ("grid", "block"))
    entry = kernel["entry"]
    host = (
        f"\nvoid launch_{entry}() {{\n  dim3 grid({grid[0]}, {grid[1]}, {grid[2]});\n"
        f"  {entry}<<<grid, dim3({block[0]}, {block[1]}, {block[2]}), {launch.get('shared_mem_bytes', 0)}>>>();\n}}\n"
    )
    source = kernel["source"] + host + _HOST_MAIN.replace("ENTRY", entry)
    return {**{k: v for k, v in kernel.items() if k != "launch"}, "source": source}


# The same kernel as an agent writes it for torch (KernelBench's form): a Python module compiling the CUDA with
# load_inline, a C++ wrapper in the CUDA string launching it, and a module calling the wrapper.
_LOAD_INLINE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
SOURCE
torch::Tensor run(torch::Tensor x) {
  dim3 grid(GRID);
  ENTRY<<<grid, dim3(BLOCK), SHARED>>>();
  return x;
}
"""

module = load_inline(
    name="ENTRY_ext",
    cpp_sources="torch::Tensor run(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["run"],
)


class ModelNew(nn.Module):
    def forward(self, x):
        return module.run(x)
'''


def load_inline_file(kernel: dict[str, Any]) -> dict[str, Any]:
    """The kernel without its `launch`, as a Python source (`_LOAD_INLINE`) whose entry is its module class:
    what `--load-inline` forecasts. The CUDA in its string is read (features.embedded_cuda), and the launch from
    the wrapper there (host_launch)."""
    return _as_python(kernel, _LOAD_INLINE, "ModelNew")


def _as_python(kernel: dict[str, Any], template: str, entry: str) -> dict[str, Any]:
    launch = kernel["launch"]
    grid, block = (", ".join(str(v) for v in [*launch[k], 1, 1][:3]) for k in ("grid", "block"))
    source = (
        template.replace("SOURCE", kernel["source"])
        .replace("GRID", grid)
        .replace("BLOCK", block)
        .replace("SHARED", str(launch.get("shared_mem_bytes", 0)))
        .replace("ENTRY", kernel["entry"])
    )
    keep = {k: v for k, v in kernel.items() if k not in ("launch", "source", "entry", "language")}
    return {**keep, "source": source, "entry": entry, "language": "python"}


# And as a CuPy user writes it: a RawKernel of the CUDA, launched from Python with sizes worked out there.
_CUPY = '''import cupy as cp

kernel = cp.RawKernel(r"""
SOURCE
""", "ENTRY")
THREADS = (BLOCK)


def run(x):
    grid = (GRID)
    kernel(grid, THREADS, (x,), shared_mem=SHARED)
'''


def cupy_file(kernel: dict[str, Any]) -> dict[str, Any]:
    """The kernel without its `launch`, as a CuPy source (`_CUPY`) whose entry is the Python function launching
    it: what `--cupy` forecasts. The launch is read from the Python call (forecast/python_launch.py)."""
    return _as_python(kernel, _CUPY, "run")


def design(
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    host_launch: bool = False,
    load_inline: bool = False,
    cupy: bool = False,
) -> tuple[np.ndarray, ...]:
    """Values of the fitted terms (X), the hand-set shift (rest), log2 speedups and problems."""
    resources = {r["id"]: r["result"].get("resources") for r in rows}
    cache: dict[str, features.StaticFeatures] = {}
    x, rest, y, groups = [], [], [], []
    for p in pairs:
        fs = []
        for side in ("baseline", "candidate"):
            sent = (
                load_inline_file(p[side])
                if load_inline
                else cupy_file(p[side])
                if cupy
                else host_launched(p[side])
                if host_launch
                else p[side]
            )
            k = Kernel.model_validate(sent)
            if k.id not in cache:
                cache[k.id] = _features(k, resources.get(k.id), p["hardware"])
            fs.append(cache[k.id])
        rest.append(features.prior_shift(fs[0], fs[1], fitted=False).mean_log2)
        x.append(features.fitted_values(fs[0], fs[1]))
        y.append(math.log2(p["speedup"]))
        groups.append(p["source"])
    return np.array(x, float), np.array(rest), np.array(y), np.array(groups)


def _ridge(a: np.ndarray, b: np.ndarray, lam: float) -> np.ndarray:
    return np.asarray(np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ b))


def _phi(z: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0))))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("--corpus", type=Path, default=ROOT / "benchmarks" / "corpus")
    ap.add_argument("--lam", type=float, default=3.0, help="ridge penalty")
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument(
        "--anchors", type=float, help="share of each workload's kernels measured (anchors), e.g. 0.5"
    )
    ap.add_argument("--draws", type=int, default=20, help="random draws of the measured kernels (--anchors)")
    ap.add_argument(
        "--host-launch",
        action="store_true",
        help="send each kernel without its launch, as a whole .cu file: followed by host code launching it (read "
        "back by forecast/host_launch.py) and a main checking it in double precision (not the kernel's: "
        "features.without_host_code); the figures must be those with the launches",
    )
    ap.add_argument(
        "--load-inline",
        action="store_true",
        help="send each kernel without its launch, as a Python source compiling it with torch's load_inline, "
        "launched by the C++ wrapper in its CUDA string (KernelBench's form); the figures must be those with the "
        "launches",
    )
    ap.add_argument(
        "--cupy",
        action="store_true",
        help="send each kernel without its launch, as a CuPy RawKernel launched from Python; the figures must be "
        "those with the launches",
    )
    args = ap.parse_args()
    rows = read_measured(args.measured)
    pairs = build_pairs(rows, args.corpus, seed=0)
    x, rest, y, groups = design(rows, pairs, args.host_launch, args.load_inline, args.cupy)
    if args.anchors is not None:
        return _anchored(rows, pairs, x, rest, y, groups, args)
    mu, sd = np.zeros_like(y), np.zeros_like(y)
    for g in sorted(set(groups)):
        train, test = groups != g, groups == g
        w = _ridge(x[train], y[train] - rest[train], args.lam)
        residual = y[train] - rest[train] - x[train] @ w
        mu[test] = x[test] @ w + rest[test]
        sd[test] = math.sqrt(float(np.mean(residual**2)))
    p = _phi(mu / sd)
    speedups = 2.0**y
    t = args.threshold
    verdicts = metrics.verdicts_at(p, t)
    decided = metrics.decided_summary(verdicts, speedups)
    n_decided = sum(v != "unsure" for v in verdicts)
    print(f"{len(pairs)} pairs, {len(set(groups))} problems, leave-one-problem-out:")
    print(
        f"  pairwise accuracy {metrics.pairwise_accuracy(p, speedups):.3f}  ECE {metrics.ece(p, speedups):.3f}  "
        f"Brier {metrics.brier(p, speedups):.3f}  decided {n_decided} ({n_decided / len(pairs):.1%}), "
        f"error among decided {decided.error:.3f}"
    )
    floor, floor_p90 = metrics.ece_if_calibrated(p, speedups)
    print(
        f"  ECE a perfectly calibrated forecaster would show here: {floor:.3f} (90% at most {floor_p90:.3f})"
    )
    for g in sorted(set(groups)):
        m = groups == g
        print(
            f"    {g:20s} {int(m.sum()):3d} pairs  accuracy {metrics.pairwise_accuracy(p[m], speedups[m]):.2f}"
        )
    w = _ridge(x, y - rest, args.lam)
    rms = math.sqrt(float(np.mean((y - rest - x @ w) ** 2)))
    fitted = ", ".join(f"{n} {v:+.2f}" for n, v in zip(NAMES, w, strict=True))
    print(f"  weights on all pairs: {fitted}; residual rms {rms:.2f}")
    return 0


def _summary(p: np.ndarray, speedups: np.ndarray, threshold: float, what: str) -> None:
    verdicts = metrics.verdicts_at(p, threshold)
    decided = metrics.decided_summary(verdicts, speedups)
    n_decided = sum(v != "unsure" for v in verdicts)
    floor, floor_p90 = metrics.ece_if_calibrated(p, speedups)
    print(
        f"{what}: pairwise accuracy {metrics.pairwise_accuracy(p, speedups):.3f}  ECE {metrics.ece(p, speedups):.3f} "
        f"(a calibrated forecaster: {floor:.3f}, 90% at most {floor_p90:.3f})  Brier {metrics.brier(p, speedups):.3f}  "
        f"decided {n_decided / len(p):.1%}, error among decided {decided.error:.3f}"
    )


def _anchored(
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    x: np.ndarray,
    rest: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    args: argparse.Namespace,
) -> int:
    share = args.anchors
    if not 0.0 < share < 1.0:
        raise SystemExit("--anchors is the share of each workload's kernels measured, between 0 and 1")
    resources = {r["id"]: r["result"].get("resources") for r in rows}
    log2_ms = {
        r["id"]: math.log2(r["result"]["runtime_ms"]["median"]) for r in rows if r["result"].get("runtime_ms")
    }
    kernels: dict[str, Kernel] = {}
    members: dict[str, set[str]] = {}
    for pair in pairs:
        for side in ("baseline", "candidate"):
            kernels[pair[side]["id"]] = Kernel.model_validate(pair[side])
            members.setdefault(pair["id"].split(":", 1)[0], set()).add(pair[side]["id"])
    hardware = pairs[0]["hardware"]
    feats = {kid: _features(k, resources.get(kid), hardware) for kid, k in kernels.items()}
    folds = {}
    for g in sorted(set(groups)):
        train = groups != g
        w = _ridge(x[train], y[train] - rest[train], args.lam)
        residual = y[train] - rest[train] - x[train] @ w
        terms = tuple(
            (name, float(wi), why) for (name, _, why), wi in zip(features.FITTED_TERMS, w, strict=True)
        )
        folds[g] = terms, math.sqrt(float(np.mean(residual**2)) / 2.0)
    saved = features.FITTED_TERMS, features.KERNEL_ERROR_SD_LOG2
    figures: dict[str, list[np.ndarray]] = {"the pair's other kernel alone": [], "anchored": []}
    try:
        for draw in range(args.draws):
            rng = random.Random(draw)
            measured: set[str] = set()
            for _, ids in sorted(members.items()):
                order = sorted(ids)
                rng.shuffle(order)
                measured |= set(order[: max(1, int(len(order) * share))])
            p: dict[str, list[float]] = {what: [] for what in figures}
            speedups: list[float] = []
            for pair, g in zip(pairs, groups, strict=True):
                b, c = pair["baseline"]["id"], pair["candidate"]["id"]
                if (b in measured) == (c in measured):
                    continue
                features.FITTED_TERMS, features.KERNEL_ERROR_SD_LOG2 = folds[g]
                known, unknown = (b, c) if b in measured else (c, b)
                others = sorted(members[pair["id"].split(":", 1)[0]] & measured - {b, c})
                for what, anchors in (
                    ("the pair's other kernel alone", [known]),
                    ("anchored", [known, *others]),
                ):
                    t, sd, _ = features.anchored_log2_ms(
                        feats[unknown], [(feats[m], log2_ms[m]) for m in anchors], unknown == c
                    )
                    mean = log2_ms[b] - t if unknown == c else t - log2_ms[c]
                    p[what].append(float(_phi(np.array([mean / sd]))[0]))
                speedups.append(pair["speedup"])
            s_arr = np.array(speedups)
            for what, values in p.items():
                q = np.array(values)
                verdicts = metrics.verdicts_at(q, args.threshold)
                n_decided = sum(v != "unsure" for v in verdicts)
                figures[what].append(
                    np.array(
                        [
                            metrics.pairwise_accuracy(q, s_arr),
                            metrics.ece(q, s_arr),
                            metrics.brier(q, s_arr),
                            n_decided / len(q),
                            metrics.decided_summary(verdicts, s_arr).error if n_decided else 0.0,
                            len(q),
                        ]
                    )
                )
    finally:
        features.FITTED_TERMS, features.KERNEL_ERROR_SD_LOG2 = saved
    print(
        f"{share:.0%} of each workload's kernels measured ({args.draws} random draws), pairs of one measured and "
        "one unmeasured kernel, leave-one-problem-out; means over the draws:"
    )
    for what, rows_ in figures.items():
        acc, ece, brier, decided, error, n = np.mean(rows_, axis=0)
        print(
            f"  {what:30s} {n:.0f} pairs  accuracy {acc:.3f}  ECE {ece:.3f}  Brier {brier:.4f}  "
            f"decided {decided:.1%}, error among decided {error:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
