"""Numbered schema migrations, only ever appended: a released migration is never edited.

`PRAGMA user_version` holds how many migrations a database file has applied; the `schema_version`
table records when each one ran. Money columns are integer micro-GPU-seconds (`*_micro`) so a ledger
balances exactly, with no float drift.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from forecaster_mcp.errors import OperatorError


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


_INITIAL = (
    """CREATE TABLE IF NOT EXISTS schema_version (
        version INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        applied_at REAL NOT NULL
    )""",
    """CREATE TABLE ledgers (
        name TEXT PRIMARY KEY,
        limit_micro INTEGER NOT NULL,
        spent_micro INTEGER NOT NULL DEFAULT 0,
        reserved_micro INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        CHECK (limit_micro >= 0 AND spent_micro >= 0 AND reserved_micro >= 0),
        CHECK (spent_micro + reserved_micro <= limit_micro)
    )""",
    # Every change of a ledger is one row; summing the deltas reproduces the ledger row exactly.
    """CREATE TABLE ledger_events (
        id INTEGER PRIMARY KEY,
        ledger TEXT NOT NULL REFERENCES ledgers(name),
        kind TEXT NOT NULL CHECK (kind IN
            ('create', 'topup', 'reserve', 'commit', 'release', 'orphan_release')),
        amount_micro INTEGER NOT NULL,
        limit_delta_micro INTEGER NOT NULL DEFAULT 0,
        spent_delta_micro INTEGER NOT NULL DEFAULT 0,
        reserved_delta_micro INTEGER NOT NULL DEFAULT 0,
        reservation_id INTEGER,
        detail TEXT,
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX ledger_events_ledger ON ledger_events(ledger, id)",
    """CREATE TRIGGER ledger_events_no_update BEFORE UPDATE ON ledger_events
        BEGIN SELECT RAISE(ABORT, 'ledger_events is append-only'); END""",
    """CREATE TRIGGER ledger_events_no_delete BEFORE DELETE ON ledger_events
        BEGIN SELECT RAISE(ABORT, 'ledger_events is append-only'); END""",
    """CREATE TABLE reservations (
        id INTEGER PRIMARY KEY,
        ledger TEXT NOT NULL REFERENCES ledgers(name),
        amount_micro INTEGER NOT NULL CHECK (amount_micro > 0),
        purpose TEXT NOT NULL,
        owner_pid INTEGER NOT NULL,
        owner_host TEXT NOT NULL,
        owner_pidns TEXT,
        owner_start TEXT,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        state TEXT NOT NULL DEFAULT 'open'
            CHECK (state IN ('open', 'committed', 'released', 'orphan_released')),
        charged_micro INTEGER,
        settled_at REAL
    )""",
    "CREATE INDEX reservations_state ON reservations(state, owner_host, owner_pid)",
    """CREATE TABLE tokens (
        id INTEGER PRIMARY KEY,
        token_sha256 TEXT NOT NULL UNIQUE,
        ledger TEXT NOT NULL REFERENCES ledgers(name),
        label TEXT,
        created_at REAL NOT NULL,
        revoked_at REAL
    )""",
    """CREATE TABLE measurements (
        id INTEGER PRIMARY KEY,
        cache_key TEXT NOT NULL,
        ledger TEXT REFERENCES ledgers(name),
        idempotency_key TEXT,
        kernel_json TEXT NOT NULL,
        defines_json TEXT NOT NULL,
        launch_json TEXT,
        workload_key TEXT NOT NULL,
        family_key TEXT NOT NULL,
        content_key TEXT NOT NULL,
        hardware TEXT NOT NULL,
        result_json TEXT NOT NULL,
        status TEXT NOT NULL,
        runtime_ms REAL,
        charged_micro INTEGER NOT NULL DEFAULT 0,
        saved_micro INTEGER NOT NULL DEFAULT 0,
        cached INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        UNIQUE (ledger, idempotency_key)
    )""",
    "CREATE INDEX measurements_cache ON measurements(cache_key, id)",
    "CREATE INDEX measurements_content ON measurements(content_key, hardware, workload_key, status, id)",
    "CREATE INDEX measurements_family ON measurements(family_key, hardware, workload_key)",
    "CREATE INDEX measurements_ledger ON measurements(ledger)",
    """CREATE TABLE forecasts (
        id INTEGER PRIMARY KEY,
        ledger TEXT REFERENCES ledgers(name),
        forecaster TEXT NOT NULL,
        hardware TEXT NOT NULL,
        workload_key TEXT NOT NULL,
        baseline_key TEXT NOT NULL,
        candidate_key TEXT NOT NULL,
        probs_json TEXT NOT NULL,
        p_faster REAL NOT NULL,
        verdict TEXT NOT NULL CHECK (verdict IN ('faster', 'slower', 'unsure')),
        decided_by TEXT NOT NULL CHECK (decided_by IN ('forecast', 'measurement', 'cache')),
        actual_speedup REAL,
        verified_by_measurement INTEGER REFERENCES measurements(id),
        verified_at REAL,
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX forecasts_baseline ON forecasts(hardware, workload_key, baseline_key)",
    "CREATE INDEX forecasts_candidate ON forecasts(hardware, workload_key, candidate_key)",
    "CREATE INDEX forecasts_ledger ON forecasts(ledger)",
    "CREATE INDEX forecasts_verified ON forecasts(forecaster, hardware) WHERE actual_speedup IS NOT NULL",
    """CREATE TABLE llm_usage (
        id INTEGER PRIMARY KEY,
        ledger TEXT REFERENCES ledgers(name),
        model TEXT NOT NULL,
        input_tokens INTEGER NOT NULL,
        output_tokens INTEGER NOT NULL,
        cache_read_tokens INTEGER NOT NULL,
        cache_write_tokens INTEGER NOT NULL,
        cost_usd REAL NOT NULL,
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX llm_usage_ledger ON llm_usage(ledger)",
    """CREATE TABLE calibration (
        forecaster TEXT NOT NULL,
        hardware TEXT NOT NULL,
        state_json TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (forecaster, hardware)
    )""",
)

# Append new migrations at the end; never edit or reorder a released one.
# A measurement under an idempotency key holds its key while it runs, so a retry arriving at another server
# process on the same database is told it is in progress instead of being charged a second time.
_RESERVATION_IDEMPOTENCY = (
    "ALTER TABLE reservations ADD COLUMN idempotency_key TEXT",
    """CREATE UNIQUE INDEX reservations_open_idempotency ON reservations(ledger, idempotency_key)
        WHERE state = 'open' AND idempotency_key IS NOT NULL""",
)

# A forecast remembers the candidate's kernel family, so that a family with enough verified history of its own
# is thresholded on it rather than on history pooled with other families (forecast/engine.py).
_FORECAST_FAMILY = ("ALTER TABLE forecasts ADD COLUMN family_key TEXT",)

# What a measurement's outputs were checked against (the reference kernel and atol/rtol, service.check_key),
# so that a retry under its idempotency key that names another reference or other tolerances is refused
# instead of answered with a result checked differently. NULL on rows saved before: not known.
_MEASUREMENT_CHECK = ("ALTER TABLE measurements ADD COLUMN check_key TEXT",)

# The cache key of the measurement an open reservation pays for, so that a server process asked for the same
# measurement waits for it and is served from the cache instead of measuring (and charging) it a second time.
_RESERVATION_CACHE_KEY = (
    "ALTER TABLE reservations ADD COLUMN cache_key TEXT",
    "CREATE INDEX reservations_open_cache_key ON reservations(cache_key) WHERE state = 'open'",
)

# Only the last forecast of a pair is ever read (verification, thresholds, budget_status), and a search loop
# asks about the same pairs again and again: 2 rows per candidate per call grew the database ~110 KB per
# 64-candidate call, most of it rows nothing could read. save_forecasts now replaces a pair's unverified
# rows with the new one, and what budget_status counts of every forecast made is kept as running totals.
_FORECAST_TOTALS = (
    """CREATE TABLE forecast_totals (
        ledger TEXT PRIMARY KEY REFERENCES ledgers(name),
        made INTEGER NOT NULL,
        decided INTEGER NOT NULL,
        deferred INTEGER NOT NULL
    )""",
    """INSERT INTO forecast_totals (ledger, made, decided, deferred)
        SELECT ledger, count(*), coalesce(sum(decided_by = 'forecast' AND verdict != 'unsure'), 0),
            coalesce(sum(verdict = 'unsure' OR decided_by = 'measurement'), 0)
        FROM forecasts WHERE ledger IS NOT NULL GROUP BY ledger""",
    "CREATE INDEX forecasts_pair ON forecasts(hardware, workload_key, baseline_key, candidate_key, forecaster)",
    "DROP INDEX forecasts_baseline",  # its columns lead forecasts_pair, which serves its queries
)

# The local model's per-family hyperparameters (forecast/local.py), so that a restarted server answers as the
# one before it did: they are optimised as the family grows and depend on the path there, so a fresh process
# optimising on all stored points answered differently (51 of 63 p_faster changed, verdicts flipped).
_FAMILY_STATE = (
    """CREATE TABLE family_state (
        family_key TEXT NOT NULL,
        hardware TEXT NOT NULL,
        workload_key TEXT NOT NULL,
        state_json TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (family_key, hardware, workload_key)
    )""",
)

# A forecast is also verified when one of its kernels fails for good (compile or launch error, wrong output,
# a run past the server's cap) while the other runs: a "faster" verdict on a candidate that then fails to
# compile was wrong, and a threshold certified on what ran only, never on what failed, counted too few errors. The column says which
# side failed ('candidate' / 'baseline'); actual_speedup then holds the extreme bin's speedup (1/16 or 16).
_FORECAST_FAILURE = ("ALTER TABLE forecasts ADD COLUMN verified_failure TEXT",)

# An idempotency key is claimed, with what the request under it measures, before anything is looked up,
# measured or charged for it: two server processes given one key no longer both answer it (one from its cache,
# one by measuring, each checked its own way), a retry of the same request waits for the first's answer, and
# one naming another kernel or other checks is refused at once. A claim whose owner died is taken over.
_IDEMPOTENCY_CLAIMS = (
    """CREATE TABLE idempotency_claims (
        id INTEGER PRIMARY KEY,
        ledger TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        request_json TEXT NOT NULL,
        owner_pid INTEGER NOT NULL,
        owner_host TEXT NOT NULL,
        owner_pidns TEXT,
        owner_start TEXT,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        UNIQUE (ledger, idempotency_key)
    )""",
)

# Every change to a forecast's verification (a new verified row, a re-measured kernel's re-verified rows, a
# kernel whose latest measurement is now flagged: _VERIFY touches all of its rows) stamps the row with the next
# number of one sequence, so that a reader who has seen the verified pairs up to one number re-reads only the
# pairs touched since (ForecastEngine.refresh; before, every measurement made the next compare re-read all of
# them: 0.7 s at 16,000 verified rows). A trigger, not the store's SQL, keeps it: a server of an earlier version
# writing the same database stamps its rows too. Writes are serialised (BEGIN IMMEDIATE), so the numbers grow in
# commit order. Rows verified before stay NULL: a first read reads everything.
_VERIFY_SEQ = (
    "ALTER TABLE forecasts ADD COLUMN verify_seq INTEGER",
    "CREATE INDEX forecasts_verify_seq ON forecasts(verify_seq)",
    """CREATE TRIGGER forecasts_verify_seq AFTER UPDATE OF verified_at ON forecasts
        BEGIN UPDATE forecasts SET verify_seq = (SELECT coalesce(max(verify_seq), 0) + 1 FROM forecasts)
        WHERE id = NEW.id; END""",
)

# What budget_status reads of a ledger, from indexes alone (store.ledger_report): its verified forecasts in pair
# order with every column it reads (the GROUP BY needs no sort, no row is looked up), the measurements whose
# flags may make a kernel suspect (_SUSPECT_KERNELS: a few among thousands, found without reading every
# result_json; the WHERE is _SUSPECT's text search, which the query repeats), its decided forecasts not verified
# yet (measurements a forecast spared), and its measurements' charges (their median). At 200,000 forecast rows
# (50,000 on the ledger) budget_status took 0.47 s, almost all of it in these reads; the indexes add about 12% to
# the database (31 MB of 249). Partial: raw component rows (no ledger) and rows decided by cache are not read.
_LEDGER_REPORT = (
    "CREATE INDEX forecasts_ledger_verified ON forecasts(ledger, hardware, workload_key, "
    "min(baseline_key, candidate_key), max(baseline_key, candidate_key), verified_failure, baseline_key, "
    "candidate_key, verdict, decided_by, p_faster, actual_speedup) "
    "WHERE ledger IS NOT NULL AND actual_speedup IS NOT NULL AND decided_by != 'cache'",
    "CREATE INDEX measurements_suspect ON measurements(content_key, hardware, workload_key, id) "
    "WHERE status = 'ok' AND runtime_ms > 0 AND (instr(result_json, 'below_physical_floor') > 0 "
    "OR instr(result_json, 'events_disagree_with_wall_clock') > 0)",
    "CREATE INDEX forecasts_ledger_spared ON forecasts(ledger, hardware, workload_key, "
    "min(baseline_key, candidate_key), max(baseline_key, candidate_key)) WHERE ledger IS NOT NULL "
    "AND decided_by = 'forecast' AND verdict != 'unsure' AND actual_speedup IS NULL",
    "CREATE INDEX measurements_ledger_cost ON measurements(ledger, cached, charged_micro)",
)

# The end of the commit event's detail of a charge whose result could not be stored (store.Reservation's
# result_not_saved), and the condition that finds those events: budget_status sums them on every call, and
# without an index that was a scan of the ledger's every event (63 ms at 400,000 events on one ledger).
# The report's query must spell the condition as the index does, for SQLite to use the index.
RESULT_NOT_SAVED = "; result not saved"
NOT_SAVED_COMMITS = f"kind = 'commit' AND detail LIKE '%{RESULT_NOT_SAVED}'"
_NOT_SAVED_INDEX = (
    f"CREATE INDEX ledger_events_not_saved ON ledger_events(ledger, spent_delta_micro) WHERE {NOT_SAVED_COMMITS}",
)

# A static prior anchors on the latest kernel of each family measured on its workload (Store.workload_anchors):
# without an index, a scan of every measurement on each such forecast.
_WORKLOAD_INDEX = (
    "CREATE INDEX measurements_workload ON measurements(hardware, workload_key, status, family_key, id)",
)

# The chances of a final forecast's candidate and baseline failing, as its verdict weighed them
# (selective.decision_p; NULL on component rows and on rows stored before): with the components' raw rows they
# let the engine score a verified forecast again under another calibration (ForecastEngine: thresholds are
# certified on the history calibrated out of fold, not at the confidence each forecast was issued at).
_FORECAST_P_FAIL = (
    "ALTER TABLE forecasts ADD COLUMN p_fail REAL",
    "ALTER TABLE forecasts ADD COLUMN p_fail_baseline REAL",
)

# The cap a component's answer set on its own confidence (base.MAX_CONFIDENCE: the local model's estimate from a
# young family's few configurations), on that component's raw row (NULL on final rows, on answers that set none,
# and on rows stored before: no cap known). The engine holds each answer to its cap when it issues a forecast
# (engine._capped); scoring a verified forecast again under today's calibration must too, or a calibration that
# sharpens puts capped forecasts into the threshold history surer than they could ever be issued.
_FORECAST_MAX_CONFIDENCE = ("ALTER TABLE forecasts ADD COLUMN max_confidence REAL",)

# A replayed device's history is filed apart from the real GPU of its name (measure.base.history_device): a
# server on a real A100 answered compare_kernels "measured" from a replay's recorded times, learned them as its
# own, and certified thresholds on forecasts they verified (and a replay server so used a real GPU's times). The
# replayed measurements stored before, and the forecasts they verified, move to "<GPU> (replay)": no server's
# history, as the recordings they came from are not known (a replay server's measure_kernel still finds them by
# cache key, free, and files its copies under its own history).
_REPLAYED = (
    "CASE WHEN json_valid(result_json) THEN json_extract(result_json, '$.device.backend') END = 'replay'"
)
_REPLAY_HISTORY = (
    "UPDATE forecasts SET hardware = hardware || ' (replay)' WHERE verified_by_measurement IN "
    f"(SELECT id FROM measurements WHERE {_REPLAYED})",
    f"UPDATE measurements SET hardware = hardware || ' (replay)' WHERE {_REPLAYED}",
)

# The family models' fitted hyperparameters (family_state) are kept per family, GPU and workload; those fitted
# while replayed measurements were filed under the GPU's own name were fitted on the recording's times, and a
# server on the real GPU started from them (past 100 measurements of the family, kept them until it had 10% more
# than the replay had). Dropped where migration 16 moved replayed measurements of that family: refitted on what
# the GPU measured itself.
_REPLAY_FAMILY_STATE = (
    "DELETE FROM family_state WHERE EXISTS (SELECT 1 FROM measurements AS m WHERE m.family_key = "
    "family_state.family_key AND m.hardware = family_state.hardware || ' (replay)' "
    "AND m.workload_key = family_state.workload_key)",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", _INITIAL),
    Migration(2, "idempotency keys on open reservations", _RESERVATION_IDEMPOTENCY),
    Migration(3, "kernel family of each forecast", _FORECAST_FAMILY),
    Migration(4, "what each measurement was checked against", _MEASUREMENT_CHECK),
    Migration(5, "the measurement each open reservation pays for", _RESERVATION_CACHE_KEY),
    Migration(6, "one unverified row per forecast pair, running totals of forecasts made", _FORECAST_TOTALS),
    Migration(7, "the local model's hyperparameters per kernel family", _FAMILY_STATE),
    Migration(8, "forecasts verified by one kernel failing while the other runs", _FORECAST_FAILURE),
    Migration(9, "idempotency keys claimed before their request runs", _IDEMPOTENCY_CLAIMS),
    Migration(10, "a sequence number on every change of a forecast's verification", _VERIFY_SEQ),
    Migration(11, "indexes for a ledger's report", _LEDGER_REPORT),
    Migration(12, "an index of the charges whose result could not be stored", _NOT_SAVED_INDEX),
    Migration(13, "measurements by hardware and workload", _WORKLOAD_INDEX),
    Migration(14, "each final forecast's chances of its kernels failing", _FORECAST_P_FAIL),
    Migration(15, "the cap each component's answer set on its own confidence", _FORECAST_MAX_CONFIDENCE),
    Migration(16, "replayed measurements apart from the real GPU of their name", _REPLAY_HISTORY),
    Migration(17, "no family model starts from what replayed measurements fitted", _REPLAY_FAMILY_STATE),
)


def latest_version() -> int:
    return MIGRATIONS[-1].version


def _refuse_newer(current: int) -> None:
    if current > latest_version():
        raise OperatorError(
            f"the database has schema version {current}, newer than this forecaster-mcp knows "
            f"({latest_version()}): upgrade forecaster-mcp or point FORECASTER_MCP_HOME elsewhere"
        )


async def refuse_newer(conn: Any) -> None:
    """OperatorError when the database has a schema newer than this code knows. A read only: it runs before
    anything else touches the file (the switch to WAL included), so that a refused database is left as it was."""
    cursor = await conn.execute("PRAGMA user_version")
    row = await cursor.fetchone()
    _refuse_newer(int(row[0]) if row is not None else 0)


async def migrate(conn: Any) -> int:
    """Apply pending migrations in one write transaction (safe when several processes open at once).

    `conn` is an aiosqlite connection in autocommit mode. Returns the schema version after migrating.
    """
    cursor = await conn.execute("PRAGMA user_version")
    row = await cursor.fetchone()
    if row is not None and int(row[0]) == latest_version():
        return latest_version()
    # Refused before taking the write lock too: a newer server writing (or a read-only file) made this wait out
    # the busy timeout and say "busy ... try again when it is free", which never helps.
    _refuse_newer(int(row[0]) if row is not None else 0)
    await conn.execute("BEGIN IMMEDIATE")
    try:
        # Re-read under the write lock: another process may have migrated while we waited.
        cursor = await conn.execute("PRAGMA user_version")
        row = await cursor.fetchone()
        current = int(row[0]) if row is not None else 0
        _refuse_newer(current)
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.statements:
                await conn.execute(statement)
            await conn.execute(
                "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, time.time()),
            )
            # PRAGMA takes no bound parameters; the value is our own integer.
            await conn.execute(f"PRAGMA user_version = {int(migration.version)}")
        await conn.execute("COMMIT")
    except BaseException:
        await conn.execute("ROLLBACK")
        raise
    return latest_version()
