#!/usr/bin/env bash
# One prepared GPU session (device time is scarce): measure the different-kernels corpus through the product's
# measurer, then the GPU tests and the bundled-examples check (benchmarks/gpu_check.sh) with shorter limits.
# About 9 minutes at most. From the repository root, with .whl/ prepared as gpu_check.sh says:
#     OUT=/some/dir bash benchmarks/gpu_session.sh
# $OUT receives session.log, corpus.jsonl (one line per measured kernel) and check.tar.gz (gpu_check.sh's files).
set -uo pipefail
OUT=${OUT:-out/gpu_session}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PATH="$PATH:/usr/local/cuda/bin" PYTHONUNBUFFERED=1
VENV=${VENV:-.gpu-venv}
if "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"; then
    "$VENV/bin/python" -m pip install --no-index --find-links .whl --quiet pycuda pydantic anyio pytest hypothesis numpy
else
    # No venv module on the image: the wheels into a target folder, and a python that sees it.
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 2
    rm -rf "$VENV"  # a half-made venv's bin/python is a link to the system python: never write through it
    mkdir -p "$VENV/bin"
    printf '#!/bin/sh\nPYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "${PYTHON:-python3}" >"$VENV/bin/python"
    chmod +x "$VENV/bin/python"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv || true
nproc

echo "== corpus (different kernels per problem)"
PYTHONPATH=. timeout "${CORPUS_TIMEOUT:-240}" "$VENV/bin/python" benchmarks/measure_corpus.py \
    --out "$OUT/corpus.jsonl" --budget-s "${CORPUS_BUDGET:-210}"
echo "corpus exit $?"

echo "== gpu_check.sh (GPU tests, examples, noise)"
work=/tmp/gpu_check
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} CHECK_TIMEOUT=${CHECK_TIMEOUT:-90} CHECK_ARGS="--repeats 3 --runs 100" \
    OUT=$work VENV=$VENV bash benchmarks/gpu_check.sh
echo "gpu_check exit $?"
tar -czf "$OUT/check.tar.gz" -C "$work" --exclude=cache . && echo "packed $(du -h "$OUT/check.tar.gz" | cut -f1)"
