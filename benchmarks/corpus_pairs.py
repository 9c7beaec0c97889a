"""Turn measured corpus lines (`measure_corpus.py`) into a pairs file for `forecaster-mcp eval`.

    python benchmarks/corpus_pairs.py OUT/corpus.jsonl --out pairs.jsonl [--corpus benchmarks/corpus]

Every two kernels of one suite that both measured ok make one pair of *different* kernels (same workload and
hardware, different source); which one is the baseline is drawn at random (seeded), so the file is not
"naive first". The speedup is the ratio of median runtimes. Sources come from the corpus index beside the
measurements (the measured lines leave them out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forecaster_mcp.examples import load_examples  # noqa: E402


def read_measured(path: Path) -> list[dict[str, Any]]:
    """The lines `measure_corpus.py` wrote; a one-line exit for a missing or malformed file."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise SystemExit(f"cannot read {path}: {e.strerror}; pass the .jsonl measure_corpus.py wrote") from e
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path} is not JSON lines ({e}); pass the .jsonl measure_corpus.py wrote") from e
    if not all(isinstance(r, dict) and "result" in r and "suite" in r for r in rows):
        raise SystemExit(f"{path} holds no measure_corpus.py lines (each needs 'suite' and 'result')")
    return rows


def build_pairs(rows: list[dict[str, Any]], corpus: Path, seed: int = 0) -> list[dict[str, Any]]:
    sources = {
        ex.kernel.id: ex.kernel.source
        for p in sorted(corpus.glob("*.json"))
        for s in load_examples(p)
        for ex in s.kernels
    }
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["result"]["status"] == "ok" and row["result"].get("runtime_ms"):
            by_suite.setdefault(row["suite"], []).append(row)
    rng = random.Random(seed)
    pairs: list[dict[str, Any]] = []
    for suite, members in sorted(by_suite.items()):
        for a, b in itertools.combinations(members, 2):
            if rng.random() < 0.5:
                a, b = b, a
            ta, tb = a["result"]["runtime_ms"]["median"], b["result"]["runtime_ms"]["median"]
            pairs.append(
                {
                    "id": f"{suite}:{a['id']}->{b['id']}",
                    "hardware": a["hardware"],
                    "workload": a["workload"],
                    "baseline": {**a["kernel"], "source": sources[a["id"]]},
                    "candidate": {**b["kernel"], "source": sources[b["id"]]},
                    "speedup": ta / tb,
                    "source": f"corpus/{a['problem']}",
                }
            )
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=ROOT / "benchmarks" / "corpus")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = read_measured(args.measured)
    pairs = build_pairs(rows, args.corpus, args.seed)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(f"{len(pairs)} pairs from {len(rows)} measured kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
