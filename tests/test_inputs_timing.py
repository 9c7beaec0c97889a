"""Inputs from a workload and a seed, output comparison, and the timing statistics (pure, no GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forecaster_mcp.measure.inputs import (
    Comparison,
    bfloat16_bits_to_float32,
    compare_buffer,
    compare_outputs,
    correctness_of,
    float32_to_bfloat16_bits,
    generate_inputs,
    output_names,
    param_format,
    param_sizes,
    scalar_param,
)
from forecaster_mcp.measure.timing import (
    AdaptiveStopper,
    StoppingRule,
    _largest_tail_rank,
    below_physical_floor,
    events_disagree,
    floor_bytes,
    median_ci95,
    median_ci_ranks,
    physical_floor_ms,
    relative_noise,
    summarize,
)
from forecaster_mcp.models import BufferArg, ScalarArg, Workload


def workload(*args: dict[str, object]) -> Workload:
    return Workload.model_validate({"args": list(args)})


def buf(name: str, dtype: str = "float32", shape: list[int] | None = None, **kw: object) -> dict[str, object]:
    return {"name": name, "dtype": dtype, "shape": shape or [64], **kw}


# ---------------------------------------------------------------- inputs


def test_inputs_are_reproducible_per_seed_and_fresh_for_a_new_seed() -> None:
    w = workload(
        buf("a"),
        buf("b", init="random_normal"),
        buf("c", intent="out"),
        {"name": "n", "dtype": "int32", "value": 64},
    )
    first = generate_inputs(w, seed=5)
    again = generate_inputs(w, seed=5)
    other = generate_inputs(w, seed=6)
    for x, y, z in zip(first[:3], again[:3], other[:3], strict=True):
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and isinstance(z, np.ndarray)
        assert np.array_equal(x, y)
        assert not np.array_equal(x, z)
    assert first[3] == 64
    a = first[0]
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (64,)
    assert 0.0 <= a.min() and a.max() < 1.0
    assert not np.array_equal(first[0], first[1])  # each buffer has its own stream


def test_a_buffer_keeps_its_values_when_other_arguments_change() -> None:
    alone = generate_inputs(workload(buf("x")), seed=1)[0]
    crowded = generate_inputs(workload(buf("w"), buf("x"), buf("y")), seed=1)[1]
    assert isinstance(alone, np.ndarray) and isinstance(crowded, np.ndarray)
    assert np.array_equal(alone, crowded)


@pytest.mark.parametrize(
    ("dtype", "storage"),
    [("float16", np.float16), ("float64", np.float64), ("int8", np.int8), ("uint64", np.uint64),
     ("bool", np.bool_), ("bfloat16", np.uint16)],
)  # fmt: skip
def test_every_dtype_has_a_storage_type(dtype: str, storage: type) -> None:
    (values,) = generate_inputs(workload(buf("x", dtype, [4, 8])), seed=0)
    assert isinstance(values, np.ndarray)
    assert values.dtype == storage and values.shape == (4, 8)


def test_init_kinds() -> None:
    zeros, ones, ramp, ints, bf_ones = generate_inputs(
        workload(
            buf("z", init="zeros"),
            buf("o", init="ones"),
            buf("r", "int32", [2, 3], init="arange"),
            buf("i", "int16", [1000]),
            buf("h", "bfloat16", [3], init="ones"),
        ),
        seed=0,
    )
    assert isinstance(zeros, np.ndarray) and not zeros.any()
    assert isinstance(ones, np.ndarray) and (ones == 1).all()
    assert isinstance(ramp, np.ndarray) and ramp.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(ints, np.ndarray) and ints.min() >= 0 and ints.max() < 64
    assert isinstance(bf_ones, np.ndarray) and bf_ones.tolist() == [0x3F80] * 3


def test_arange_stays_finite_in_float16_and_wraps_integers_modulo_their_range() -> None:
    half, small, wide, negative_side = generate_inputs(
        workload(
            buf("h", "float16", [70000], init="arange"),
            buf("u", "uint8", [2, 300], init="arange"),
            buf("w", "int32", [70000], init="arange"),
            buf("n", "float32", [5], init="random_normal"),
        ),
        seed=0,
    )
    assert isinstance(half, np.ndarray) and np.isfinite(half).all()  # past 65504 float16 would be inf
    assert half[:3].tolist() == [0, 1, 2] and half[2047] == 2047 and half[2048] == 0
    assert isinstance(small, np.ndarray) and small.shape == (2, 300)
    assert small.ravel().tolist() == [i % 256 for i in range(600)]
    assert isinstance(wide, np.ndarray) and wide[-1] == 69999
    assert isinstance(negative_side, np.ndarray) and negative_side.dtype == np.float32


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan() -> None:
    values = np.array([1.0, -2.5, 1.00390625, 1.01171875, np.inf, np.nan], dtype=np.float32)
    bits = float32_to_bfloat16_bits(values)
    back = bfloat16_bits_to_float32(bits)
    # 1 + 2^-8 is a tie: rounds to the even 1.0; 1 + 3*2^-8 is a tie that rounds up to 1 + 2^-6.
    assert back[:5].tolist() == [1.0, -2.5, 1.0, 1.015625, np.inf]
    assert np.isnan(back[5])


def test_scalar_parameters_and_parameter_format() -> None:
    assert scalar_param(ScalarArg(name="h", dtype="float16", value=1.0)) == 0x3C00
    assert scalar_param(ScalarArg(name="b", dtype="bfloat16", value=1.0)) == 0x3F80
    assert scalar_param(ScalarArg(name="f", dtype="float32", value=2)) == 2.0
    assert scalar_param(ScalarArg(name="t", dtype="bool", value=1)) is True
    with pytest.raises(ValueError, match="does not fit int8"):
        scalar_param(ScalarArg(name="i", dtype="int8", value=300))
    w = workload(
        buf("a"),
        buf("c", intent="out"),
        {"name": "n", "dtype": "int32", "value": 1},
        {"name": "s", "dtype": "float64", "value": 0.5},
        {"name": "h", "dtype": "float16", "value": 0.5},
    )
    assert param_format(w) == "PPidH"
    assert param_sizes(w) == [8, 8, 4, 8, 2]
    assert output_names(w) == ["c"]


# ---------------------------------------------------------------- comparison


def test_compare_within_and_outside_tolerance() -> None:
    want = np.array([1.0, 2.0, 100.0], dtype=np.float32)
    ok = compare_buffer("c", "float32", want * (1 + 5e-4), want, atol=0.0, rtol=1e-3)
    assert ok.passed
    assert ok.max_rel_error == pytest.approx(5e-4, rel=1e-3)
    bad = compare_buffer(
        "c", "float32", want + np.array([0, 0, 1], dtype=np.float32), want, atol=1e-5, rtol=1e-3
    )
    assert not bad.passed
    assert bad.max_abs_error == 1.0
    assert (
        bad.detail
        == "c[2]: got 101, reference 100; 1 of 3 elements outside atol=1e-05 + rtol=0.001*|reference|"
    )


def test_nan_and_inf_positions_must_match() -> None:
    want = np.array([[1.0, np.nan], [np.inf, -np.inf]], dtype=np.float32)
    assert compare_buffer("y", "float32", want.copy(), want, 0.0, 0.0).passed
    moved_nan = np.array([[np.nan, 1.0], [np.inf, -np.inf]], dtype=np.float32)
    result = compare_buffer("y", "float32", moved_nan, want, 1.0, 1.0)
    assert not result.passed and result.detail is not None
    assert (
        result.detail.startswith("y[0, 0]: got nan, reference 1")
        and "NaN positions differ at 2 elements" in result.detail
    )
    flipped = np.array([[1.0, np.nan], [-np.inf, -np.inf]], dtype=np.float32)
    result = compare_buffer("y", "float32", flipped, want, 1.0, 1.0)
    assert not result.passed and result.detail is not None and "infinities differ" in result.detail
    finite_for_inf = np.array([[1.0, np.nan], [3e38, -np.inf]], dtype=np.float32)
    assert not compare_buffer("y", "float32", finite_for_inf, want, 1e39, 1.0).passed


def test_compare_finds_the_first_problem_of_each_kind_across_slices() -> None:
    # Large outputs are compared a slice at a time; positions, counts and maxima span every slice.
    n = 3 * (1 << 20) + 17
    want = np.linspace(1.0, 2.0, n, dtype=np.float32).reshape(n, 1)
    got = want.copy()
    got[(1 << 20) + 5, 0] *= 1.5
    got[n - 1, 0] *= 1.5
    late = compare_buffer("z", "float32", got, want, atol=0.0, rtol=1e-3)
    assert not late.passed and late.detail is not None
    assert late.detail.startswith(f"z[{(1 << 20) + 5}, 0]:") and "2 of " in late.detail
    assert late.max_rel_error == pytest.approx(0.5, rel=1e-6)
    got[2 * (1 << 20) + 3, 0] = np.nan  # a NaN mismatch is reported before any tolerance miss
    nan_first = compare_buffer("z", "float32", got, want, atol=0.0, rtol=1e-3)
    assert nan_first.detail is not None and nan_first.detail.startswith(f"z[{2 * (1 << 20) + 3}, 0]: got nan")
    assert compare_buffer("z", "float32", want.copy(), want, 0.0, 0.0).passed


def test_compare_bfloat16_integers_and_shapes() -> None:
    want = float32_to_bfloat16_bits(np.array([1.0, 2.0], dtype=np.float32))
    got = float32_to_bfloat16_bits(np.array([1.0, 2.015625], dtype=np.float32))  # one bf16 ulp above 2
    assert compare_buffer("b", "bfloat16", got, want, 0.0, 1e-2).passed
    # rtol 1e-3 is below one bfloat16 ulp (2^-7): it is raised to it, so one rounding apart passes, two fail.
    assert compare_buffer("b", "bfloat16", got, want, 0.0, 1e-3).passed
    two = float32_to_bfloat16_bits(np.array([1.0, 2.03125], dtype=np.float32))
    assert not compare_buffer("b", "bfloat16", two, want, 0.0, 1e-3).passed
    half_ulp = np.array([1.0, 1.0 + 2.0**-10], dtype=np.float16)
    assert compare_buffer("h", "float16", half_ulp, np.array([1.0, 1.0], dtype=np.float16), 0.0, 1e-4).passed
    assert compare_buffer("i", "int32", np.array([3, 4]), np.array([3, 4]), 0.0, 0.0).passed
    assert not compare_buffer("i", "int32", np.array([3, 5]), np.array([3, 4]), 0.0, 0.0).passed
    shape = compare_buffer("s", "float32", np.zeros(4), np.zeros((2, 2)), 0.0, 0.0)
    assert not shape.passed and shape.detail is not None and "shape" in shape.detail


def test_compare_outputs_checks_only_outputs_and_merges_sets() -> None:
    w = workload(buf("a"), buf("c", intent="out", shape=[2]), buf("d", intent="inout", shape=[2]))
    good = {"c": np.array([1.0, 2.0]), "d": np.array([0.0, 0.0])}
    bad = {"c": np.array([1.0, 2.0]), "d": np.array([0.0, 0.5])}
    first = compare_outputs(w, good, good, 1e-6, 1e-6)
    second = compare_outputs(w, bad, good, 1e-6, 1e-6)
    assert first.passed and not second.passed
    assert second.detail is not None and second.detail.startswith("d[1]")
    merged = correctness_of([first, second])
    assert merged.checked and merged.passed is False and merged.input_sets == 2
    assert merged.max_abs_error == 0.5
    assert merged.detail == second.detail
    named = correctness_of([first, second], seeds=[11, 42])
    assert named.detail == f"{second.detail} (input set 2 of 2, seed 42)"
    assert correctness_of([first, first], seeds=[11, 42]).detail is None
    unchecked = correctness_of([], "no reference kernel given")
    assert (
        not unchecked.checked and unchecked.passed is None and unchecked.detail == "no reference kernel given"
    )
    assert correctness_of([Comparison(True, 0.0, 0.0)]).passed is True
    # A workload with no out/inout buffer compares nothing: that is no pass (a wrong kernel would be "ok").
    inputs_only = workload(buf("a"), buf("c", shape=[2]))
    nothing = correctness_of([compare_outputs(inputs_only, good, bad, 1e-6, 1e-6)] * 2)
    assert not nothing.checked and nothing.passed is None and "no out or inout buffer" in str(nothing.detail)


# ---------------------------------------------------------------- median and its interval


def test_median_interval_ranks_match_the_binomial_table() -> None:
    # 95% distribution-free interval of the median: (x_(j), x_(n-j+1)), 1-based, from standard tables.
    table = {6: (1, 6), 10: (2, 9), 20: (6, 15), 30: (10, 21), 50: (18, 33), 100: (40, 61)}
    for n, (j, k) in table.items():
        assert median_ci_ranks(n) == (j - 1, k - 1), n
    assert median_ci_ranks(1) == (0, 0)
    assert median_ci_ranks(5) == (0, 4)  # under 6 samples: the range
    # The normal approximation used above 300 samples agrees with the exact ranks.
    for n in (301, 500, 1000):
        lo, _ = median_ci_ranks(n)
        assert abs(lo + 1 - _largest_tail_rank(n, 0.025)) <= 1


def test_median_interval_covers_the_true_median_about_95_percent() -> None:
    rng = np.random.default_rng(0)
    n, trials = 20, 4000
    draws = rng.lognormal(mean=0.0, sigma=0.3, size=(trials, n))  # true median 1.0
    ordered = np.sort(draws, axis=1)
    lo, hi = median_ci_ranks(n)
    coverage = float(np.mean((ordered[:, lo] <= 1.0) & (1.0 <= ordered[:, hi])))
    assert 0.94 <= coverage <= 0.975  # exact: 1 - 2 P(X <= 5) = 0.9586


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=1e4, allow_nan=False), min_size=1, max_size=400))
def test_summary_invariants(samples: list[float]) -> None:
    stats = summarize(samples)
    assert stats.min <= stats.ci95_low <= stats.median <= stats.ci95_high
    assert stats.p10 <= stats.median <= stats.p90
    assert stats.runs == len(samples)
    assert stats.relative_noise >= 0
    assert median_ci95(samples) == (stats.ci95_low, stats.ci95_high)


def test_summary_values() -> None:
    stats = summarize([1.0, 2.0, 3.0, 4.0, 100.0, 2.5, 2.5, 2.5, 2.5, 2.5])
    assert stats.median == 2.5 and stats.min == 1.0 and stats.runs == 10
    assert stats.mean == pytest.approx(12.25)
    assert (stats.ci95_low, stats.ci95_high) == (2.0, 4.0)
    assert stats.relative_noise == pytest.approx(0.4)
    assert summarize([3.0]).std == 0.0
    assert relative_noise([2.0] * 12) == 0.0
    assert relative_noise([]) == math.inf
    with pytest.raises(ValueError):
        summarize([])


# ---------------------------------------------------------------- adaptive stopping


def _run(stopper: AdaptiveStopper, draw: np.ndarray) -> str | None:
    for x in draw:
        reason = stopper.reason()
        if reason is not None:
            return reason
        stopper.add(float(x))
    return stopper.reason()


def test_quiet_samples_stop_at_the_noise_target_soon_after_min_runs() -> None:
    rng = np.random.default_rng(1)
    stopper = AdaptiveStopper(StoppingRule(target_relative_noise=0.01, min_runs=10, max_runs=1000))
    reason = _run(stopper, 1.0 + 0.001 * rng.standard_normal(1000))
    assert reason == "noise_target"
    assert len(stopper.samples) == 10
    assert relative_noise(stopper.samples) <= 0.01


def test_noisy_samples_take_more_runs_and_stop_once_the_interval_is_narrow() -> None:
    rng = np.random.default_rng(2)
    stopper = AdaptiveStopper(StoppingRule(target_relative_noise=0.01, min_runs=10, max_runs=5000))
    reason = _run(stopper, rng.lognormal(0.0, 0.05, 5000))
    assert reason == "noise_target"
    assert 50 < len(stopper.samples) < 1000
    assert relative_noise(stopper.samples) <= 0.01


def test_hopeless_noise_hits_the_run_cap() -> None:
    rng = np.random.default_rng(3)
    stopper = AdaptiveStopper(StoppingRule(target_relative_noise=0.001, min_runs=10, max_runs=200))
    assert _run(stopper, rng.lognormal(0.0, 1.0, 1000)) == "max_runs"
    assert len(stopper.samples) == 200


def test_time_cap_and_min_runs() -> None:
    stopper = AdaptiveStopper(StoppingRule(target_relative_noise=0.5, min_runs=10, max_runs=100))
    for _ in range(5):
        stopper.add(1.0)
    assert stopper.reason() is None  # zero noise, but under min_runs
    assert stopper.reason(seconds_left=0.01, seconds_per_sample=0.02) == "time_cap"
    capped = AdaptiveStopper(StoppingRule(min_runs=50, max_runs=3))
    for _ in range(3):
        capped.add(1.0)
    assert capped.reason() == "max_runs"


# ---------------------------------------------------------------- plausibility


def test_physical_floor() -> None:
    assert physical_floor_ms(4_800_000_000, 4800.0) == pytest.approx(1.0)
    assert below_physical_floor(0.5, 4_800_000_000, 4800.0)
    assert not below_physical_floor(0.95, 4_800_000_000, 4800.0)  # within the 10% tolerance
    assert not below_physical_floor(0.001, 0, 4800.0)
    w = workload(
        buf("a", shape=[1000]), buf("c", intent="out", shape=[1000]), buf("d", intent="inout", shape=[500])
    )
    assert w.bytes_moved_floor() == 4000 + 4000 + 2 * 2000
    # Outputs that fit in L2 need not reach DRAM in time: only the reads count then.
    assert floor_bytes(w, l2_bytes=50 * 2**20) == 4000 + 2000
    assert floor_bytes(w, l2_bytes=1000) == 12000 - 1000
    assert floor_bytes(w) == 12000


def test_events_against_wall_clock() -> None:
    assert not events_disagree(1.0, [1.05, 1.2, 1.1])
    assert not events_disagree(0.005, [0.03])  # launch and sync overhead on a tiny kernel
    assert events_disagree(1.0, [5.0, 6.0])
    assert not events_disagree(1.0, [])


def test_integers_are_compared_exactly_not_through_float64() -> None:
    """Near 2**60, int64 values one apart are equal as float64: a wrong integer output must still fail."""
    want = np.array([2**60, 2**60 + 2, -(2**63), 5], dtype=np.int64)
    got = want.copy()
    got[0] += 1
    bad = compare_buffer("idx", "int64", got, want, atol=0.0, rtol=0.0)
    assert not bad.passed and bad.max_abs_error == 1.0
    assert bad.detail is not None and f"got {2**60 + 1}, reference {2**60}" in bad.detail
    assert compare_buffer("idx", "int64", want, want, atol=0.0, rtol=0.0).passed
    wide = np.array([2**64 - 1, 0], dtype=np.uint64)
    assert not compare_buffer("u", "uint64", wide, wide[::-1].copy(), atol=0.0, rtol=0.0).passed
    close = compare_buffer("n", "int32", np.array([10, 20], np.int32), np.array([11, 20], np.int32), 1.0, 0.0)
    assert close.passed and close.max_abs_error == 1.0  # a tolerance still applies
    # ... an absolute one only: the default rtol let a wrong index through (123579 for 123456).
    idx = np.array([123456], np.int32)
    assert not compare_buffer("idx", "int32", idx + 123, idx, atol=1e-5, rtol=1e-3).passed


def test_fewer_than_six_runs_cannot_bound_the_median_at_95_percent() -> None:
    from forecaster_mcp.measure.timing import median_ci_covers

    assert [median_ci_covers(n) for n in range(0, 8)] == [False] * 6 + [True, True]
    assert median_ci_covers(5000)


def test_the_scratch_of_drawing_inputs_is_not_undercounted() -> None:
    """The host-memory check before a measurement counts these temporaries: undercounted, a workload that
    passes it can still be OOM-killed and the crash blamed on the kernel."""
    import tracemalloc

    from forecaster_mcp.measure.inputs import _buffer, draw_scratch_bytes

    n = 1 << 21
    for dtype in ("float32", "float16", "bfloat16", "int8", "int32", "uint64", "bool"):
        for init in ("random_uniform", "random_normal", "zeros", "ones", "arange"):
            arg = BufferArg.model_validate(buf("x", dtype=dtype, shape=[n], init=init))
            tracemalloc.start()
            out = _buffer(arg, np.random.default_rng(0))
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            # Half a byte per element and 1 MiB of slack: the generator's own buffers, tracemalloc's bookkeeping.
            assert peak - out.nbytes <= draw_scratch_bytes(arg) + 0.5 * n + 2**20, (dtype, init)
