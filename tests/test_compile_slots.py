"""The process-wide bound on compiler runs: every forecast and measurement compile of a server shares
`Settings.max_concurrent_compiles` slots; a forecast that gets none in its ptxas wait answers without ptxas (and
nothing is kept of it), a measurement waits uncharged and without the GPU, and one that gets none in its wait is
refused, nothing charged."""

from __future__ import annotations

import fcntl
import random
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from serverproc import start_http
from test_measure_accounting import FAKE, fake_gpu, kernel, make_service
from test_pycuda_measurer import WORKLOAD
from tool_calls import call

from forecaster_mcp.compile_slots import COMPILE_SLOTS, CompileSlots, default_limit
from forecaster_mcp.errors import OperatorError, ServerBusy
from forecaster_mcp.forecast.local import LocalForecaster
from forecaster_mcp.server.app import build_server
from forecaster_mcp.service import Service
from forecaster_mcp.settings import Settings
from forecaster_mcp.store.db import Store

pytestmark = pytest.mark.anyio

_ADD = """
__global__ void add(float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] += b[i] * SCALE;
}
"""


@pytest.fixture(autouse=True)
def _default_limit_after() -> Iterator[None]:
    """The slots are the process's: a test's limit, or a slot it held, must not reach the next test."""
    yield
    assert COMPILE_SLOTS.running == 0 and COMPILE_SLOTS.waiting == 0
    COMPILE_SLOTS.set_limit(default_limit())


def counting_nvcc(tmp_path: Path, hold_s: float = 0.4, hangs_on: str | None = None) -> Path:
    """An nvcc (the tests' fake one) that keeps, in `<tmp>/counter`, how many of it run now, the most that ran at
    once and how many ran in all; each run takes `hold_s` more, so that runs overlap wherever they may. A source
    holding `hangs_on` takes it a minute to compile (as a big unrolled loop takes nvcc 24 s), each such run
    counted in `<tmp>/hung`."""
    counter = tmp_path / "counter"
    script = tmp_path / "nvcc"
    script.write_text(
        f"#!{sys.executable}\n"
        "import fcntl, subprocess, sys, time\n"
        "if '--version' in sys.argv:\n"
        "    print('Cuda compilation tools, release 0.0, counting fake'); sys.exit(0)\n"
        "if '--list-gpu-code' in sys.argv:\n"
        "    print('sm_80 sm_90'); sys.exit(0)\n"
        "def bump(d):\n"
        f"    with open({str(counter)!r}, 'a+') as f:\n"
        "        fcntl.flock(f, fcntl.LOCK_EX)\n"
        "        f.seek(0)\n"
        "        now, peak, total = map(int, (f.read() or '0 0 0').split())\n"
        "        now += d\n"
        "        f.seek(0); f.truncate()\n"
        "        f.write(f'{now} {max(peak, now)} {total + (d > 0)}')\n"
        "bump(1)\n"
        "try:\n"
        f"    if {hangs_on!r} is not None and {hangs_on!r} in open(sys.argv[-1]).read():\n"
        f"        open({str(tmp_path / 'hung')!r}, 'a').write('x')\n"
        "        time.sleep(60)\n"
        f"    time.sleep({hold_s})\n"
        f"    rc = subprocess.run([sys.executable, {FAKE!r}, 'nvcc', *sys.argv[1:]]).returncode\n"
        "finally:\n"
        "    bump(-1)\n"
        "sys.exit(rc)\n"
    )
    script.chmod(0o755)
    return script


def runs(tmp_path: Path) -> tuple[int, int, int]:
    """(running now, most at once, runs in all) of counting_nvcc."""
    path = tmp_path / "counter"
    if not path.exists():
        return 0, 0, 0
    with path.open() as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        now, peak, total = map(int, f.read().split())
    return now, peak, total


def _add(kid: str, scale: int) -> dict[str, Any]:
    return {
        "id": kid,
        "source": _ADD,
        "entry": "add",
        "defines": {"SCALE": scale},
        "launch": {"grid": [4096, 1, 1], "block": [256, 1, 1]},
    }


async def test_concurrent_compares_never_run_more_compilers_than_the_limit(tmp_path: Path) -> None:
    """Each compare compiled two kernels at a time and nothing bounded the calls together: 4 calls ran up to 8
    nvcc at once (each allowed 8 GiB). Now the server's max_concurrent_compiles holds them all."""
    nvcc = counting_nvcc(tmp_path)
    settings = Settings(home=tmp_path / "home", measurer="none", nvcc=str(nvcc), max_concurrent_compiles=2)
    service = await Service.open(settings)
    answers: list[dict[str, Any]] = []
    try:
        async with Client(build_server(service)) as client:

            async def compare(n: int) -> None:
                args = {
                    "candidates": [_add("a", 10 * n + 1), _add("b", 10 * n + 2)],
                    "hardware": "H100",
                    "workload": {"problem": {"n": 1 << 20}},
                }
                answers.append(await call(client, "compare_kernels", args))

            async with anyio.create_task_group() as tg:
                for n in range(4):
                    tg.start_soon(compare, n)
    finally:
        await service.close()
    assert len(answers) == 4
    now, peak, total = runs(tmp_path)
    assert now == 0
    assert total > 2  # the limit had something to hold back
    assert peak <= 2, f"{peak} compilers ran at once, over the limit of 2"


async def test_a_kernel_that_compiles_past_the_wait_is_not_compiled_again_for_each_launch(
    tmp_path: Path,
) -> None:
    """A kernel nvcc cannot compile within the ptxas wait (a loop of 2,000 unrolled steps took nvcc 24 s) cost
    every compare asking about it under another launch or workload the whole wait again (10 s each), a compile
    slot held throughout. Its compile is not tried again with no more time than it ran out of; with more (an
    evaluation's long wait) it is."""
    nvcc = counting_nvcc(tmp_path, hold_s=0.0, hangs_on="SLOW_TO_COMPILE")
    settings = Settings(home=tmp_path / "home", measurer="none", nvcc=str(nvcc), max_concurrent_compiles=2)
    store = await Store.open(settings.db_path)
    await store.ensure_ledger("default", 10.0)
    local = LocalForecaster(store, nvcc=str(nvcc), cache_dir=settings.home / "cache", ptxas_wait_s=2.0)
    service = Service(settings, store, [local], [])
    slow = {**_add("slow", 1), "source": _ADD + "// SLOW_TO_COMPILE\n"}
    hung = tmp_path / "hung"

    def compare(blocks: int) -> dict[str, Any]:
        launch = {"grid": [4096, 1, 1], "block": [blocks, 1, 1]}
        return {
            "candidates": [{**slow, "launch": launch}, {**_add("base", 2), "launch": launch}],
            "hardware": "H100",
            "workload": {"problem": {"n": blocks << 12}},
        }

    took = []
    try:
        async with Client(build_server(service)) as client:
            await call(client, "compare_kernels", compare(128))
            assert hung.read_text() == "x"
            for blocks in (256, 512, 1024):
                start = anyio.current_time()
                await call(client, "compare_kernels", compare(blocks))
                took.append(anyio.current_time() - start)
            assert hung.read_text() == "x", "compiled again, as long, for each launch"
            local._ptxas_wait_s = 4.0  # twice the time: worth a try
            await call(client, "compare_kernels", compare(64))
    finally:
        await service.close()
    assert hung.read_text() == "xx"
    assert min(took) < 1.0, f"compares took {took} s, the ptxas wait each"


async def forecasting_service(tmp_path: Path, nvcc: Path, wait_s: float) -> tuple[Service, LocalForecaster]:
    settings = Settings(home=tmp_path / "home", measurer="none", nvcc=str(nvcc), max_concurrent_compiles=1)
    store = await Store.open(settings.db_path)
    await store.ensure_ledger("default", 10.0)
    local = LocalForecaster(store, nvcc=str(nvcc), cache_dir=settings.home / "cache", ptxas_wait_s=wait_s)
    return Service(settings, store, [local], []), local


async def test_a_forecast_without_a_compile_slot_answers_without_ptxas_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    """Every slot taken for the whole ptxas wait: the compare still answers, from features without ptxas, as when
    nvcc times out. Nothing of it is kept (on disk or in the forecaster): the candidate, whose source does not
    compile, is found out by the next compare once a slot is free."""
    nvcc = counting_nvcc(tmp_path, hold_s=0.0)
    service, local = await forecasting_service(tmp_path, nvcc, wait_s=0.5)
    broken = {**_add("broken", 2), "source": _ADD + "#error not this one\n"}
    args = {
        "candidates": [_add("base", 1), broken],
        "hardware": "H100",
        "workload": {"problem": {"n": 1 << 20}},
    }
    try:
        async with Client(build_server(service)) as client:
            assert await COMPILE_SLOTS.acquire(0)  # another call's compile holds the only slot
            try:
                busy = await call(client, "compare_kernels", args)
            finally:
                COMPILE_SLOTS.release()
            assert runs(tmp_path) == (0, 0, 0)  # no compiler started
            assert not list((tmp_path / "home" / "cache").glob("ptxas/*.json"))
            (cand,) = busy["candidates"]
            assert "error" not in cand["rationale"]
            # The same forecaster, given time enough that its compiles cannot time out on a loaded machine.
            local._ptxas_wait_s = 120.0
            free = await call(client, "compare_kernels", args)
    finally:
        await service.close()
    assert runs(tmp_path)[2] == 2
    (cand,) = free["candidates"]
    assert cand["verdict"] == "slower" and "#error directive" in cand["rationale"]


async def test_a_measurement_waits_for_a_compile_slot_uncharged_and_off_the_gpu(tmp_path: Path) -> None:
    """A measurement whose compile waits for a slot holds no GPU meanwhile (another measurement, already compiled,
    runs and finishes on the same device) and is charged only its own run, not the wait."""
    gpu = fake_gpu(tmp_path)
    svc = await make_service(tmp_path, gpu)
    COMPILE_SLOTS.set_limit(1)
    busy = kernel(FAKE_BUSY_S=1.0)
    waiting: list[Any] = []
    try:
        # Compiled beforehand (measured on another workload: the compile is kept, the measurement is not reused):
        # it needs no slot below.
        other_workload = WORKLOAD.model_copy(update={"problem": {"n": 1024}})
        assert (await svc.measure(ledger="L", kernel=busy, workload=other_workload)).status == "ok"
        before = (await svc.budget_status("L")).spent_gpu_seconds
        assert await COMPILE_SLOTS.acquire(0)
        released = False
        try:
            async with anyio.create_task_group() as tg:

                async def measure_waiting() -> None:
                    waiting.append(
                        await svc.measure(ledger="L", kernel=kernel(FAKE_MS=0.25), workload=WORKLOAD)
                    )

                tg.start_soon(measure_waiting)
                for _ in range(1500):  # 30 s at most
                    if COMPILE_SLOTS.waiting:
                        break
                    await anyio.sleep(0.02)
                assert COMPILE_SLOTS.waiting == 1
                # The device is free while that one waits: this one runs on it to the end.
                other = await svc.measure(ledger="L", kernel=busy, workload=WORKLOAD)
                assert not waiting
                COMPILE_SLOTS.release()
                released = True
        finally:
            if not released:
                COMPILE_SLOTS.release()
        report = await svc.budget_status("L")
    finally:
        await svc.close()
    (waited,) = waiting
    assert other.status == "ok" and waited.status == "ok"
    assert other.cost.gpu_seconds >= 1.0
    # It waited at least as long as the other one held the device, and was charged only its own run.
    assert waited.cost.compile_seconds >= 1.0
    assert waited.cost.gpu_seconds < 1.0
    assert report.spent_gpu_seconds == pytest.approx(
        before + other.cost.gpu_seconds + waited.cost.gpu_seconds, abs=1e-6
    )


async def _while_the_only_slot_is_held(
    tmp_path: Path, action: Callable[[Service], Awaitable[Any]]
) -> tuple[Any, Any]:
    """`action`'s result on a service (fake GPU, slot wait 0.3 s) while its process's only compile slot is held
    elsewhere, and the ledger's budget_status after."""
    gpu = fake_gpu(tmp_path)
    gpu.compiler.slot_wait_s = 0.3
    svc = await make_service(tmp_path, gpu)
    COMPILE_SLOTS.set_limit(1)
    try:
        assert await COMPILE_SLOTS.acquire(0)
        try:
            result = await action(svc)
        finally:
            COMPILE_SLOTS.release()
        report = await svc.budget_status("L")
    finally:
        await svc.close()
    return result, report


async def test_a_measurement_without_a_compile_slot_is_refused_and_charged_nothing(tmp_path: Path) -> None:
    async def measure(svc: Service) -> ServerBusy:
        with pytest.raises(ServerBusy) as refused:  # an AgentError: the agent gets it as a ToolError
            await svc.measure(ledger="L", kernel=kernel(), workload=WORKLOAD)
        return refused.value

    refused, report = await _while_the_only_slot_is_held(tmp_path, measure)
    assert "busy compiling" in str(refused) and "nothing was charged" in str(refused)
    assert report.spent_gpu_seconds == 0 and report.reserved_gpu_seconds == 0
    assert not list((tmp_path / "cache").glob("locks/gpu-*.lock"))  # the device was never taken


async def test_slots_are_shared_by_event_loops_of_other_threads_and_handed_on_by_a_cancelled_waiter() -> None:
    """The eval command, sync tools' threads and a test each run their own loop: one bound covers them all, a slot
    given back on one loop wakes the waiter of another, and a waiter cancelled just after it was given one passes it
    on instead of keeping it."""
    slots = CompileSlots(1)
    taken = threading.Event()
    give_back = threading.Event()

    def other_loop() -> None:
        async def hold() -> None:
            assert await slots.acquire(0)
            taken.set()
            await anyio.to_thread.run_sync(give_back.wait, 30.0)
            slots.release()

        anyio.run(hold)

    thread = threading.Thread(target=other_loop)
    thread.start()
    try:
        assert await anyio.to_thread.run_sync(taken.wait, 30.0)
        assert not await slots.acquire(0.05)  # held on the other loop
        assert slots.waiting == 0  # a waiter out of time leaves the line
        got: list[bool] = []
        async with anyio.create_task_group() as tg:

            async def wait_for_it() -> None:
                got.append(await slots.acquire(30.0))

            tg.start_soon(wait_for_it)
            for _ in range(1500):
                if slots.waiting:
                    break
                await anyio.sleep(0.01)
            give_back.set()
        assert got == [True] and slots.running == 1
    finally:
        give_back.set()
        thread.join(30.0)

    # Given the slot, then cancelled before it ran: the next in line gets it.
    async with anyio.create_task_group() as tg:
        first_scope = anyio.CancelScope()
        second: list[bool] = []

        async def first() -> None:
            with first_scope:
                await slots.acquire(30.0)
                raise AssertionError("cancelled before it could run")

        async def then() -> None:
            second.append(await slots.acquire(30.0))

        tg.start_soon(first)
        tg.start_soon(then)
        for _ in range(1500):
            if slots.waiting == 2:
                break
            await anyio.sleep(0.01)
        slots.release()  # the first waiter is given the slot, its wake-up scheduled...
        first_scope.cancel()  # ...and it is cancelled before that runs
    assert second == [True] and slots.running == 1
    slots.release()
    assert slots.running == 0 and slots.waiting == 0


async def test_measure_if_unsure_without_a_compile_slot_keeps_the_forecasts(tmp_path: Path) -> None:
    async def compare(svc: Service) -> Any:
        return await svc.compare(
            ledger="L",
            candidates=[kernel(FAKE_MS=0.5).model_copy(update={"id": "a"}), kernel(FAKE_MS=0.25)],
            workload=WORKLOAD,
            baseline="a",
            hardware=None,
            target_error=None,
            measure_if_unsure=True,
            max_measurements=2,
        )

    out, report = await _while_the_only_slot_is_held(tmp_path, compare)
    assert len(out.candidates) == 1
    (note,) = [n for n in out.notes if n.startswith("measure_if_unsure measured nothing")]
    assert "busy compiling" in note and "Nothing was charged; the forecasts stand" in note
    assert report.spent_gpu_seconds == 0 and report.reserved_gpu_seconds == 0


def test_the_limit_is_a_setting_an_http_server_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORECASTER_MCP_MAX_CONCURRENT_COMPILES", "0")
    with pytest.raises(OperatorError, match="bad setting max_concurrent_compiles"):
        Settings.from_env()
    monkeypatch.setenv("FORECASTER_MCP_MAX_CONCURRENT_COMPILES", "3")
    assert Settings.from_env().max_concurrent_compiles == 3
    assert Settings.model_validate({}).max_concurrent_compiles == default_limit() >= 2
    srv = start_http(tmp_path / "srv", env={"FORECASTER_MCP_MAX_CONCURRENT_COMPILES": "3"})
    srv.stop()
    assert srv.proc.stderr is not None
    assert "at most 3 compiles at once" in srv.proc.stderr.read().decode()


def test_slots_come_back_after_many_waiters_on_several_loops_time_out_are_cancelled_or_fail() -> None:
    """Four threads, each its own event loop, 300 compiles each over 3 slots: waits that run out, waiters cancelled
    while in line or just as they are given a slot, holders that raise. No more than 3 ever hold a slot, and every
    slot comes back (a slot lost this way would stall every later compile of the server)."""
    limit = 3
    slots = CompileSlots(limit)
    guard = threading.Lock()
    holding = [0, 0]  # now, most at once
    outcomes: dict[str, int] = {"held": 0, "no slot": 0, "cancelled": 0}

    def count(what: str) -> None:
        with guard:
            outcomes[what] += 1

    async def compile_once(rng: random.Random) -> None:
        with anyio.move_on_after(rng.choice([1e-4, 1e-3, 5e-3, 60.0])) as scope:
            if not await slots.acquire(rng.choice([0.0, 1e-4, 1e-3, 0.01, 30.0])):
                count("no slot")
                return
            try:
                with guard:
                    holding[0] += 1
                    holding[1] = max(holding)
                count("held")
                for _ in range(rng.randrange(4)):
                    await anyio.lowlevel.checkpoint()
                if rng.random() < 0.1:
                    raise ValueError("nvcc could not start")
            except ValueError:
                pass
            finally:
                with guard:
                    holding[0] -= 1
                slots.release()
        if scope.cancelled_caught:
            count("cancelled")

    def loop(seed: int) -> None:
        async def main() -> None:
            rng = random.Random(seed)
            async with anyio.create_task_group() as tg:
                for _ in range(300):
                    tg.start_soon(compile_once, random.Random(rng.random()))
                    if rng.random() < 0.3:
                        await anyio.lowlevel.checkpoint()

        anyio.run(main)

    threads = [threading.Thread(target=loop, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    assert not any(thread.is_alive() for thread in threads)
    assert slots.running == 0 and slots.waiting == 0, (slots.running, slots.waiting)
    assert holding[1] == limit  # the slots were contended, and the bound held
    assert all(outcomes.values()), outcomes
