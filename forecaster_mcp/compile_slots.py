"""One bound on the compiler runs (nvcc) of a server process, shared by forecasts and measurements.

Each nvcc run may use 8 GiB of address space (`ptxas.COMPILE_ADDRESS_SPACE_BYTES`). A compare_kernels call compiles
two kernels at a time for ptxas features, a measurement compiles its kernel and reference, and nothing bounded them
together: 20 concurrent calls on an HTTP server ran 40 compilers at once. `COMPILE_SLOTS` holds every compile of the
process to `Settings.max_concurrent_compiles` slots; a compile waits for one in arrival order, for as long as its
caller allows (a forecast: what is left of its ptxas wait; a measurement: `MEASURE_COMPILE_WAIT_S`).

Not an anyio or asyncio semaphore: those belong to one event loop, and this bound is the process's, over every loop
(the server's, the `eval` command's own, each test's) and thread. Not a `threading.BoundedSemaphore` acquired in a
worker thread either: each waiter would hold one of anyio's 40 worker threads, the pool a running compile needs to
finish (its preprocessed-source check runs there), so 40 waiting compiles stalled the ones they waited for; and a
thread blocked in `acquire` cannot be cancelled, so a cancelled call either sat out its whole wait or, abandoned,
later took a slot nobody would give back. Here a waiter is a future on its own loop, woken thread-safely; cancelled
or out of time just as it was given a slot, it hands that slot on.

Waiting needs the asyncio backend (anyio.run's default, the only one this package runs on).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from dataclasses import dataclass, field

import anyio

# How long a measurement's compile waits for a slot before the measurement is refused (errors.ServerBusy): long
# enough for a few compiles ahead of it to finish, short enough that the agent hears about a crowded server.
MEASURE_COMPILE_WAIT_S = 60.0


def default_limit() -> int:
    """Half this process's CPUs, at least 2: nvcc is one CPU-bound process per compile, and forecasts on a small
    machine still compile both kernels of a pair at once."""
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use (a container's cpuset)
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(2, cpus // 2)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = field(default=False)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter cancelled meanwhile hands its slot on (CompileSlots._leave)
        future.set_result(None)


class CompileSlots:
    """At most `limit` compiles at once, first come first served, across event loops and threads."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a compile limit is at least 1")
        self._lock = threading.Lock()
        self._limit = limit
        self._running = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def running(self) -> int:
        """Compiles holding a slot now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Compiles waiting for a slot now."""
        return len(self._waiters)

    def set_limit(self, limit: int) -> None:
        """A new limit: raised, waiters get the new slots at once; lowered, running compiles finish and no new one
        starts until fewer than `limit` run."""
        if limit < 1:
            raise ValueError("a compile limit is at least 1")
        with self._lock:
            self._limit = limit
            self._hand_on()

    async def acquire(self, wait_s: float) -> bool:
        """Take a slot, waiting at most `wait_s` seconds in line; False when none came free in time. Cancelled while
        waiting, it keeps none."""
        with self._lock:
            if self._running < self._limit and not self._waiters:
                self._running += 1
                return True
            if wait_s <= 0:
                return False
            loop = asyncio.get_running_loop()
            waiter = _Waiter(loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            with anyio.move_on_after(wait_s):
                await waiter.future
        except BaseException:
            self._leave(waiter)
            raise
        with self._lock:
            if waiter.granted:  # also when the slot came just as the wait ran out: it is this caller's now
                return True
            self._waiters.remove(waiter)
            return False

    def release(self) -> None:
        """Give back a slot taken with `acquire`; the longest waiter gets it."""
        with self._lock:
            if self._running <= 0:
                raise RuntimeError("compile slot released more often than taken")
            self._running -= 1
            self._hand_on()

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gone (cancelled): out of the line, or, given a slot meanwhile, the slot handed on."""
        with self._lock:
            if waiter.granted:
                self._running -= 1
                self._hand_on()
            else:
                self._waiters.remove(waiter)

    def _hand_on(self) -> None:
        """Free slots to the longest waiters (under the lock)."""
        while self._waiters and self._running < self._limit:
            waiter = self._waiters.popleft()
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.future)
            except RuntimeError:  # its event loop has closed: nobody is waiting there any more
                continue
            waiter.granted = True
            self._running += 1


COMPILE_SLOTS = CompileSlots(default_limit())
