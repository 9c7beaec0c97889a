"""One forecaster name's verified pairs, kept as columns sorted by forecast row id and updated by the pairs that
changed (ForecastEngine.refresh after Store.verified_changes).

A search loop measures once per compare, and each measurement verifies the pairs its kernel was just forecast
in. Rebuilding the engine's view of a name from its rows after each one (VerifiedPair lists, a signature over
every number, one row per measurement, the threshold history, the calibration's inputs) cost O(rows) in Python:
about 85 ms at 16,000 verified rows, over a second at 160,000. Here every per-row value the engine reads is
computed once, when a row arrives (with the same Python expressions the engine used on the lists), and what a
refresh needs is taken from the columns with numpy: the same numbers in the same (row id) order, so the same
signatures, calibrations and histories as a rebuild from the rows (tests/test_verified_rows.py).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from forecaster_mcp import bins

if TYPE_CHECKING:
    from forecaster_mcp.store.db import PairGroup, VerifiedPair

_MASK64 = (1 << 64) - 1


def row_digest(v: VerifiedPair, position: int) -> tuple[int, int]:
    """128 bits of what a fit or a threshold history reads of one row, and the row's place (its id; `position`
    where it has none): two 64-bit halves, summed modulo 2**64 into a signature (`signature_of`)."""
    place = v.row_id if v.row_id is not None else -1 - position
    numbers = struct.pack(f"<qdd{len(v.probs)}d", place, v.p_faster, v.actual_speedup, *v.probs)
    if v.max_confidence is not None:  # the history is scored at it (rows without one sign as they did before)
        numbers += struct.pack("<d", v.max_confidence)
    text = f"{v.hardware}\x1e{v.family_key!r}\x1e{v.pair!r}".encode()
    low, high = struct.unpack("<QQ", hashlib.blake2b(numbers + text, digest_size=16).digest())
    return int(low), int(high)


def join_key(v: VerifiedPair) -> int:
    """64 bits naming the forecast a row belongs to: a final row and its components' raw rows are stored
    together (one `created_at`) for one question (GPU and `pair`), so they share it."""
    text = f"{v.hardware}\x1e{v.pair!r}\x1e{v.created_at!r}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def combination_key(v: VerifiedPair) -> int:
    """64 bits naming the question a component's row answered, as the combination joins components' rows: the GPU
    and `pair`, or for a row without `pair` (an evaluation's, an older store's) the GPU and the exact measured
    speedup."""
    text = f"{v.hardware}\x1e{v.pair!r}" if v.pair is not None else f"{v.hardware}\x1f{v.actual_speedup!r}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def spread_id(n: int) -> int:
    """A measurement id spread over 64 bits (consecutive ids land in unrelated folds)."""
    return int.from_bytes(hashlib.blake2b(struct.pack("<q", n), digest_size=8).digest(), "little")


def signature_of(count: int, low: int, high: int) -> str:
    return f"{count}:{low & _MASK64:016x}{high & _MASK64:016x}"


def rows_signature(rows: Sequence[VerifiedPair]) -> str:
    """What a fit on `rows` depends on, in a few bytes: equal signatures, equal fits. The rows are a set (each
    digest holds the row's id, and the rows are read in id order), so the signature is a sum of per-row digests:
    one row more or less changes it by that row's digest alone (VerifiedRows keeps it so)."""
    low = high = 0
    for i, v in enumerate(rows):
        a, b = row_digest(v, i)
        low, high = low + a, high + b
    return signature_of(len(rows), low, high)


class VerifiedRows:
    """The verified pairs of one forecaster name, by pair (`PairGroup`), and their per-row values as numpy
    columns sorted by row id. `apply` takes what changed; the other methods read the columns."""

    def __init__(self, family_slot: Callable[[str, str], str]) -> None:
        self._family_slot = family_slot
        self.pairs: dict[PairGroup, VerifiedPair] = {}
        self._by_id: dict[int, VerifiedPair] = {}
        self._by_measurement: dict[int, set[int]] = {}  # verified_by -> row ids
        self._codes: dict[str, int] = {}  # hardware names and family slots -> small integers
        self._keys: list[str] = []
        n = 0
        self._ids: npt.NDArray[np.int64] = np.zeros(n, np.int64)
        self._vby = np.zeros(n, np.int64)  # verified_by (-1: none)
        self._failure = np.zeros(n, bool)  # verified by a kernel failing: no calibration row
        self._tie = np.zeros(n, bool)  # bins.is_tie(actual_speedup): scored by nothing
        self._kept = np.zeros(n, bool)  # the newest row of its measurement (see apply)
        self._hardware: npt.NDArray[Any] = np.zeros(n, object)
        self._hw_code = np.zeros(n, np.int64)
        self._family_code = np.zeros(n, np.int64)  # -1: no family
        self._p_raw = np.zeros(n, np.float64)  # bins.p_faster(probs): the calibration's input
        self._faster = np.zeros(n, bool)  # actual_speedup > 1
        self._conf = np.zeros(n, np.float64)  # max(p_faster, 1 - p_faster): the threshold history's
        self._right = np.zeros(n, np.float64)
        self._low = np.zeros(n, np.uint64)
        self._high = np.zeros(n, np.uint64)
        # One forecast's rows (the final row and each component's raw row) share a join key (`join_key`) and a
        # fold (`fold_key`: the measurement that settled it, else the join key).
        self._join = np.zeros(n, np.uint64)
        self._fold_key = np.zeros(n, np.uint64)
        self._question = np.zeros(n, np.uint64)  # combination_key: joins components' rows of one question
        self._p_fail = np.zeros(n, np.float64)  # NaN: not kept (a raw row, or stored before)
        self._p_fail_baseline = np.zeros(n, np.float64)
        self._cap = np.zeros(n, np.float64)  # a component row's max_confidence (NaN: none known)

    def _code(self, key: str) -> int:
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = len(self._keys)
            self._keys.append(key)
        return code

    def apply(self, groups: Iterable[PairGroup], pairs: Iterable[tuple[PairGroup, VerifiedPair]]) -> None:
        """Drop the pairs in `groups` (every pair touched), then add `pairs` (those of them verified now)."""
        gone = [v for g in groups if (v := self.pairs.pop(g, None)) is not None]
        new: list[VerifiedPair] = []
        for g, v in pairs:
            if v.row_id is None:
                raise ValueError("VerifiedRows keeps rows by id: a verified pair without row_id")
            if (old := self.pairs.pop(g, None)) is not None:
                gone.append(old)
            self.pairs[g] = v
            new.append(v)
        touched: set[int] = set()
        if gone:
            gone_ids = np.array([v.row_id for v in gone], np.int64)
            keep = ~np.isin(self._ids, gone_ids)
            for name in self._columns():
                setattr(self, name, getattr(self, name)[keep])
            for v in gone:
                assert v.row_id is not None
                del self._by_id[v.row_id]
                if v.verified_by is not None:
                    self._by_measurement[v.verified_by].discard(v.row_id)
                    touched.add(v.verified_by)
        if new:
            new.sort(key=lambda v: v.row_id or 0)
            columns = self._rows_columns(new)
            at = np.searchsorted(self._ids, columns["_ids"])
            for name in self._columns():
                setattr(self, name, np.insert(getattr(self, name), at, columns[name]))
            for v in new:
                assert v.row_id is not None
                self._by_id[v.row_id] = v
                if v.verified_by is not None:
                    self._by_measurement.setdefault(v.verified_by, set()).add(v.row_id)
                    touched.add(v.verified_by)
        # One row per measurement: of the rows one measurement verified, the newest (largest id) is kept for the
        # threshold history. A search compares one untried candidate against each best-so-far in turn, and its
        # measurement then settles all those pairs at once: nearly the same question, right or wrong together.
        # Counted as independent trials they would certify a threshold on far fewer outcomes than the bound
        # assumes (five copies per measurement let a forecaster whose error is 0.11 certify a target of 0.1
        # about one time in ten at delta 0.05, instead of under one in twenty). The newest copy was asked with
        # the most history, and which copy is kept does not depend on its outcome. Rows with no measurement id
        # (older stores) are all kept. Many measurements touched (a first read): every row's flag at once.
        if len(touched) > 64:
            self._kept = self._vby < 0
            settled = np.flatnonzero(~self._kept)
            order = np.argsort(self._vby[settled], kind="stable")  # each measurement's rows stay in id order
            by = self._vby[settled][order]
            self._kept[settled[order[np.r_[by[1:] != by[:-1], True]]]] = True
            for m in touched:
                if not self._by_measurement.get(m, True):
                    del self._by_measurement[m]
            return
        for m in touched:
            ids = self._by_measurement.get(m)
            if not ids:
                self._by_measurement.pop(m, None)
                continue
            at = np.searchsorted(self._ids, np.array(sorted(ids), np.int64))
            self._kept[at] = False
            self._kept[at[-1]] = True

    @staticmethod
    def _columns() -> tuple[str, ...]:
        return (
            "_ids", "_vby", "_failure", "_tie", "_kept", "_hardware", "_hw_code", "_family_code", "_p_raw", "_faster",
            "_conf", "_right", "_low", "_high", "_join", "_fold_key", "_question", "_p_fail", "_p_fail_baseline",
            "_cap",
        )  # fmt: skip

    def _rows_columns(self, rows: Sequence[VerifiedPair]) -> dict[str, npt.NDArray[Any]]:
        """The columns of `rows`, each value computed as the engine computed it from the VerifiedPair."""
        digests = [row_digest(v, 0) for v in rows]
        joins = [join_key(v) for v in rows]
        return {
            "_ids": np.array([v.row_id for v in rows], np.int64),
            "_vby": np.array([-1 if v.verified_by is None else v.verified_by for v in rows], np.int64),
            "_failure": np.array([v.failure is not None for v in rows], bool),
            "_tie": np.array([bins.is_tie(v.actual_speedup) for v in rows], bool),
            "_kept": np.array([v.verified_by is None for v in rows], bool),  # the others: set in apply
            "_hardware": np.array([v.hardware for v in rows], object),
            "_hw_code": np.array([self._code(v.hardware) for v in rows], np.int64),
            "_family_code": np.array(
                [
                    self._code(self._family_slot(v.hardware, v.family_key)) if v.family_key else -1
                    for v in rows
                ],
                np.int64,
            ),
            "_p_raw": np.array([bins.p_faster(v.probs) for v in rows], np.float64),
            "_faster": np.array([v.actual_speedup > 1.0 for v in rows], bool),
            "_conf": np.array([max(v.p_faster, 1.0 - v.p_faster) for v in rows], np.float64),
            "_right": np.array(
                [
                    0.5 if v.p_faster == 0.5 else float((v.p_faster > 0.5) == (v.actual_speedup > 1.0))
                    for v in rows
                ],
                np.float64,
            ),
            "_low": np.array([a for a, _ in digests], np.uint64),
            "_high": np.array([b for _, b in digests], np.uint64),
            "_join": np.array(joins, np.uint64),
            "_fold_key": np.array(
                [
                    j if v.verified_by is None else spread_id(v.verified_by)
                    for v, j in zip(rows, joins, strict=True)
                ],
                np.uint64,
            ),
            "_question": np.array([combination_key(v) for v in rows], np.uint64),
            "_p_fail": np.array([math.nan if v.p_fail is None else v.p_fail for v in rows], np.float64),
            "_p_fail_baseline": np.array(
                [math.nan if v.p_fail_baseline is None else v.p_fail_baseline for v in rows], np.float64
            ),
            "_cap": np.array(
                [math.nan if v.max_confidence is None else v.max_confidence for v in rows], np.float64
            ),
        }

    def __len__(self) -> int:
        return int(self._ids.size)

    def rows(self) -> list[VerifiedPair]:
        """Every verified pair of the name, oldest row first (as Store.verified_pairs orders them)."""
        return [self._by_id[int(i)] for i in self._ids]

    def _signature(self, mask: npt.NDArray[np.bool_]) -> str:
        # uint64 sums wrap modulo 2**64, as signature_of reduces rows_signature's.
        return signature_of(int(mask.sum()), int(self._low[mask].sum()), int(self._high[mask].sum()))

    def calibration_signature(self) -> str:
        """rows_signature of the calibration's rows: those not verified by a kernel failing."""
        return self._signature(~self._failure)

    def calibration_inputs(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[Any]]:
        """Calibrator.fit's raw p_faster, outcomes and GPUs: the calibration's rows without ties, in id order."""
        mask = ~self._failure & ~self._tie
        return self._p_raw[mask], self._faster[mask], self._hardware[mask]

    def calibration_codes(self) -> tuple[npt.NDArray[np.int64], list[str]]:
        """The GPU of each of `calibration_inputs`' rows as an index into the names returned."""
        return self._hw_code[~self._failure & ~self._tie], self._keys

    def calibration_folds(self, folds: int) -> npt.NDArray[np.int64]:
        """The fold (0 .. folds - 1) of each of `calibration_inputs`' rows (`fold_key`)."""
        mask = ~self._failure & ~self._tie
        return (self._fold_key[mask] % np.uint64(folds)).astype(np.int64)

    def combination_inputs(
        self,
    ) -> tuple[npt.NDArray[np.uint64], Any, Any, Any, list[str], Any, Any, Any]:
        """What the combination weights are fitted on, of the rows not verified by a kernel failing, in id order:
        each row's question (`combination_key`), raw p_faster, fold key, GPU code and the names they code, whether
        the candidate was faster, whether the pair is a tie, and the cap the answer set (NaN: none)."""
        mask = ~self._failure
        return (
            self._question[mask], self._p_raw[mask], self._fold_key[mask], self._hw_code[mask], self._keys,
            self._faster[mask], self._tie[mask], self._cap[mask],
        )  # fmt: skip

    def rescoring_inputs(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], Any, Any, Any, list[str], Any, Any]:
        """What scoring the threshold history again needs of its rows (`history`'s: the newest of each measurement,
        untied, with their chances of failing kept): their indexes, row ids, join and fold keys, GPU codes and the
        names they code, p_fail and p_fail_baseline."""
        idx = np.flatnonzero(
            self._kept & ~self._tie & np.isfinite(self._p_fail) & np.isfinite(self._p_fail_baseline)
        )
        return (
            idx, self._ids[idx], self._join[idx], self._fold_key[idx], self._hw_code[idx], self._keys,
            self._p_fail[idx], self._p_fail_baseline[idx],
        )  # fmt: skip

    def raw_p(
        self,
    ) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.uint64], npt.NDArray[np.float64], npt.NDArray[np.float64]
    ]:
        """Each row's id, join key, raw p_faster and the cap its answer set on its own confidence (NaN: none; a
        component's rows), in id order."""
        return self._ids, self._join, self._p_raw, self._cap

    def scores(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
        """Each row's confidence and right/wrong score as issued, and whether its candidate was faster."""
        return self._conf, self._right, self._faster

    def history_signature(self) -> str:
        """rows_signature of the newest row of each measurement, in id order."""
        return self._signature(self._kept)

    def history(
        self,
        keep: int | None,
        pooled: str,
        scores: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
    ) -> dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]:
        """ForecastEngine._set_regime_history's table of the newest row of each measurement: for each GPU, family slot
        and `pooled`, the confidences and right/wrong scores of its newest `keep` untied rows, oldest first.
        `scores`: every row's confidence and score to use instead of those it was issued with."""
        conf, right = (self._conf, self._right) if scores is None else scores
        sel = np.flatnonzero(self._kept & ~self._tie)
        out: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}

        def put(key: str, idx: npt.NDArray[np.int64]) -> None:
            idx = idx if keep is None else idx[-keep:]
            out[key] = (conf[idx], right[idx])

        if sel.size == 0:
            return out
        put(pooled, sel)
        for codes in (self._hw_code[sel], self._family_code[sel]):
            order = np.argsort(codes, kind="stable")  # each code's rows stay in id order
            sorted_codes = codes[order]
            starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
            for start, end in zip(starts, [*starts[1:], sorted_codes.size], strict=True):
                code = int(sorted_codes[start])
                if code >= 0:
                    put(self._keys[code], sel[order[start:end]])
        return out
