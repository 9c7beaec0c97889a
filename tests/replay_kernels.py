"""Kernels of the shared A100 convolution recording, as agents send them for replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONV_SOURCE = "// convolution_kernel from benchmark_hub kernels/convolution_milo.cu (source not bundled)\n"
# The recording's fastest configuration (0.55 ms).
FAST: dict[str, int] = {
    "block_size_x": 32,
    "block_size_y": 4,
    "tile_size_x": 1,
    "tile_size_y": 3,
    "read_only": 1,
    "use_padding": 0,
    "use_shmem": 1,
    "use_cmem": 1,
    "filter_height": 15,
    "filter_width": 15,
}
# Its slowest (32 ms) and one recorded as a RuntimeFailedConfig.
SLOW = {**FAST, "block_size_x": 16, "block_size_y": 8, "tile_size_x": 4, "tile_size_y": 4, "use_shmem": 0}
FAILS = {**FAST, "block_size_y": 16, "tile_size_x": 2, "tile_size_y": 4, "use_shmem": 0}


def conv(kid: str | None, params: dict[str, int]) -> dict[str, Any]:
    """A convolution kernel dict; `kid=None` leaves the id to the server (k0, k1, ...)."""
    k: dict[str, Any] = {"source": CONV_SOURCE, "entry": "convolution_kernel", "defines": params}
    if kid is not None:
        k["id"] = kid
    return k


def conv_block(bx: int, by: int, kid: str | None = None) -> dict[str, Any]:
    """FAST with another block shape."""
    return conv(kid, {**FAST, "block_size_x": bx, "block_size_y": by})


def small_recording(path: Path, cache: dict[str, dict[str, object]]) -> Path:
    """A small Kernel Tuner cache file at `path`: kernel `kk` on an A100, one tuning parameter `bx`."""
    doc = {
        "device_name": "NVIDIA A100-PCIE-40GB",
        "kernel_name": "kk",
        "problem_size": [1024],
        "tune_params_keys": ["bx"],
        "tune_params": {"bx": [32, 64, 128]},
        "objective": "time",
        "cache": cache,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path
