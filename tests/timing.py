"""Wall-clock guards against a slow path coming back (a regex or a walk gone quadratic on hostile input).

The slow paths these tests guard against took tens of seconds; the fast ones take a second or less on an idle
machine. A machine busy with other work can stretch one run past a tight limit, so a guard takes the fastest of
a few runs (the usual way to time code under noise): a slow path is slow every time, a busy moment is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def fastest_s(call: Callable[[], Any], limit_s: float, tries: int = 3) -> float:
    """The fastest of up to `tries` runs of `call`, in seconds; stops at the first run within `limit_s`."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
        if best < limit_s:
            break
    return best
