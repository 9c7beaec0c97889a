"""The store on a nearly full disk: its write-ahead log must not eat the space its database needs."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forecaster_mcp.store import db
from forecaster_mcp.store.db import Store

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def _small_filesystem(size: str) -> Iterator[Path]:
    """A tmpfs of `size` (needs root and mount: skipped where either is missing)."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount")
    folder = Path(tempfile.mkdtemp(prefix="fmcp-low-disk-"))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
        try:
            yield folder
        finally:
            subprocess.run(["umount", str(folder)], check=False)
    finally:
        with contextlib.suppress(OSError):
            folder.rmdir()


async def _cycles(store: Store, n: int, tag: str) -> int:
    """Hold and charge `n` times; how many went through before the first write refused."""
    for i in range(n):
        try:
            hold = await store.reserve("L", 1.0, "measure", cache_key=f"{tag}{i}" + "x" * 200)
            await store.commit(hold, 0.5)
        except sqlite3.OperationalError:
            return i
    return n


async def test_a_store_on_a_nearly_full_disk_keeps_taking_writes_until_its_database_fills_it() -> None:
    """On a 3 MB filesystem the write-ahead log (-wal) took all the space before SQLite's automatic checkpoint
    (1000 pages, about 4 MB): after 57 holds and charges every write failed "database or disk is full", and a
    checkpoint could not help any more (it must grow the database, on a disk with no byte left), also at close
    and after a restart. The log now stays small while the disk is low, so the database holds the data."""
    with _small_filesystem("3m") as folder:
        store = await Store.open(folder / "s.sqlite3")
        try:
            await store.create_ledger("L", 1e9)
            assert await _cycles(store, 400, "k") == 400
            wal = folder / "s.sqlite3-wal"
            assert not wal.exists() or wal.stat().st_size < 256 * 1024
        finally:
            await store.close()


async def test_a_store_whose_disk_runs_low_keeps_its_write_ahead_log_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same without a small filesystem: any disk with less free space than LOW_DISK_BYTES is low."""
    store = await Store.open(tmp_path / "s.sqlite3")
    try:
        await store.create_ledger("L", 1e9)
        assert await _cycles(store, 100, "a") == 100
        grown = (tmp_path / "s.sqlite3-wal").stat().st_size
        assert grown > 1024 * 1024  # a disk with room: SQLite checkpoints at about 4 MB, as before
        monkeypatch.setattr(db, "LOW_DISK_BYTES", 1 << 62, raising=False)
        assert await _cycles(store, 100, "b") == 100
        assert (tmp_path / "s.sqlite3-wal").stat().st_size < 256 * 1024
        view = await store.get_ledger("L")
        assert view is not None and view.spent_gpu_seconds == 100.0 and view.reserved_gpu_seconds == 0
    finally:
        await store.close()
