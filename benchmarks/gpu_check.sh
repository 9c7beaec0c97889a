#!/usr/bin/env bash
# GPU check for the pycuda backend, one script for a GPU machine without a package registry (e.g. an H200 image
# with python3.12). Not run in CI; about 10 minutes at most (timeouts 300 s + 240 s). From the repository root:
#     OUT=/some/dir bash benchmarks/gpu_check.sh
# It (1) installs the wheels carried in .whl/ into a venv that also sees the image's site packages (numpy,
# torch/triton if present), (2) runs the GPU tests (tests/test_gpu_real.py),
# (3) measures the bundled examples and writes a Kernel Tuner cache recording, and (4) compares timing noise
# of the harness with a plain CUDA-event loop and triton.testing.do_bench. Everything lands in $OUT.
#
# Prepare .whl/ on a machine with a registry (same Python minor version as the GPU image):
#     bash ../shared/tools/pycuda/build_wheel.sh python3.12 .whl
#     python3.12 -m pip download -d .whl --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#         pydantic anyio pytest hypothesis mako pytools platformdirs typing_extensions siphash24 numpy
# (done in the session that wrote this script: .whl/ holds pycuda 2026.1 for cp312 and those, 27 MB).
set -uo pipefail
OUT=${OUT:-out/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,persistence_mode --format=csv || true
"$PY" -V
# The measurer compiles with nvcc on the measuring machine; without it every measurement is refused.
PATH="$PATH:/usr/local/cuda/bin"
nvcc --version | tail -1 || { echo "nvcc not found: install the CUDA toolkit (or set FORECASTER_MCP_NVCC)"; status=1; }

echo "== environment"
VENV=${VENV:-.gpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV" || exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    # By name, not every file: what the image already has (numpy, torch's deps) stays as it is.
    "$VENV/bin/python" -m pip install --no-index --find-links .whl --quiet \
        pycuda pydantic anyio pytest hypothesis numpy || status=1
fi
"$VENV/bin/python" - <<'PY' || exit 2
import importlib.util, sys
missing = [m for m in ("pycuda", "numpy", "pydantic", "anyio", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing on this machine: {', '.join(missing)} (carry wheels in .whl/)")
import pycuda.driver as cuda
cuda.init()
print(f"pycuda {__import__('pycuda').VERSION_TEXT}, CUDA driver {cuda.get_driver_version()}, {cuda.Device.count()} device(s)")
PY

echo "== GPU tests"
# Only the GPU-marked tests: the CPU tests of the same code run in CI; device time is scarce.
FORECASTER_MCP_GPU_TESTS=1 PYTHONPATH=. timeout "${TESTS_TIMEOUT:-300}" "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
    --junitxml "$OUT/gpu-tests.xml" tests/test_gpu_real.py || status=1

echo "== examples, recording, noise"
PYTHONPATH=. timeout "${CHECK_TIMEOUT:-240}" "$VENV/bin/python" benchmarks/gpu_check.py --out "$OUT" ${CHECK_ARGS:-} || status=1

echo "== done (status $status); results in $OUT"
exit $status
