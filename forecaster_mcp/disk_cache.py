"""The bound on each of the state folder's disk caches (ptxas results, compiled kernels, Claude's answers).

Each cache is kept for free work that is worth keeping (a compile, a paid answer), and each grew without end under
a client asking new questions. Past its bound the least recently used entries go (by modification time: a use
touches an entry), down to a low-water mark of the bound, never one its owner spares (in use, or used lately). A
process scans a folder on its first write to it and again each time it wrote another tenth of the bound
(`WritesSinceScan`): the folder may stand that much over its bound between scans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SCAN_EVERY = 0.1  # of the bound: written since the last scan, a folder is scanned again


class WritesSinceScan:
    """The bytes this process wrote to each cache folder since it last scanned it (`evict_least_recent`)."""

    def __init__(self) -> None:
        self._written: dict[Path, int] = {}
        self._lock = threading.Lock()

    def due(self, folder: Path, size: int, limit_bytes: int) -> bool:
        """Whether `folder` (bounded to `limit_bytes`) is due a scan now that `size` more bytes were written."""
        with self._lock:
            before = self._written.get(folder)
            written = size + (before or 0)
            due = before is None or written >= limit_bytes * SCAN_EVERY
            self._written[folder] = 0 if due else written
            return due


def evict_least_recent(
    folder: Path,
    limit_bytes: int,
    low_water: float,
    *,
    what: str,
    spare: Callable[[str], bool] = lambda path: False,
    spare_lock: threading.Lock | None = None,
    min_age_s: float = 0.0,
) -> int:
    """Remove the least recently used entries of `folder` while it holds over `limit_bytes`, down to `low_water` of
    it; how many went. An entry is a file (its size, its modification time), or a folder (its files' sizes, the
    latest of their times). Never one `spare` names (asked just before its removal, under `spare_lock`: an owner
    that takes an entry under that lock has it spared, or sees it gone), nor one used within `min_age_s`. `what`
    names the cache in the log."""
    entries: list[tuple[float, int, str]] = []
    total = 0
    try:
        with os.scandir(folder) as it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        size, used = 0, 0.0
                        with contextlib.suppress(OSError), os.scandir(entry.path) as files:
                            for f in files:
                                st = f.stat(follow_symlinks=False)
                                size += st.st_size
                                used = max(used, st.st_mtime)
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        size, used = st.st_size, st.st_mtime
                    else:
                        continue
                except OSError:
                    continue
                entries.append((used, size, entry.path))
                total += size
    except OSError:
        return 0
    if total <= limit_bytes:
        return 0
    now = time.time()
    removed = 0
    for used, size, path in sorted(entries):
        if total <= limit_bytes * low_water:
            break
        if now - used < min_age_s:
            continue
        with spare_lock or contextlib.nullcontext():
            if spare(path):
                continue
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                continue
        total -= size
        removed += 1
    if removed:
        log.info("%s over %d MiB: removed %d least recently used entries", what, limit_bytes >> 20, removed)
    return removed
