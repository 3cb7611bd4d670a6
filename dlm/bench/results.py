"""`dlm bench`'s report: the timed results and what the CLI shows of them (nothing here prints).

`BenchResult` is one configuration's timing, `BatchSearch` the batch finder's probes and `BenchReport`
both together; `report_summary` and `report_table` turn a report into the lines above the table and
its string cells. The timing itself lives in `dlm.bench`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchResult:
    """One configuration's timing; every figure is per process and per optimizer step."""

    settings: dict[str, str]  # the --compare values of this row (empty without --compare)
    device: str
    device_name: str
    precision: str
    torch_version: str
    attention_backend: str
    compile: bool
    optimizer: str
    activation_checkpointing: bool
    parameters: int
    batch_size: int
    gradient_accumulation_steps: int
    seq_len: int
    steps: int
    warmup: int
    warmup_seconds: float  # includes compilation
    step_time_s: float  # median
    step_time_min_s: float
    step_time_max_s: float
    step_time_spread_pct: float  # interquartile range / median
    tokens_per_second: float
    flops_per_token: int
    model_flops_per_second: float
    peak_flops_per_second: float | None
    mfu: float | None  # None: the device's peak is not known ("n/a")
    measured_peak_flops_per_second: float | None  # a large matmul timed here (--measure-peak)
    mfu_measured: float | None  # model FLOP/s over that measured ceiling
    peak_allocated_gib: float | None  # CUDA only
    peak_reserved_gib: float | None  # CUDA only
    peak_rss_gib: float | None  # CPU / MPS: the process's peak resident memory
    loss: float  # mean training loss of the timed steps: a sanity check, not a quality figure
    trainable_parameters: int = 0  # what the optimizer updates: all, or a LoRA run's adapters
    memory_estimate_gib: float = 0.0  # `dlm.train.memory.estimate_training_memory`, beside the measured peak


@dataclass(frozen=True)
class BatchSearch:
    """The largest micro-batch that fits, and every probe made to find it (in order)."""

    batch_size: int  # 0 when not even one sequence fits
    probes: list[tuple[int, bool]]
    memory_limit_gib: float | None = None


@dataclass
class BenchReport:
    """What `dlm bench` shows: the rows (one per --compare combination) and the batch search."""

    rows: list[BenchResult] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)  # settings + "error" (e.g. OOM)
    batch_search: BatchSearch | None = None
    # One save of this config on one process, per checkpoint format (dlm.train.memory.CheckpointEstimate).
    checkpoints: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [asdict(row) for row in self.rows],
            "failures": self.failures,
            "batch_search": None if self.batch_search is None else asdict(self.batch_search),
            "checkpoints": self.checkpoints,
        }


# ---- Presentation data (the CLI renders it; nothing here prints) -------------------------------


_OWN_COLUMNS = ("training.batch_size", "training.precision", "training.compile")


def _short_key(key: str) -> str:
    return key.partition(".")[2] or key


def _trained(result: BenchResult) -> str:
    if result.trainable_parameters in (0, result.parameters):
        return ""
    share = result.trainable_parameters / result.parameters
    return f" ({result.trainable_parameters / 1e6:.2f}M trained, {share:.2%})"


def report_summary(report: BenchReport) -> list[str]:
    """Lines shown above the table: what ran where."""

    if not report.rows:
        return []
    first = report.rows[0]
    lines = [
        f"device {first.device} ({first.device_name}), torch {first.torch_version}",
        f"model {first.parameters / 1e6:.1f}M parameters{_trained(first)}, seq {first.seq_len}, "
        f"{first.steps} timed steps after {first.warmup} warmup",
        f"estimated memory {first.memory_estimate_gib:.2f} GiB per process (`dlm bench --estimate` itemises it)",
    ]
    if first.measured_peak_flops_per_second is not None:
        unit, scale = ("TFLOP/s", 1e12) if first.device.startswith("cuda") else ("GFLOP/s", 1e9)
        datasheet = first.peak_flops_per_second
        known = "not in dlm's table" if datasheet is None else f"{datasheet / scale:.0f} {unit}"
        lines.append(
            f"measured ceiling: a large {first.precision} matmul ran at "
            f"{first.measured_peak_flops_per_second / scale:.0f} {unit} (datasheet: {known})"
        )
    search = report.batch_search
    if search is not None:
        limit = "" if search.memory_limit_gib is None else f" within {search.memory_limit_gib} GiB"
        tried = ", ".join(f"{size}{'' if ok else ' (OOM)'}" for size, ok in search.probes)
        lines.append(f"largest batch{limit}: {search.batch_size} (tried {tried})")
    for estimate in report.checkpoints:
        mib = 1 << 20
        lines.append(
            f"checkpoint {estimate['format']}: {estimate['total_bytes'] / mib:.1f} MiB on disk, "
            f"{estimate['bytes_per_rank'] / mib:.1f} MiB written per rank, "
            f"+{estimate['rank0_host_bytes'] / mib:.1f} MiB host memory on rank 0 while saving"
        )
    return lines


def report_table(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    """Column headers and string cells, one row per configuration (failures last)."""

    settings = report.rows[0].settings if report.rows else (report.failures or [{}])[0]
    # Batch size, precision and compile have their own columns with the resolved values.
    keys = [key for key in settings if key not in _OWN_COLUMNS and key != "error"]
    cuda = bool(report.rows) and report.rows[0].device.startswith("cuda")
    flops_unit, flops_scale = ("TFLOP/s", 1e12) if cuda else ("GFLOP/s", 1e9)
    memory = "peak alloc / reserved GiB" if cuda else "peak RSS GiB"
    headers = [_short_key(key) for key in keys] + [
        "batch",
        "dtype",
        "compile",
        "tokens/s",
        "step ms (IQR %)",
        f"model {flops_unit}",
        "MFU",
        *(["MFU measured"] if any(row.mfu_measured is not None for row in report.rows) else []),
        memory,
        "attention",
    ]
    rows = []
    for row in report.rows:
        if row.peak_allocated_gib is not None and row.peak_reserved_gib is not None:
            used = f"{row.peak_allocated_gib:.2f} / {row.peak_reserved_gib:.2f}"
        else:
            used = "n/a" if row.peak_rss_gib is None else f"{row.peak_rss_gib:.2f}"
        rows.append(
            [row.settings[key] for key in keys]
            + [
                str(row.batch_size),
                row.precision,
                "yes" if row.compile else "no",
                f"{row.tokens_per_second:,.0f}",
                f"{row.step_time_s * 1e3:.1f} ({row.step_time_spread_pct:.0f}%)",
                f"{row.model_flops_per_second / flops_scale:.1f}",
                "n/a" if row.mfu is None else f"{100 * row.mfu:.1f}%",
                *([] if row.mfu_measured is None else [f"{100 * row.mfu_measured:.1f}%"]),
                used,
                row.attention_backend,
            ]
        )
    for failure in report.failures:
        own = [failure.get(key, "") for key in _OWN_COLUMNS]  # batch, dtype, compile when compared
        rows.append(
            [failure.get(key, "") for key in keys]
            + own
            + ["out of memory"]
            + [""] * (len(headers) - len(keys) - len(own) - 1)
        )
    return headers, rows
