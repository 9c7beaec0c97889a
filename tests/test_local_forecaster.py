"""The local forecaster: family model, measured truth, failures, refits, the static prior, a real space."""

from __future__ import annotations

import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from forecaster_mcp import bins
from forecaster_mcp.forecast.base import Forecaster, PairQuery
from forecaster_mcp.forecast.local import (
    MIN_FAMILY_POINTS,
    TAIL_WEIGHT,
    LocalForecaster,
    ParamEncoder,
    fit_gp,
    kernel_params,
)
from forecaster_mcp.hardware.specs import lookup
from forecaster_mcp.models import Kernel, Workload
from forecaster_mcp.store.db import FamilyPoint

SOURCE = "__global__ void k(float* a) { a[threadIdx.x] *= 2.0f; }  // family under test\n"
HW = "A100-PCIE-40GB"
WL = Workload(problem={"n": 1 << 20})


class FakeHistory:
    """In-memory FamilyHistory: the latest point per content key, like the store."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, str, str], dict[str, FamilyPoint]] = {}
        self.calls = 0

    def add(self, kernel: Kernel, runtime_ms: float | None, status: str = "ok", hardware: str = HW) -> None:
        key = (kernel.family_key(), hardware, WL.key())
        self.points.setdefault(key, {})[kernel.content_key()] = FamilyPoint(
            dict(kernel.defines), None, status, runtime_ms, kernel.content_key()
        )

    async def family_points(self, family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        self.calls += 1
        return list(self.points.get((family_key, hardware, workload_key), {}).values())


def member(bs: int, unroll: int = 1, source: str = SOURCE, kid: str | None = None) -> Kernel:
    return Kernel(
        id=kid or f"bs{bs}u{unroll}", source=source, entry="k", defines={"BS": bs, "UNROLL": unroll}
    )


def runtime(bs: int, unroll: int) -> float:
    """A smooth synthetic family: best near BS=256, unrolling helps a little."""
    return 1.0 + 0.6 * abs(math.log2(bs) - 8.0) ** 1.5 - 0.05 * math.log2(unroll)


def query(base: Kernel, cand: Kernel, hardware: str = HW) -> PairQuery:
    return PairQuery(base, cand, WL, hardware, lookup(hardware))


def trained(points: list[tuple[int, int]]) -> FakeHistory:
    h = FakeHistory()
    for bs, u in points:
        h.add(member(bs, u), runtime(bs, u))
    return h


GRID = [(bs, u) for bs in (32, 64, 128, 256, 512, 1024) for u in (1, 2, 4, 8)]


def test_it_is_a_forecaster() -> None:
    f: Forecaster = LocalForecaster(None)
    assert f.name == "local" and f.version


@pytest.mark.anyio
async def test_no_history_means_near_even_odds_and_says_so() -> None:
    f = LocalForecaster(FakeHistory(), ptxas_wait_s=0.0)
    [out] = await f.forecast([query(member(64), member(256))])
    assert out.p_faster == pytest.approx(0.5, abs=0.02)
    assert "static prior" in out.rationale and "50/50" in out.rationale
    assert out.extras["prior"] == 1.0 and out.extras["n_family_points"] == 0.0


@pytest.mark.anyio
async def test_family_model_ranks_unmeasured_members() -> None:
    train = GRID[::2]
    f = LocalForecaster(trained(train), ptxas_wait_s=0.0)
    test = [p for p in GRID if p not in train]
    queries, truth = [], []
    for i, a in enumerate(test):
        for b in test[i + 1 :]:
            s = runtime(*a) / runtime(*b)
            if abs(math.log2(s)) > 0.2:
                queries.append(query(member(*a), member(*b)))
                truth.append(s > 1)
    out = await f.forecast(queries)
    correct = [(fc.p_faster > 0.5) == t for fc, t in zip(out, truth, strict=True)]
    assert statistics.fmean(correct) >= 0.85
    fc = out[0]
    for key in ("mu_log2", "sd_log2", "p_fail", "n_family_points", "tail_weight"):
        assert key in fc.extras
    assert fc.extras["n_family_points"] == len(train)
    assert "family model on" in fc.rationale
    # Two predicted runtimes: a surprise in either is a surprise in the pair (1 - 0.9^2 with TAIL_WEIGHT 0.1).
    assert fc.extras["tail_weight"] == pytest.approx(1.0 - (1.0 - TAIL_WEIGHT) ** 2)
    [one] = await f.forecast([query(member(*train[0]), member(*test[0]))])
    assert one.extras["tail_weight"] == pytest.approx(TAIL_WEIGHT)  # the baseline is measured


@pytest.mark.anyio
async def test_measured_kernels_use_their_measurements() -> None:
    h = trained(GRID)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [out] = await f.forecast([query(member(32, 1), member(256, 8))])
    true_log2 = math.log2(runtime(32, 1) / runtime(256, 8))
    assert out.extras["mu_log2"] == pytest.approx(true_log2, abs=1e-9)
    assert out.extras["measured"] == 1.0 and out.extras["baseline_measured"] == 1.0
    assert out.extras["sd_log2"] < 0.2
    assert out.probs[bins.bin_index(2.0**true_log2)] > 0.9
    assert "both measured" in out.rationale


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("measured", "asked"),
    [
        ("0xFFFFFFFFFFFFFFFF", "0xFFFFFFFFFFFFFF00"),  # two 64-bit masks, one float apart from nothing
        (2**60, 2**60 + 1),  # integers beyond a float's 53 bits
        ("016", 16),  # octal 14 in C
    ],
)
async def test_a_member_is_never_answered_by_another_members_measurement(measured: Any, asked: Any) -> None:
    """Members are told apart by their values as the compiler reads them: an unmeasured kernel whose value
    only rounds to a measured one's is forecast, not reported as measured (and then never proposed)."""
    h = FakeHistory()
    for i, v in enumerate((measured, 3, 5, 7)):
        h.add(Kernel(source=SOURCE, entry="k", defines={"M": v}), 1.0 + i)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    base = Kernel(source=SOURCE, entry="k", defines={"M": 3})
    [out] = await f.forecast([query(base, Kernel(source=SOURCE, entry="k", defines={"M": asked}))])
    assert out.extras["measured"] == 0.0 and "both measured" not in out.rationale
    # The same value spelt another way is still the measured member.
    same = {"0xFFFFFFFFFFFFFFFF": "0XFFFFFFFFFFFFFFFFull", 2**60: "1152921504606846976", "016": "0o16"}[
        measured
    ]
    if same != "0o16":
        [again] = await f.forecast([query(base, Kernel(source=SOURCE, entry="k", defines={"M": same}))])
        assert again.extras["measured"] == 1.0


@pytest.mark.anyio
async def test_a_family_of_mostly_failed_points_is_fitted_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fit's cost grows with every point, failed ones too (encoding, the failure model): a family of
    2,000 failed and 10 ok configurations was fitted on the event loop (half a second)."""
    import threading

    from forecaster_mcp.forecast import local

    h = FakeHistory()
    for i in range(60):
        h.add(
            Kernel(source=SOURCE, entry="k", defines={"ID": i}),
            1.0 + i if i < 10 else None,
            "ok" if i < 10 else "launch_error",
        )
    where: list[str] = []
    real = local.fit_family

    def recording(*args: Any) -> Any:
        where.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(local, "fit_family", recording)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    k = [Kernel(source=SOURCE, entry="k", defines={"ID": i}) for i in (1, 100)]
    await f.forecast([query(k[0], k[1])])
    assert where and where[0] != threading.main_thread().name


@pytest.mark.anyio
async def test_absurd_recorded_runtimes_still_give_finite_forecasts() -> None:
    """A recording may hold any finite positive runtime: 1e300 ms overflowed the rationale and speedups."""
    h = FakeHistory()
    for b, ms in [(1, 1e300), (2, 1e308), (4, 1.7e308), (8, 1e-300), (16, 1e-310)]:
        h.add(Kernel(source=SOURCE, entry="k", defines={"B": b}), ms)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    base = Kernel(source=SOURCE, entry="k", defines={"B": 1})
    outs = await f.forecast([query(base, Kernel(source=SOURCE, entry="k", defines={"B": b})) for b in (3, 8)])
    for out in outs:
        assert all(math.isfinite(p) and p >= 0 for p in out.probs) and sum(out.probs) == pytest.approx(1.0)
        assert math.isfinite(out.extras["mu_log2"])


@pytest.mark.anyio
async def test_expected_speedup_is_the_forecast_mean_not_the_bin_centres() -> None:
    # Two measured members 3% apart: the bins alone would round the expectation to their centre (~1.15x).
    h = trained(GRID)
    h.add(member(256, 3, kid="close"), runtime(256, 4) * 1.03)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [measured, predicted, prior] = await f.forecast(
        [
            query(member(256, 3), member(256, 4)),
            query(member(256, 4), member(128, 16)),
            query(member(256, 4), member(256, 4, source=SOURCE + "// another kernel\n")),
        ]
    )
    assert bins.expected_speedup(measured.probs, measured.centers) == pytest.approx(1.03, rel=1e-3)
    assert bins.expected_speedup(measured.probs) > 1.1
    for out in (predicted, prior):
        assert out.centers is not None
        assert bins.expected_log2(out.probs, out.centers) == pytest.approx(out.extras["mu_log2"], abs=1e-6)


@pytest.mark.anyio
async def test_failures_are_learned_and_measured_failures_are_certain() -> None:
    h = FakeHistory()
    for bs, u in GRID:
        if bs >= 512:
            h.add(member(bs, u), None, status="compile_error")
        else:
            h.add(member(bs, u), runtime(bs, u))
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    near_fail = member(1024, 3)  # never measured: an unroll factor between measured ones, failing size
    safe = member(128, 3)
    failed = member(1024, 1)
    out = await f.forecast(
        [query(member(256, 1), near_fail), query(member(256, 1), safe), query(member(256, 1), failed)]
    )
    assert out[0].extras["p_fail"] > 0.5
    assert out[1].extras["p_fail"] < 0.2
    [far] = await f.forecast([query(member(256, 1), member(768, 2))])
    assert far.extras["p_fail"] > out[1].extras["p_fail"]
    assert out[2].extras["p_fail"] == 1.0 and out[2].p_faster == 0.0
    assert "failed when measured" in out[2].rationale


@pytest.mark.anyio
async def test_refits_only_when_the_family_changes() -> None:
    h = trained(GRID[:12])
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    q = [query(member(64, 1), member(512, 4))]
    first = await f.forecast(q)
    await f.forecast(q)
    await f.forecast(q)
    assert f.fits == 1
    h.add(member(512, 4), runtime(512, 4))
    after = await f.forecast(q)
    assert f.fits == 2
    assert after[0].extras["measured"] == 1.0 and first[0].extras["measured"] == 0.0


@pytest.mark.anyio
async def test_fitted_models_are_kept_within_the_memory_bound() -> None:
    from forecaster_mcp.forecast.local import model_bytes

    h = trained(GRID)
    sources = [SOURCE.replace("2.0f", f"{i}.0f") for i in range(3, 7)]
    for src in sources:
        for bs, u in GRID:
            h.add(member(bs, u, source=src), runtime(bs, u))
    probe = LocalForecaster(h, ptxas_wait_s=0.0)
    await probe.forecast([query(member(64, 1), member(512, 4))])
    one = probe.cached_bytes
    assert one > 24 * 24 * 8  # the inverse alone
    # Room for two models: a third family drops the least recently used one, not the one just asked about.
    f = LocalForecaster(h, ptxas_wait_s=0.0, max_cache_bytes=2 * one + one // 2)
    for src in sources:
        await f.forecast([query(member(64, 1, source=src), member(512, 4, source=src))])
        assert f.cached_bytes <= 2 * one + one // 2
    assert f.fits == 4 and len(f._models) == 2
    assert f.cached_bytes == sum(model_bytes(s.model) for s in f._models.values())
    # A dropped family is refitted when asked again, from its kept hyperparameters; a kept one is not.
    await f.forecast([query(member(64, 1, source=sources[-1]), member(512, 4, source=sources[-1]))])
    assert f.fits == 4
    await f.forecast([query(member(64, 1, source=sources[0]), member(512, 4, source=sources[0]))])
    assert f.fits == 5 and len(f._warm) == 4
    # A bound below one model keeps the one just fitted.
    tiny = LocalForecaster(h, ptxas_wait_s=0.0, max_cache_bytes=1)
    for src in sources[:2]:
        await tiny.forecast([query(member(64, 1, source=src), member(512, 4, source=src))])
    assert len(tiny._models) == 1 and tiny.cached_bytes == one


@pytest.mark.anyio
async def test_correlated_errors_make_close_siblings_more_certain() -> None:
    f = LocalForecaster(trained(GRID[::3]), ptxas_wait_s=0.0)
    # Two unmeasured members that differ only slightly share most of their model error.
    close, far = await f.forecast(
        [query(member(200, 3), member(210, 3)), query(member(200, 3), member(40, 3))]
    )
    assert close.extras["sd_log2"] < 0.5 * far.extras["sd_log2"]


@pytest.mark.anyio
async def test_unknown_hardware_and_separate_histories_per_gpu() -> None:
    h = trained(GRID)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [unknown] = await f.forecast([query(member(32), member(256), hardware="Some Future GPU")])
    assert unknown.p_faster == pytest.approx(0.5, abs=0.02)  # no measurements on that GPU
    [known] = await f.forecast([query(member(32), member(256))])
    assert known.p_faster > 0.95


@pytest.mark.anyio
async def test_different_families_combine_their_own_models() -> None:
    h = trained(GRID)
    other_src = SOURCE.replace("2.0f", "3.0f")
    other = member(128, 1, source=other_src)
    h.add(other, 0.5)  # measured in its own (one-point) family
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [out] = await f.forecast([query(member(32, 1), other)])
    assert out.extras["mu_log2"] == pytest.approx(math.log2(runtime(32, 1) / 0.5), abs=1e-9)
    assert out.p_faster > 0.95
    # Another configuration of the one-point family: estimated from its measured one (and the model's).
    unmeasured_other = member(64, 1, source=other_src)
    [sibling] = await f.forecast([query(member(32, 1), unmeasured_other)])
    assert "candidate estimated from 1 measured configuration of its own kernel" in sibling.rationale
    assert sibling.p_faster > 0.8
    # A family with nothing measured: the static prior.
    [prior] = await f.forecast([query(member(32, 1), member(64, 1, source=SOURCE.replace("2.0f", "4.0f")))])
    assert "static prior" in prior.rationale


@pytest.mark.anyio
async def test_static_prior_leans_towards_better_source() -> None:
    plain = Kernel(id="a", source=SOURCE, entry="k")
    vector = Kernel(
        id="b",
        source="__global__ void k(float4* a) { float4 v = a[threadIdx.x]; v.x *= 2.0f; a[threadIdx.x] = v; }",
        entry="k",
    )
    f = LocalForecaster(FakeHistory(), ptxas_wait_s=0.0)
    [out] = await f.forecast([query(plain, vector)])
    assert 0.5 < out.p_faster < 0.75  # a mild lean, never a confident call from source alone
    assert "vector loads" in out.rationale


def test_encoder_adds_alignment_and_thread_features() -> None:
    rows: list[dict[str, Any]] = [
        {"block_size_x": bx, "block_size_y": by, "variant": v}
        for bx in (16, 48, 64, 96, 128)
        for by in (1, 2, 4)
        for v in ("a", "b")
    ]
    enc = ParamEncoder(rows)
    assert "block_size_x:pow2" in enc.dim_names and "threads" in enc.dim_names
    assert "variant=a" in enc.dim_names
    x = enc.encode([{"block_size_x": 64, "block_size_y": 2, "variant": "b"}])
    assert x.shape == (1, enc.dim)
    assert x[0, enc.dim_names.index("block_size_x:pow2")] == 1.0
    assert x[0, enc.dim_names.index("variant=b")] == 1.0


def test_launches_derived_from_the_defines_add_nothing_and_others_count_once() -> None:
    """A client passing block = (block_size_x, block_size_y) must not change what the model sees; a launch
    tuned on its own is information, but a launch field repeating a define still counts once."""

    def row(bx: int, by: int, tile: int, launch_bx: int | None = None) -> dict[str, Any]:
        block = [launch_bx or bx, by, 1]
        launch = {"grid": [4096 // (block[0] * tile), 4096 // by, 1], "block": block}
        return kernel_params({"block_size_x": bx, "block_size_y": by, "tile": tile}, launch)

    rows = [row(bx, by, t) for bx in (16, 32, 48, 64, 128) for by in (1, 2, 4) for t in (1, 2, 4)]
    enc = ParamEncoder(rows)
    plain = ParamEncoder([{k: v for k, v in r.items() if not k.startswith("@")} for r in rows])
    assert not enc.launch_used and enc.dim_names == plain.dim_names
    assert np.array_equal(enc.encode(rows[:5]), plain.encode(rows[:5]))
    assert not enc.unknown_names(row(64, 2, 2))  # launch fields are not parameters it was never shown
    # Two launches of one configuration: the launch now tells members apart.
    tuned = [*rows, row(64, 2, 2, launch_bx=128)]
    enc = ParamEncoder(tuned)
    assert enc.launch_used and "@blocks" in enc.dim_names and "@block_x" in enc.dim_names
    assert "@block_y" not in enc.dim_names  # equal to block_size_y on every point: counted once
    assert not any(n.startswith("@blocks:") for n in enc.dim_names)  # no alignment flags on a grid size
    assert set(plain.dim_names) <= set(enc.dim_names)
    x = enc.encode([row(64, 2, 2)])
    assert x.shape == (1, enc.dim) and x[0, enc.dim_names.index("block_size_x:pow2")] == 1.0


def test_define_values_written_as_c_literals_are_numbers() -> None:
    """-D values arrive as C writes them; a tuning parameter read as a category would lose its order."""
    rows: list[dict[str, Any]] = [{"TILE": t} for t in (8, "16", "0x20", "64u", "128UL")]
    rows += [{"TILE": 256, "ALPHA": "2.5f"}, {"TILE": "0X1f", "ALPHA": "1e-3f"}]
    enc = ParamEncoder(rows)
    assert "TILE" in enc.dim_names and "ALPHA" in enc.dim_names
    assert not any("=" in name for name in enc.dim_names)  # nothing one-hot
    x = enc.encode([{"TILE": "0x40"}, {"TILE": 64}])
    assert np.array_equal(x[0], x[1])
    # What is not a number stays a category.
    assert "MODE=fast" in ParamEncoder([{"MODE": "fast"}, {"MODE": "0x1g"}]).dim_names


def test_octal_literals_and_mixed_categories_encode_as_the_compiler_reads_them() -> None:
    """ "016" is octal 14 in C (and to row_key): the model placed it at 16, the point of another member. A
    column of categories labelled 16 and 16.0, True and 1 apart: one member, two categories."""
    enc = ParamEncoder([{"X": v} for v in (8, 14, 32, 64)])
    x = enc.encode([{"X": "016"}, {"X": 14}, {"X": 16}])
    assert np.array_equal(x[0], x[1]) and not np.array_equal(x[0], x[2])
    mixed = ParamEncoder([{"M": v} for v in ("auto", 16, 16.0, True, 1)])
    assert mixed.dim_names == ["M=1", "M=16", "M=auto"]
    y = mixed.encode([{"M": 16.0}, {"M": "16"}, {"M": True}, {"M": 1}])
    assert np.array_equal(y[0], y[1]) and np.array_equal(y[2], y[3])


def test_a_define_some_members_lack_is_told_apart_from_its_values() -> None:
    """`#ifdef USE_SHMEM` members against those without it: absent, the define encoded at its one measured
    value, so both kinds were one point and the model could not learn the 4x between them."""
    from forecaster_mcp.forecast.local import fit_family

    def point(defines: dict[str, int], t_ms: float) -> FamilyPoint:
        return FamilyPoint(defines, None, "ok", t_ms, repr(sorted(defines.items())))

    plain = [point({"A": a}, 4.0) for a in (1, 2, 4, 8)]
    shmem = [point({"A": a, "USE_SHMEM": 1}, 1.0) for a in (1, 8)]
    model = fit_family(plain + shmem)
    assert "USE_SHMEM:given" in model.encoder.dim_names
    mean, _ = model.predict([{"A": 2, "USE_SHMEM": 1}, {"A": 2}])
    assert 2.0 ** mean[0] == pytest.approx(1.0, rel=0.25) and 2.0 ** mean[1] == pytest.approx(4.0, rel=0.1)


def test_an_ok_of_no_runtime_is_neither_a_runtime_nor_a_failure() -> None:
    """A recording's "ok" at 0 ms was counted a failure: the family's p_fail rose and a forecast against it
    read "candidate failed when measured (ok)"."""
    from forecaster_mcp.forecast.local import fit_family

    points = [FamilyPoint({"A": a}, None, "ok", 2.0 * a, f"p{a}") for a in (1, 2, 4, 8)]
    model = fit_family([*points, FamilyPoint({"A": 16}, None, "ok", 0.0, "zero")])
    assert model.n_failed == 0 and "zero" not in model.measured


def test_gp_recovers_a_smooth_function_with_honest_spread() -> None:
    rng = np.random.default_rng(0)
    x = rng.random((60, 2))
    y = np.sin(4 * x[:, 0]) + 0.5 * x[:, 1] + 0.02 * rng.standard_normal(60)
    gp = fit_gp(x, y)
    xt = rng.random((200, 2))
    yt = np.sin(4 * xt[:, 0]) + 0.5 * xt[:, 1]
    mean, var = gp.predict_marginal(xt)
    assert float(np.sqrt(np.mean((mean - yt) ** 2))) < 0.1
    z = (mean - yt) / np.sqrt(var * gp.loo_scale**2)  # latent spread against the noise-free truth
    assert 0.2 < float(np.median(np.abs(z))) < 1.5


@pytest.mark.anyio
async def test_real_space_pairs_and_latency(conv_a100: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forecaster_mcp.forecast import local
    from forecaster_mcp.measure.replay import load_space

    space = load_space(conv_a100)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(space.entries))
    src = "// convolution_kernel configuration (source not included)\n"
    h = FakeHistory()

    def kern(i: int) -> Kernel:
        return Kernel(id=f"c{i}", source=src, entry=space.kernel_name, defines=dict(space.entries[i].params))

    for i in order[:100]:
        e = space.entries[int(i)]
        h.add(kern(int(i)), statistics.median(e.times) if e.ok else None, e.status)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    valid = [int(i) for i in order[100:] if space.entries[int(i)].ok][:401]
    base = kern(valid[0])
    queries = [query(base, kern(i)) for i in valid[1:]]
    out = await f.forecast(queries)
    t = {i: statistics.median(space.entries[i].times) for i in valid}
    right = [
        (fc.p_faster > 0.5) == (t[valid[0]] > t[i])
        for fc, i in zip(out, valid[1:], strict=True)
        if abs(math.log2(t[valid[0]] / t[i])) > bins.TIE_LOG2
    ]
    assert statistics.fmean(right) > 0.8
    two = queries[:1]
    fits: list[int] = []
    fit_family = local.fit_family

    def counted(*args: Any, **kwargs: Any) -> Any:
        fits.append(1)
        return fit_family(*args, **kwargs)

    monkeypatch.setattr(local, "fit_family", counted)
    t0 = time.perf_counter()
    for _ in range(20):
        await f.forecast(two)
    # The cached model answers: nothing is fitted again. A 2-candidate compare then stays in milliseconds (4-6 ms
    # on a quiet machine; tune_local.py latency measures it); the bound, once 20 ms, is a guard against a slow
    # path, with room for a loaded machine (35 ms a call with three busy loops on the tests' core).
    assert fits == []
    assert (time.perf_counter() - t0) / 20 < 0.1
    assert MIN_FAMILY_POINTS <= 10


async def _confidence_gap(path: Path, history: int, seeds: int = 3, pairs: int = 150) -> tuple[float, float]:
    """(mean confidence - accuracy, accuracy) over non-tie pairs of two unmeasured members of a real space."""
    from forecaster_mcp.measure.replay import load_space

    space = load_space(path)
    src = "// a recorded configuration (source not included)\n"
    conf: list[float] = []
    right: list[bool] = []
    for seed in range(seeds):
        order = np.random.default_rng(seed).permutation(len(space.entries))

        def kern(i: int) -> Kernel:
            return Kernel(
                id=f"c{i}", source=src, entry=space.kernel_name, defines=dict(space.entries[i].params)
            )

        h = FakeHistory()
        for i in order[:history]:
            e = space.entries[int(i)]
            h.add(kern(int(i)), statistics.median(e.times) if e.ok else None, e.status)
        valid = [int(i) for i in order[history:] if space.entries[int(i)].ok][: 2 * pairs]
        couples = list(zip(valid[::2], valid[1::2], strict=False))
        out = await LocalForecaster(h, ptxas_wait_s=0.0).forecast(
            [query(kern(a), kern(b)) for a, b in couples]
        )
        for fc, (a, b) in zip(out, couples, strict=True):
            s = statistics.median(space.entries[a].times) / statistics.median(space.entries[b].times)
            if abs(math.log2(s)) > bins.TIE_LOG2:
                conf.append(max(fc.p_faster, 1.0 - fc.p_faster))
                right.append((fc.p_faster > 0.5) == (s > 1.0))
    accuracy = statistics.fmean(right)
    return statistics.fmean(conf) - accuracy, accuracy


@pytest.mark.anyio
async def test_ten_measurements_forecast_unmeasured_pairs_without_gross_under_confidence(
    dedisp_a100: Path, conv_a100: Path
) -> None:
    """With 10 measurements the signs of predicted differences are mostly right but, with the earlier
    hyperpriors, their size was shrunk 2-4x towards the family mean: on dedispersion the forecasts were right
    87% of the time while claiming 57% (gap -0.30). The gap must stay small without tipping into
    over-confidence on the rugged convolution space."""
    gap, accuracy = await _confidence_gap(dedisp_a100, 10)
    assert accuracy > 0.85
    assert gap > -0.2
    gap, accuracy = await _confidence_gap(conv_a100, 10)
    assert accuracy > 0.55
    assert -0.2 < gap < 0.1


def test_a_flat_family_is_not_trusted_far_beyond_its_measured_range() -> None:
    # Every member measured at 2.00 ms: the model kept "2 ms (+-1%)" for a block size 128x beyond the range
    # and decided it against a 2.1 ms baseline.
    from forecaster_mcp.forecast import local

    pts = [FamilyPoint({"BS": bs}, None, "ok", 2.0 * (1 + 0.001 * (i % 3)), f"p{i}")
           for i, bs in enumerate(range(32, 513, 32))]  # fmt: skip
    model = local.fit_family(pts)
    _, cov = model.predict([{"BS": 256}, {"BS": 1024}, {"BS": 65536}])
    sd = np.sqrt(np.diag(cov))
    assert sd[0] < 0.01 and sd[0] < sd[1] < sd[2] and sd[2] > 0.05


def test_short_length_scale_companion_widens_only_away_from_the_measurements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search measures one basin densely; the companion fit keeps the forecast there and admits, away from
    it, that the learned length scales may not hold (hyperparameter uncertainty)."""
    from forecaster_mcp.forecast import local

    monkeypatch.setattr(local, "EXTRAPOLATION_SLACK", 1e9)  # the range widening is tested on its own
    rng = np.random.default_rng(3)
    # Measured: only the first half of `a` (the basin); `b` is a switch seen in both states there.
    pts = []
    for i in range(40):
        a, b = int(rng.integers(1, 17)), int(rng.integers(0, 2))
        t_ms = 1.0 + 0.05 * a + 0.3 * b + 0.01 * rng.standard_normal()
        pts.append(FamilyPoint({"a": a, "b": b}, None, "ok", t_ms, f"p{i}"))
    near = [{"a": 8, "b": 0}, {"a": 9, "b": 1}]
    far = [{"a": 60, "b": 0}, {"a": 64, "b": 1}]
    model = local.fit_family(pts)
    assert model.gp_short is not None
    mean, cov = model.predict(near + far)
    monkeypatch.setattr(local, "SHORT_WEIGHT", 0.0)
    mean0, cov0 = model.predict(near + far)
    sd, sd0 = np.sqrt(np.diag(cov)), np.sqrt(np.diag(cov0))
    # Near the measurements the two fits agree: the forecast barely moves.
    assert np.all(np.abs(mean[:2] - mean0[:2]) < 0.05)
    assert np.all(sd[:2] < 1.3 * sd0[:2])
    # Far from them the spread grows (the MAP fit alone extrapolates the basin's trend confidently).
    assert np.all(sd[2:] > 1.2 * sd0[2:])
    # The mixture's covariance stays a covariance.
    assert np.all(np.linalg.eigvalsh(cov) > -1e-9)
    # Switched off, no companion is fitted at all.
    assert local.fit_family(pts).gp_short is None


@pytest.fixture
def updates(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each posterior update attempted from here on: True where it was taken, False where it fell back."""
    from forecaster_mcp.forecast import local

    seen: list[bool] = []
    update = local._updated_inverse

    def counted(previous: local.GPFit, xp: np.ndarray) -> np.ndarray | None:
        out = update(previous, xp)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(local, "_updated_inverse", counted)
    return seen


@pytest.mark.anyio
async def test_the_server_updates_a_large_family_after_a_new_measurement(updates: list[bool]) -> None:
    """Past 100 points a new measurement updates the cached model's posterior (hyperparameters kept)."""
    rng = np.random.default_rng(2)
    h = FakeHistory()
    for bs, u in [(bs, u) for bs in range(32, 1025, 8) for u in (1, 2, 4, 8)][::3][:110]:
        h.add(member(bs, u), runtime(bs, u) * (1.0 + 0.02 * rng.standard_normal()))  # noisy, as timings are
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    q = [query(member(64, 1), member(200, 4))]
    await f.forecast(q)
    assert updates == [] and f.fits == 1
    h.add(member(200, 4), runtime(200, 4))  # inside the measured range: the old rows keep their encoding
    [after] = await f.forecast(q)
    assert f.fits == 2 and updates == [True, True]
    assert after.extras["measured"] == 1.0


@pytest.mark.anyio
async def test_forecasts_do_not_depend_on_how_fast_the_background_refit_is() -> None:
    """The same measurements in the same order give the same forecasts, whether the hyperparameter
    optimisation beside the request path finishes at once or late (it is used REFIT_LAG points on)."""
    from forecaster_mcp.forecast import local

    rng = np.random.default_rng(4)
    grid = [(bs, u) for bs in range(32, 1025, 8) for u in (1, 2, 4, 8)]
    order = rng.permutation(len(grid))
    noise = 1.0 + 0.02 * rng.standard_normal(len(grid))
    histories = [FakeHistory(), FakeHistory()]
    for h in histories:
        for i in order[:110]:
            h.add(member(*grid[i]), runtime(*grid[i]) * noise[i])
    fast, slow = (LocalForecaster(h, ptxas_wait_s=0.0) for h in histories)
    refit = local.LocalForecaster._refit_hyperparameters

    def late(*args: Any) -> None:
        time.sleep(0.3)
        refit(*args)

    slow._refit_hyperparameters = late  # type: ignore[method-assign]
    q = [query(member(64, 1), member(200, 4)), query(member(40, 8), member(720, 2))]
    answers: list[list[list[float]]] = [[], []]
    for i in order[110:135]:
        for h, f, out in zip(histories, (fast, slow), answers, strict=True):
            h.add(member(*grid[i]), runtime(*grid[i]) * noise[i])
            out.append(
                [fc.extras["mu_log2"] for fc in await f.forecast(q)]
                + [fc.extras["sd_log2"] for fc in await f.forecast(q)]
            )
    assert answers[0] == answers[1]
    key = next(iter(fast._models))
    # Fitted first on 111 points, optimised again beside the requests at 122 and used in both.
    assert fast._hyper_n[key] == slow._hyper_n[key] == 122


def test_a_posterior_update_matches_a_new_factorisation(updates: list[bool]) -> None:
    """Between hyperparameter refits a family's posterior is updated for the points added and dropped (in
    any position: the store orders points by content key), and must be what factorising anew gives."""
    from forecaster_mcp.forecast import local

    rng = np.random.default_rng(5)
    params = [{"a": int(a), "b": int(b), "c": int(c)} for a, b, c in rng.integers(1, 40, size=(160, 3))]

    noise = 0.02 * rng.standard_normal(len(params))

    def pts(ix: list[int], noisy: bool = True) -> list[FamilyPoint]:
        out = []
        for i in ix:
            p = params[i]
            t_ms = 1.0 + 0.03 * p["a"] + 0.2 * math.sin(p["b"] / 5) + 0.01 * p["c"] + noisy * noise[i]
            out.append(FamilyPoint(dict(p), None, "ok", t_ms, f"k{(i * 7919) % 1000:04d}"))
        return sorted(out, key=lambda p: p.content_key)

    first = list(range(120))
    base = local.fit_family(pts(first))
    assert base.gp is not None
    warm = base.gp.theta
    previous = local.fit_family(pts(first), warm, False)
    probe = [dict(p) for p in params[140:]]
    # Three added (each lands somewhere in content-key order) and two dropped.
    changed = [i for i in first if i not in (3, 77)] + [130, 131, 132]
    fresh = local.fit_family(pts(changed), warm, False)
    assert updates == []
    updated = local.fit_family(pts(changed), warm, False, previous)
    assert updates == [True, True]  # the fit and its short-length-scale companion were updated
    assert updated.gp is not None and fresh.gp is not None
    assert len(updated.gp.x) == len(changed)
    m0, c0 = fresh.predict(probe)
    m1, c1 = updated.predict(probe)
    assert np.max(np.abs(m0 - m1)) < 1e-8 and np.max(np.abs(c0 - c1)) < 1e-8
    assert updated.gp.loo_scale == pytest.approx(fresh.gp.loo_scale, rel=1e-9)
    # What cannot be updated is factorised anew: other hyperparameters, or most of the points changed.
    kinv = local._updated_inverse(previous.gp, fresh.gp.x)
    assert kinv is not None and np.allclose(kinv, fresh.gp.kinv, atol=1e-6)
    most = local.fit_family(pts(list(range(40, 160)))).gp
    assert most is not None and local._updated_inverse(previous.gp, most.x) is None
    other, anew = (local.fit_family(pts(changed), warm + 0.1, False, p) for p in (previous, None))
    assert other.gp is not None and anew.gp is not None
    assert np.array_equal(other.gp.kinv, anew.gp.kinv)
    # A noiseless family is so ill-conditioned that the update loses digits: the check on K @ kinv sees it.
    exact = local.fit_family(pts(first, noisy=False))
    assert exact.gp is not None and exact.gp.sn2 < 1e-4
    again = local.fit_family(pts(changed, noisy=False), exact.gp.theta, False)
    assert again.gp is not None and local._updated_inverse(exact.gp, again.gp.x) is None


# ---------------------------------------------------------------- kernels the model cannot place


def _k(defines: dict[str, Any], kid: str, launch: dict[str, Any] | None = None) -> Kernel:
    return Kernel(id=kid, source=SOURCE, entry="k", defines=defines, launch=launch)


@pytest.mark.anyio
async def test_a_measured_member_spelled_otherwise_is_answered_by_its_measurement() -> None:
    """16, 16.0 and "16" are one configuration to the model: a copy of a measured member must come out a tie
    with it, not a prediction (an outlier's prediction is far from its own measurement)."""
    h = trained(GRID)
    odd = member(128, 2)
    h.add(odd, 3.0 * runtime(128, 2))  # far off the family's trend
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    twins = [_k({"BS": "128", "UNROLL": "2"}, "s"), _k({"BS": 128.0, "UNROLL": 2.0}, "f")]
    out = await f.forecast([query(odd, t) for t in twins])
    for fc in out:
        assert fc.extras["measured"] == 1.0 and fc.extras["mu_log2"] == pytest.approx(0.0, abs=1e-9)
        assert "both measured" in fc.rationale


@pytest.mark.anyio
async def test_values_the_model_cannot_place_get_the_family_spread() -> None:
    """A missing parameter, a word where numbers were measured and a category never measured are unknown,
    not the middle of the range or no category at all: unsure, as wide as the family."""
    h = FakeHistory()
    for bs, u in GRID:
        for algo, factor in (("naive", 3.0), ("tiled", 1.0), ("shuffle", 0.5)):
            h.add(_k({"BS": bs, "UNROLL": u, "ALGO": algo}, f"{bs}{u}{algo}"), factor * runtime(bs, u))
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    slow = _k({"BS": 32, "UNROLL": 1, "ALGO": "naive"}, "slow")
    odd = [
        _k({"UNROLL": 4, "ALGO": "tiled"}, "no_bs"),
        _k({"BS": "auto", "UNROLL": 4, "ALGO": "tiled"}, "word"),
        _k({"BS": 256, "UNROLL": 4, "ALGO": "vector"}, "new_algo"),
    ]
    known = _k({"BS": 181, "UNROLL": 4, "ALGO": "tiled"}, "between")  # unseen value, but placeable
    out = await f.forecast([query(slow, k) for k in [*odd, known]])
    widths = [fc.extras["sd_log2"] for fc in out]
    for fc in out[:3]:
        assert 0.05 < fc.p_faster < 0.95, fc.rationale
    assert min(widths[:3]) > 2 * widths[3]
    assert out[3].p_faster > 0.9  # the placeable one keeps its confident forecast
    enc = ParamEncoder([kernel_params(dict(k.defines), None) for k in (slow, known)])
    assert enc.unknown_names({"UNROLL": 1, "ALGO": "naive"}) == ["BS"]
    assert enc.unknown_names({"BS": "auto", "UNROLL": 1, "ALGO": "naive"}) == ["BS"]
    assert enc.unknown_names({"BS": 64, "UNROLL": 1, "ALGO": "vector"}) == ["ALGO"]
    assert enc.unknown_names({"BS": "0x40", "UNROLL": "2u", "ALGO": "tiled"}) == []


def test_a_launch_no_member_was_run_with_is_unknown() -> None:
    """While launches only repeat the defines (block = BS), they are not model inputs; a kernel launched
    otherwise than every measured member was is still not a point the model knows."""

    def row(bs: int, u: int, block: int | None = None, grid: int = 64) -> dict[str, Any]:
        return kernel_params({"BS": bs, "UNROLL": u}, {"grid": [grid, 1, 1], "block": [block or bs, 1, 1]})

    enc = ParamEncoder([row(bs, u, grid=4096 // bs) for bs, u in GRID])
    assert not enc.launch_used
    assert enc.unknown_names(row(128, 4, grid=32)) == []  # the same relations, a member's own launch
    assert enc.unknown_names(row(96, 3, grid=7)) == []  # new defines, block = BS as always (grid is free)
    assert enc.unknown_names(row(128, 4, block=1024, grid=32)) == ["launch"]  # a member, launched otherwise
    assert "@block_x" in enc.unknown_names(row(96, 3, block=1024))
    assert enc.unknown_names(kernel_params({"BS": 96, "UNROLL": 3}, None)) == []  # no launch: the defines


@pytest.mark.anyio
async def test_a_failed_kernel_is_certain_even_before_the_family_model_is() -> None:
    h = FakeHistory()
    for bs in (32, 64, 128):
        h.add(member(bs), runtime(bs, 1))
    h.add(member(2048), None, status="compile_error")
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [out] = await f.forecast([query(member(256), member(2048))])  # too few points for the model
    assert out.p_faster == 0.0 and out.extras["measured"] == 1.0 and out.extras["p_fail"] == 1.0
    assert "failed when measured" in out.rationale


def test_define_values_beyond_float_range_are_not_numbers() -> None:
    enc = ParamEncoder([{"BS": 10**400}, {"BS": "0x" + "f" * 300}, {"BS": 64}])
    assert "BS=64" in enc.dim_names  # a category, not an OverflowError


def test_additive_kernel_by_value_tables_equals_the_direct_sum() -> None:
    from forecaster_mcp.forecast.local import _TABLE_VALUES, _additive

    rng = np.random.default_rng(3)
    x = rng.integers(0, 5, size=(120, 6)) / 4.0
    x[:, 2] = rng.random(120)  # more distinct values than a table takes
    q = rng.integers(0, 7, size=(9, 6)) / 4.0  # values the training points do not have
    ls = rng.uniform(0.1, 2.0, size=6)
    assert len(np.unique(x[:, 2])) > _TABLE_VALUES
    for a, b in ((x, x), (q, x), (q, q)):
        diff = (a.T[:, :, None] - b.T[:, None, :]) / ls[:, None, None]
        direct = 1.7 * np.exp(-0.5 * diff * diff).mean(axis=0)
        assert np.allclose(_additive(a, b, ls, 1.7), direct, rtol=0, atol=1e-12)
    assert not _additive(q, x, ls, 0.0).any()


@pytest.mark.anyio
async def test_a_failure_on_some_pairs_costs_only_those_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One kernel whose features cannot be computed, or one family whose history cannot be read, used to
    make the local forecaster raise for the whole call, so every candidate of a 60-kernel screening went
    unforecast. Now the other pairs are answered, the engine keeps them and notes the ones that failed."""
    from forecaster_mcp.forecast import local
    from forecaster_mcp.forecast.base import PartialForecast
    from forecaster_mcp.forecast.engine import ForecastEngine

    h = trained(GRID)
    broken_src = SOURCE.replace("2.0f", "5.0f")
    broken_family = member(64, 1, source=broken_src).family_key()
    read = h.family_points

    async def flaky(family_key: str, hardware: str, workload_key: str) -> list[FamilyPoint]:
        if family_key == broken_family:
            raise OSError("disk I/O error")
        return await read(family_key, hardware, workload_key)

    monkeypatch.setattr(h, "family_points", flaky)
    features = local.kernel_features

    def poisoned(kernel: Kernel, *args: Any) -> Any:
        if kernel.id == "poison":
            raise ValueError("cannot read this kernel")
        return features(kernel, *args)

    monkeypatch.setattr(local, "kernel_features", poisoned)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    other_src = SOURCE.replace("2.0f", "3.0f")
    poison = Kernel(id="poison", source=other_src + "// poison\n", entry="k")
    queries = [
        query(member(32, 1), member(256, 1)),  # the family model
        query(member(32, 1), poison),  # the prior, failing
        query(member(32, 1), member(64, 1, source=broken_src)),  # a family that cannot be read
        query(member(32, 1), Kernel(id="fine", source=other_src, entry="k")),  # the prior
    ]
    with pytest.raises(PartialForecast) as caught:
        await f.forecast(queries)
    partial = caught.value.partial
    assert partial is not None and [p is not None for p in partial] == [True, False, False, True]
    assert "2 of 4 pairs" in str(caught.value)
    assert partial[0] is not None and partial[0].p_faster > 0.9  # 256 is far better than 32 in this family

    out = await ForecastEngine([f]).forecast(queries)
    assert out[0].p_faster > 0.9 and out[3].raw  # kept
    assert not out[1].raw and not out[2].raw and out[1].p_faster == 0.5
    assert any("skipped on 2 of 4 pairs" in n for n in out[0].notes)


@pytest.mark.anyio
async def test_a_define_far_outside_the_measured_range_gets_a_finite_unsure_forecast() -> None:
    # 1e160 on a linear column made every kernel distance infinite: NaN predictions, read as ">= 4x faster".
    h = FakeHistory()
    for bs, u in GRID:
        h.add(_k({"BS": bs, "UNROLL": u, "SCALE": 0.5 + u / 8}, f"{bs}{u}"), runtime(bs, u))
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    base = _k({"BS": 256, "UNROLL": 1, "SCALE": 0.625}, "base")
    far = [_k({"BS": 256, "UNROLL": 1, "SCALE": v}, f"s{i}") for i, v in enumerate((1e160, -1e300, 1.7e308))]
    for fc in await f.forecast([query(base, k) for k in far]):
        assert math.isfinite(fc.extras["mu_log2"]) and math.isfinite(fc.extras["sd_log2"])
        assert all(math.isfinite(p) for p in fc.probs)
        assert 0.05 < fc.p_faster < 0.95, fc.rationale


def test_the_posterior_subset_of_a_large_family_changes_by_a_point_when_one_is_added() -> None:
    from forecaster_mcp.forecast.local import _fit_subset

    rng = np.random.default_rng(0)
    x = rng.random((3001, 4))
    y = rng.random(3001)
    before = set(_fit_subset(3000, y[:3000], 1500, np.random.default_rng(0), x[:3000]).tolist())
    after = set(_fit_subset(3001, y, 1500, np.random.default_rng(0), x).tolist())
    assert len(before) == len(after) == 1500
    assert len(before - after) <= 2  # the random draw replaced about half of it


@pytest.mark.anyio
async def test_ptxas_runs_once_per_call_for_every_pair_and_its_cap_holds_for_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prior-path pairs of one call share one round of compiles (two at a time, one wait); a call with more
    than MAX_PTXAS_PER_CALL new kernels compiles none, instead of one pair's kernels after another."""
    import anyio

    from forecaster_mcp.forecast import ptxas
    from forecaster_mcp.forecast.local import MAX_PTXAS_PER_CALL

    calls: list[str] = []
    running = [0, 0]  # now, most at once

    async def fake_usage(kernel: Kernel, arch: str, *_a: Any, **_k: Any) -> ptxas.PtxasUsage:
        calls.append(kernel.entry)
        running[0] += 1
        running[1] = max(running)
        await anyio.sleep(0.05)
        running[0] -= 1
        return ptxas.PtxasUsage(arch, (ptxas.PtxasEntry(kernel.entry, 40, 0, 0, 0, 0),))

    monkeypatch.setattr(ptxas, "ptxas_result", fake_usage)
    monkeypatch.setattr(ptxas, "supported_archs", lambda nvcc: ("sm_80",))

    def unrelated(i: int) -> Kernel:  # each its own family: no model, the static prior answers
        src = f"__global__ void k{i}(float* a) {{ a[threadIdx.x] += {i}.0f; }}\n"
        return Kernel(id=f"u{i}", source=src, entry=f"k{i}")

    f = LocalForecaster(FakeHistory(), nvcc="nvcc", ptxas_wait_s=5.0)
    few = [query(unrelated(2 * i), unrelated(2 * i + 1)) for i in range(MAX_PTXAS_PER_CALL // 2)]
    assert len(await f.forecast(few)) == len(few)
    assert sorted(calls) == sorted(f"k{i}" for i in range(MAX_PTXAS_PER_CALL)) and running[1] == 2
    [(feats, error)] = f._static([few[0].baseline], few[0], {})  # cached with what ptxas said
    assert feats.registers == 40 and error is None

    calls.clear()
    many = [query(unrelated(100 + 2 * i), unrelated(101 + 2 * i)) for i in range(MAX_PTXAS_PER_CALL)]
    assert len(await f.forecast(many)) == len(many)
    assert calls == []  # 2 x MAX_PTXAS_PER_CALL new kernels in one call: a screening call, no compiles
    # Asked about alone later, two of them are compiled then (the screening call did not settle them).
    await f.forecast([many[0]])
    assert sorted(calls) == ["k100", "k101"]


class KeepingHistory(FakeHistory):
    """A FakeHistory that also keeps the family states a forecaster saves, as the Store does."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[tuple[str, str, str], str] = {}

    async def save_family_state(self, family_key: str, hardware: str, workload_key: str, state: str) -> None:
        self.states[(family_key, hardware, workload_key)] = state

    async def load_family_state(self, family_key: str, hardware: str, workload_key: str) -> str | None:
        return self.states.get((family_key, hardware, workload_key))


@pytest.mark.anyio
async def test_a_restarted_forecaster_answers_as_the_one_before_it() -> None:
    """The hyperparameters depend on the path the family grew along (optimised at 10% growth, warm-started):
    a fresh process optimising on all stored points answered differently from the same store (51 of 63
    p_faster changed after a server restart, verdicts flipped). What a family's model keeps is saved with
    it, and a pending optimisation is redone on the points it was started on."""
    rng = np.random.default_rng(4)
    grid = [(bs, u) for bs in range(32, 1025, 8) for u in (1, 2, 4, 8)]
    order = rng.permutation(len(grid))
    noise = 1.0 + 0.02 * rng.standard_normal(len(grid))
    h = KeepingHistory()
    for i in order[:95]:
        h.add(member(*grid[i]), runtime(*grid[i]) * noise[i])
    running = LocalForecaster(h, ptxas_wait_s=0.0)
    q = [query(member(64, 1), member(200, 4)), query(member(40, 8), member(720, 2))]
    differ = 0
    for i in order[95:130]:
        h.add(member(*grid[i]), runtime(*grid[i]) * noise[i])
        before = [v for f in await running.forecast(q) for v in (f.extras["mu_log2"], f.extras["sd_log2"])]
        fresh = await LocalForecaster(h, ptxas_wait_s=0.0).forecast(q)
        restarted = [v for f in fresh for v in (f.extras["mu_log2"], f.extras["sd_log2"])]
        # Equal up to rounding: a posterior updated for the new point against one factorised anew.
        differ += restarted != pytest.approx(before, rel=1e-8, abs=1e-8)
    assert differ == 0
    key = next(iter(running._models))
    # The path crossed background optimisations (started at 108 and 118, used two points on), and one is
    # pending at the end (started at 129): each restart in between redid or waited for it.
    assert running._hyper_n[key] == 118 and key in running._refits


@pytest.mark.anyio
async def test_an_unreadable_saved_family_state_is_ignored_not_a_lost_forecast() -> None:
    import json

    h = KeepingHistory()
    for bs in range(32, 300, 16):
        h.add(member(bs, 1), runtime(bs, 1))
    key = (member(32, 1).family_key(), HW, WL.key())
    pending = {"apply_at": 5, "keys": ["a"]}  # no n_ok
    h.states[key] = json.dumps(
        {"version": 1, "theta": [0.1] * 5, "n_ok": 10, "signature": "x", "pending": pending}
    )
    [out] = await LocalForecaster(h, ptxas_wait_s=0.0).forecast([query(member(32, 1), member(64, 1))])
    assert "mu_log2" in out.extras


def test_a_wide_range_starting_at_zero_is_log_encoded() -> None:
    """An unroll factor 0, 1, 2, 4, ..., 256 was encoded linearly: 1, 2 and 4 sat at 0.004, 0.008 and 0.016,
    closer than the shortest length scale, and the held-out error was 0.62 log2 against 0.05 for the same space
    spelled without the 0."""
    from forecaster_mcp.forecast.local import fit_family

    unroll = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    blocks = [32, 64, 128, 256, 512, 1024]

    def runtime(u: int, b: int) -> float:
        x = math.log2(u + 1)
        return 2.0 ** (3.0 - 0.8 * min(x, 3) + 0.3 * max(0.0, x - 3) + 0.4 * abs(math.log2(b) - 8))

    configs = [(u, b) for u in unroll for b in blocks]
    order = np.random.default_rng(1).permutation(len(configs))
    train, test = [configs[i] for i in order[:24]], [configs[i] for i in order[24:]]
    encoder = ParamEncoder([{"UNROLL": u} for u in unroll])
    column = encoder.dim_names.index("UNROLL")
    at = [float(encoder.encode([{"UNROLL": u}])[0][column]) for u in (0, 1, 2, 4, 256)]
    assert at[0] == 0.0 and at[-1] == 1.0 and at[1] > 0.1 and at[3] - at[2] > 0.05
    points = [FamilyPoint({"UNROLL": u, "B": b}, None, "ok", runtime(u, b), f"c{u}_{b}") for u, b in train]
    mean, _ = fit_family(points).predict([{"UNROLL": u, "B": b} for u, b in test])
    truth = np.log2([runtime(u, b) for u, b in test])
    assert float(np.mean(np.abs(truth - mean))) < 0.2


def test_a_text_parameter_keeps_its_most_measured_categories_only() -> None:
    """A define unique to each member (a variant name) made one dimension per member: a compare of a
    1000-member family took 18 s and 1.4 GB. The most measured values are kept; a value beyond them is one
    the model cannot place, like a value never measured."""
    from forecaster_mcp.forecast.local import MAX_CATEGORIES

    rows = [{"VARIANT": f"v{i}", "B": 32 * (1 + i % 4)} for i in range(1000)]
    rows += [{"VARIANT": "common", "B": 64}] * 5
    encoder = ParamEncoder(rows)
    assert encoder.dim <= MAX_CATEGORIES + 4  # the kept categories, B and its flags
    assert encoder.unknown_names({"VARIANT": "common", "B": 64}) == []
    assert encoder.unknown_names({"VARIANT": "v999", "B": 64}) == ["VARIANT"]


def test_many_text_parameters_share_a_bound_on_their_categories() -> None:
    """64 text defines (the most a kernel may have) of 32 values each made 2,044 one-hot dimensions: a fit of
    200 such members took 27 s and 2.6 GB. Their kept categories share MAX_CATEGORY_DIMS, the most measured
    of each kept; a value beyond them is one the model cannot place."""
    from forecaster_mcp.forecast.local import MAX_CATEGORY_DIMS

    rng = np.random.default_rng(0)
    rows = [{f"S{j}": f"v{int(rng.integers(32))}" for j in range(64)} for _ in range(200)]
    rows += [{f"S{j}": "common" for j in range(64)}] * 20
    encoder = ParamEncoder(rows)
    assert encoder.dim <= MAX_CATEGORY_DIMS
    assert all(sum(n.startswith(f"S{j}=") for n in encoder.dim_names) >= 2 for j in range(64))
    assert encoder.unknown_names({f"S{j}": "common" for j in range(64)}) == []
    # A few text parameters keep all of theirs (up to MAX_CATEGORIES each), as before.
    few = ParamEncoder([{"A": f"a{i % 32}", "B": f"b{i % 7}"} for i in range(64)])
    assert few.dim == 32 + 7


def test_a_define_new_to_a_large_family_is_optimised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 100 measurements fits only condition on new points; a define new to the family adds a dimension,
    so the warm start no longer fits and the hyperparameters were optimised from the defaults, on the request
    path, again on every call (never written back) until the next background refit."""
    from forecaster_mcp.forecast import local

    history = FakeHistory()
    for bs in range(32, 32 + 8 * 120, 8):
        history.add(member(bs, 1 + bs % 4), runtime(bs, 1 + bs % 4))
    optimised = {"n": 0}
    original = local._lbfgs

    def counting(*a: Any, **k: Any) -> Any:
        optimised["n"] += 1
        return original(*a, **k)

    monkeypatch.setattr(local, "_lbfgs", counting)
    forecaster = LocalForecaster(history, nvcc=None, ptxas_wait_s=0.0)
    monkeypatch.setattr(forecaster, "_start_refit", lambda *a: None)  # the background refit is not the point
    ask = [query(member(256), member(264, 2))]
    anyio.run(forecaster.forecast, ask)
    counts = []
    for i in range(3):
        flagged = Kernel(source=SOURCE, entry="k", defines={"BS": 1000 + 8 * i, "UNROLL": 1, "EXTRA": 1})
        history.add(flagged, runtime(1000 + 8 * i, 1))
        optimised["n"] = 0
        anyio.run(forecaster.forecast, ask)
        counts.append(optimised["n"])
    assert counts[0] >= 1 and counts[1:] == [0, 0]


@pytest.mark.anyio
async def test_a_switch_the_family_never_varied_is_not_forecast_as_irrelevant(conv_a100: Path) -> None:
    """Members measured only with use_shmem=1, asked about use_shmem=0: the model never saw the switch vary,
    and on this GPU turning it off makes members 1.9x slower on average (0.9 log2 more or less from one
    member to the next). Treated as irrelevant, 14 of the 55 verdicts decided at 0.95 here were wrong. With
    a surprise of the family's size it decides fewer (5 wrong of 25: the switch's mean effect is a bias no
    zero-mean shift removes), and the rationale says which value is a guess."""
    from forecaster_mcp.measure.replay import load_space

    space = load_space(conv_a100)
    src = "// convolution_kernel configuration (source not included)\n"

    def kern(i: int) -> Kernel:
        return Kernel(id=f"c{i}", source=src, entry=space.kernel_name, defines=dict(space.entries[i].params))

    ok = [i for i, e in enumerate(space.entries) if e.ok and e.times]
    on = [i for i in ok if space.entries[i].params["use_shmem"] == 1]
    off = [i for i in ok if space.entries[i].params["use_shmem"] == 0]
    decided = wrong = 0
    for seed in range(3):
        rng = np.random.default_rng(seed)
        measured = [int(i) for i in rng.choice(on, 40, replace=False)]
        h = FakeHistory()
        for i in measured:
            h.add(kern(i), statistics.median(space.entries[i].times))
        pairs = [(int(rng.choice(measured)), int(rng.choice(off))) for _ in range(100)]
        out = await LocalForecaster(h, ptxas_wait_s=0.0).forecast([query(kern(b), kern(c)) for b, c in pairs])
        for fc, (b, c) in zip(out, pairs, strict=True):
            assert "use_shmem=0 never measured" in fc.rationale
            faster = statistics.median(space.entries[b].times) > statistics.median(space.entries[c].times)
            if max(fc.p_faster, 1.0 - fc.p_faster) >= 0.95:
                decided += 1
                wrong += (fc.p_faster > 0.5) != faster
    assert decided >= 10  # still decides where the rest of the model says enough
    assert wrong <= 7 and wrong <= 0.2 * decided, (wrong, decided)


@pytest.mark.anyio
async def test_a_rationale_writes_an_extreme_speedup_in_significant_digits() -> None:
    """A family whose runtimes span 1 ms to 1e10 ms: its rationale said 'speedup ~0.00x' for a candidate
    forecast 1e-10 times as fast (and '~9999818868.72x' for the mirror), beside an extras mu_log2 of -33."""
    h = FakeHistory()
    for bs, u in GRID:
        if (bs, u) not in {(32, 2), (1024, 2)}:
            h.add(member(bs, u), 10.0 ** (2 * (math.log2(bs) - 5)))  # bs 32: 1 ms, bs 1024: 1e10 ms
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    slow, fast = await f.forecast(
        [query(member(32, 1), member(1024, 2)), query(member(1024, 1), member(32, 2))]
    )
    for fc in (slow, fast):
        shown = re.search(r"speedup ~(\S+)x", fc.rationale)
        assert shown is not None, fc.rationale
        assert float(shown[1]) == pytest.approx(2.0 ** fc.extras["mu_log2"], rel=0.01), fc.rationale
    assert "0.00x" not in slow.rationale
    # Ordinary speedups keep their two decimals.
    train = GRID[::2]
    a, b = [p for p in GRID if p not in train][:2]
    [mid] = await LocalForecaster(trained(train), ptxas_wait_s=0.0).forecast([query(member(*a), member(*b))])
    assert re.search(r"speedup ~\d+\.\d\dx", mid.rationale), mid.rationale


def test_speedup_text_keeps_ordinary_values_and_reads_extreme_ones() -> None:
    assert [bins.speedup_text(s) for s in (0.01, 0.0172, 1.37, 1000.0)] == ["0.01", "0.02", "1.37", "1000.00"]
    assert bins.speedup_text(1.5, 3) == "1.500"
    assert [bins.speedup_text(s) for s in (3e-8, 0.00123, 1234.5, 1e10)] == [
        "3e-08",
        "0.00123",
        "1.23e+03",
        "1e+10",
    ]


@pytest.mark.anyio
async def test_a_define_measured_at_both_ends_of_the_float_range_keeps_the_model_finite() -> None:
    # Members measured at -1.7e308 and 1.7e308: the linear column's span (hi - lo) overflowed to inf, the top
    # member encoded as inf / inf = NaN, and every prediction and P(fail) of the family came out NaN.
    values = (-1.7e308, -1e300, 0.0, 1.0, 5.0, 1.7e308, 7.0)
    enc = ParamEncoder([{"F": v} for v in values])
    assert np.all(np.isfinite(enc.encode([{"F": v} for v in (*values, 3.0, -1.8e308)])))
    h = FakeHistory()
    for i, v in enumerate(values):
        status = "compile_error" if i == len(values) - 1 else "ok"
        h.add(_k({"F": v, "B": i}, f"m{i}"), None if status != "ok" else 1.0 + i + (v > 0), status)
    f = LocalForecaster(h, ptxas_wait_s=0.0)
    [out] = await f.forecast([query(_k({"F": 2.0, "B": 1}, "a"), _k({"F": 3.0, "B": 2}, "b"))])
    assert all(math.isfinite(v) for v in out.extras.values()), out.extras
    assert out.extras["n_family_ok"] == 6.0
