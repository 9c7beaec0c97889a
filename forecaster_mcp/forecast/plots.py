"""Evaluation plots: reliability diagram and risk-coverage curves (matplotlib imported lazily, here only)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forecaster_mcp.forecast import metrics as M

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]  # name -> (p_faster, speedups)


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable("matplotlib is not installed: pip install 'forecaster-mcp[plots]'") from exc
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


_NOTHING_TO_PLOT = "no non-tie pairs: every pair is a tie, so no direction to score"


def _say_empty(ax: Any) -> None:
    ax.text(0.5, 0.5, _NOTHING_TO_PLOT, transform=ax.transAxes, ha="center", va="center", fontsize=9)


def reliability_png(path: Path, series: Series, n_bins: int = 10) -> int:
    """Accuracy against confidence of the predicted direction, one line per forecaster, counts below.
    Returns how many forecasters had a non-tie pair to draw (with none the figure says so)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(6, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True
    )
    top.plot([0.5, 1.0], [0.5, 1.0], color="grey", linestyle="--", linewidth=1, label="calibrated")
    width = 0.5 / n_bins / (len(series) + 1)
    drawn = 0
    for i, (name, (p, s)) in enumerate(series.items()):
        table = [b for b in M.reliability(p, s, n_bins) if b.count]
        if not table:
            continue
        drawn += 1
        ece = M.ece(p, s, n_bins)
        top.plot(
            [b.mean_confidence for b in table],
            [b.accuracy for b in table],
            marker="o",
            label=f"{name} (ECE {ece:.3f})",
        )
        bottom.bar(
            [b.low + (i + 0.5) * width for b in table], [b.count for b in table], width=width, label=name
        )
    if not drawn:
        _say_empty(top)
    top.set_ylabel("accuracy (non-tie pairs)")
    top.set_xlim(0.5, 1.0)
    top.set_ylim(0.0, 1.02)
    top.legend(loc="lower right", fontsize=8)
    top.set_title("Reliability of the faster/slower direction")
    bottom.set_xlabel("confidence of the predicted direction, max(p, 1 - p)")
    bottom.set_ylabel("pairs")
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return drawn


def risk_coverage_png(path: Path, series: Series, target_error: float | None = None) -> int:
    """Error among the most confident pairs against the share of pairs kept, one line per forecaster.
    Returns how many forecasters had a non-tie pair to draw (with none the figure says so)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5), constrained_layout=True)
    drawn = 0
    for name, (p, s) in series.items():
        rc = M.direction_risk_coverage(p, s)
        if rc.risk.size == 0:
            continue
        drawn += 1
        ax.plot(rc.coverage, rc.risk, label=f"{name} (AURC {rc.aurc:.3f})")
    if target_error is not None:
        ax.axhline(
            target_error, color="grey", linestyle="--", linewidth=1, label=f"target error {target_error:g}"
        )
    if not drawn:
        _say_empty(ax)
    ax.set_xlabel("coverage (share of non-tie pairs decided, most confident first)")
    ax.set_ylabel("risk (error rate among decided)")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(bottom=0.0)
    if drawn or target_error is not None:
        ax.legend(fontsize=8)
    ax.set_title("Risk-coverage")
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return drawn
