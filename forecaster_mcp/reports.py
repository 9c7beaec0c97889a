"""Output models of `budget_status` and the gpu-specs resource."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from forecaster_mcp.hardware.specs import GpuSpec
from forecaster_mcp.models import ForecasterInfo


class MeasurementCounts(BaseModel):
    count: int = Field(default=0, description="measurement results this ledger got, cache hits included")
    cache_hits: int = 0
    failures: int = Field(
        default=0,
        description="of count, the results that are not ok (a failure served again from cache counts again)",
    )
    gpu_seconds: float = Field(default=0.0, description="charged for the measurements counted here")
    cancelled_gpu_seconds: float = Field(
        default=0.0,
        description="charged for device time of measurements cancelled while they held the device (no result); "
        "with gpu_seconds and not_saved_gpu_seconds, what spent_gpu_seconds is made of",
    )
    not_saved_gpu_seconds: float = Field(
        default=0.0,
        description="charged for measurements that ran but whose result the server could not store (the caller "
        "was told so); counted as cancelled on databases written before this was recorded",
    )


class ForecastCounts(BaseModel):
    count: int = 0
    decided: int = 0
    deferred: int = 0
    verified: int = Field(
        default=0,
        description="decided forecasts later checked by measuring both kernels; pairs within 3% of each other "
        "are ties within noise and not counted (as in the eval metrics)",
    )
    verified_correct: int = 0
    accuracy: float | None = Field(default=None, description="accuracy of the verified forecasts")


class Savings(BaseModel):
    cache: float = Field(default=0.0, description="GPU-seconds cache hits would have cost")
    forecasts: float = Field(
        default=0.0,
        description="estimated GPU-seconds decided forecasts avoided: pairs decided and never measured, "
        "priced at this ledger's median paid measurement (0 until it has paid for one)",
    )


class LlmUsage(BaseModel):
    calls: int = Field(
        default=0, description="compare calls that used Claude (each one or more API requests)"
    )
    input_tokens: int = Field(default=0, description="uncached input tokens")
    output_tokens: int = 0
    cache_read_tokens: int = Field(default=0, description="input tokens read from the prompt cache")
    cache_write_tokens: int = Field(default=0, description="input tokens written to the prompt cache")
    cost_usd: float = Field(default=0.0, description="dollar cost of the tokens of models with a known price")
    unpriced_tokens: int = Field(
        default=0,
        description="tokens spent on a model this server knows no price for (claude_model set to a new or "
        "misspelt name): cost_usd leaves them out",
    )


class CalibrationSummary(BaseModel):
    verified_pairs: int = Field(
        default=0, description="verified forecasts, decided or unsure, that are not ties within noise"
    )
    brier: float | None = Field(
        default=None,
        description="Brier score on those pairs of the probability verdicts are decided by (p_faster, with "
        "either kernel's chance of failing to compile or run counted, as in confidence)",
    )


class BudgetStatus(BaseModel):
    """What `budget_status` returns: the caller's ledger and how the forecaster has done on it."""

    ledger: str
    limit_gpu_seconds: float
    spent_gpu_seconds: float
    reserved_gpu_seconds: float
    remaining_gpu_seconds: float
    measurements: MeasurementCounts
    forecasts: ForecastCounts
    gpu_seconds_saved: Savings
    llm: LlmUsage
    calibration: CalibrationSummary
    forecaster: ForecasterInfo
    devices: list[str] = Field(description="devices this server can measure on")
    notes: list[str] = Field(default_factory=list)

    @classmethod
    def from_report(
        cls,
        *,
        ledger: str,
        report: dict[str, Any],
        forecaster: ForecasterInfo,
        devices: list[str],
        notes: list[str],
    ) -> BudgetStatus:
        return cls(
            ledger=ledger,
            limit_gpu_seconds=report["limit_gpu_seconds"],
            spent_gpu_seconds=report["spent_gpu_seconds"],
            reserved_gpu_seconds=report["reserved_gpu_seconds"],
            remaining_gpu_seconds=report["remaining_gpu_seconds"],
            measurements=MeasurementCounts.model_validate(report.get("measurements", {})),
            forecasts=ForecastCounts.model_validate(report.get("forecasts", {})),
            gpu_seconds_saved=Savings.model_validate(report.get("gpu_seconds_saved", {})),
            llm=LlmUsage.model_validate(report.get("llm", {})),
            calibration=CalibrationSummary.model_validate(report.get("calibration", {})),
            forecaster=forecaster,
            devices=devices,
            notes=notes,
        )


class GpuSpecRow(BaseModel):
    name: str
    vendor: str
    arch: str
    compute_capability: str | None
    sms: int
    l2_bytes: int
    mem_bandwidth_gbs: float
    fp32_tflops: float
    fp16_tensor_tflops: float  # vector FP16 where tensor_cores is false
    mem_gib: float
    aliases: list[str]
    tensor_cores: bool  # matrix instructions (NVIDIA from CC 7.0, AMD CDNA and RDNA3)
    fp64_ratio: float  # FP32 throughput over FP64 throughput (2: half rate; 64 on a GeForce)

    @classmethod
    def from_spec(cls, s: GpuSpec) -> GpuSpecRow:
        return cls(
            name=s.name,
            vendor=s.vendor,
            arch=s.arch,
            compute_capability=s.compute_capability,
            sms=s.sms,
            l2_bytes=s.l2_bytes,
            mem_bandwidth_gbs=s.mem_bandwidth_gbs,
            fp32_tflops=s.fp32_tflops,
            fp16_tensor_tflops=s.fp16_tensor_tflops,
            mem_gib=s.mem_gib,
            aliases=list(s.aliases),
            tensor_cores=s.tensor_cores,
            fp64_ratio=s.fp64_ratio,
        )
