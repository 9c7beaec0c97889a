"""State database files in the states tests need them in."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def damage_table(path: Path, table: str) -> None:
    """Overwrite the root page of `table` in the database file at `path` (closed, or idle in WAL mode), as a
    disk or copy that lost a block leaves it: the file still opens, and reading that table says 'database disk
    image is malformed'."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        [(root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchall()
    conn.close()
    with path.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * page_size)
