"""`gpu-report`: the GPU check's targets, met or missed, from what its parts measured.

Reads the parts' JSON lines (gpu-throughput, gpu-quality, gpu-generate, load-memory, the check's
status lines) and pytest's log, and writes the result file gpu.json through the harness: the targets
and the figures a document quotes, with every record as the raw data, and the machine the parts ran
on (their first machine record). Where this run has no baseline figure of its own (gpu-throughput
--no-baseline), the ratio is against the figure on record below. With --markdown, the tables too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from benchmarks.gpu.common import with_commit
from benchmarks.gpu.throughput import MEMORY_CASE
from dlm.bench.measure import MachineStamp

PYTEST_SUMMARY = re.compile(r"\b(passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
TARGETS = {
    "speed_ratio": 1.15,
    "memory_gib": 24.0,
    "bits_per_byte": 2.00,
    "dlm_seconds": 60.0,
    "load_ratio": 1.15,
    "generate_speedup": 5.0,
    "generate_perplexity": 0.10,
}
# Recorded on an H200 by the baseline scripts (torch 2.11, 2026-12-04): used where this run has no figure of its own.
RECORDED_BASELINE = {
    "baseline-110M": 519904,
    "baseline-1.3B": 60877,
    "modernbert-110M": 258304,
    "modernbert-1.3B": 39662,
}
# What the result file keeps of each throughput and quality record as figures (the raw records keep all).
THROUGHPUT_FIGURES = (
    "params_M",
    "batch",
    "tokens_per_s",
    "model_tflops",
    "mfu_measured_pct",
    "mfu_datasheet_pct",
    "step_ms",
    "peak_gib",
    "reserved_gib",
    "max_batch",
)
QUALITY_FIGURES = ("bits_per_byte", "bits_per_byte_stderr", "steps", "max_steps", "train_wall_s", "best_bpb", "seconds")

Target = dict[str, Any]  # {"target": what, "measured": text or None, "met": bool or None (not measured)}


def _find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    hits = [r for r in records if all(r.get(k) == v for k, v in match.items()) and "error" not in r]
    return hits[-1] if hits else None


def _best(records: list[dict[str, Any]], size: str) -> dict[str, Any] | None:
    """dlm's fastest compiled adamw case at `size` (each kernel order is a config setting)."""

    cases = [
        r
        for r in records
        if r.get("source") == "dlm"
        and r.get("size") == size
        and r.get("compile")
        and r.get("optimizer") == "adamw"
        and "tokens_per_s" in r
    ]
    return max(cases, key=lambda r: r["tokens_per_s"]) if cases else None


def _ratio_target(records: list[dict[str, Any]], size: str) -> Target:
    dlm, baseline = _best(records, size), _find(records, case=f"baseline-{size}", compile=True)
    target = f"{size}: dlm tokens/s >= {TARGETS['speed_ratio']}x the compiled baseline, >= 2x ModernBERT"
    if dlm is None:
        return {"target": target, "measured": None, "met": None, "ratio": None}
    baseline_tps, source = (
        (baseline["tokens_per_s"], "this run") if baseline else (RECORDED_BASELINE[f"baseline-{size}"], "recorded")
    )
    ratio = dlm["tokens_per_s"] / baseline_tps
    modern = RECORDED_BASELINE[f"modernbert-{size}"]
    measured = (
        f"{dlm['case']} {dlm['tokens_per_s']} tok/s = {ratio:.2f}x the baseline ({baseline_tps}, {source}), "
        f"{dlm['tokens_per_s'] / modern:.2f}x ModernBERT ({modern}, recorded)"
    )
    met = ratio >= TARGETS["speed_ratio"] and dlm["tokens_per_s"] >= 2 * modern
    return {"target": target, "measured": measured, "met": met, "ratio": ratio}


def _block_target(records: list[dict[str, Any]]) -> Target:
    whole, block = _find(records, case="dlm-110M"), _find(records, case="dlm-110M-block16")
    target = "110M: a block-diffusion step (B = 16) within 1.6x a whole-sequence step"
    if whole is None or block is None:
        return {"target": target, "measured": None, "met": None}
    ratio = whole["tokens_per_s"] / block["tokens_per_s"]
    measured = f"{block.get('step_ms')} ms against {whole.get('step_ms')} ms = {ratio:.2f}x"
    return {"target": target, "measured": measured, "met": ratio <= 1.6, "ratio": ratio}


def _memory_targets(records: list[dict[str, Any]]) -> dict[str, Target]:
    memory, search = _find(records, case="dlm-1.3B-adamw8bit-ckpt-eager"), _find(records, case=MEMORY_CASE[1])
    return {
        "memory_peak": {
            "target": f"1.3B adamw8bit + checkpointing, batch 8: peak <= {TARGETS['memory_gib']:.0f} GiB",
            "measured": None
            if memory is None
            else f"{memory['peak_gib']} GiB allocated, {memory['reserved_gib']} reserved",
            "met": None if memory is None else memory["peak_gib"] <= TARGETS["memory_gib"],
        },
        "memory_search": {
            "target": "1.3B adamw8bit + checkpointing: --find-max-batch --memory-limit 24 finds a batch > 0",
            "measured": None if search is None else f"batch {search['max_batch']} (probes {search['probes']})",
            "met": None if search is None else search["max_batch"] > 0,
        },
    }


def _quality_target(records: list[dict[str, Any]]) -> Target:
    runs = [r for r in records if str(r.get("case", "")).startswith("dlm-shakespeare-") and "bits_per_byte" in r]
    baseline = _find(records, case="baseline-mdm")
    baseline_text = (
        "; baseline MDM recorded 2.0876 at 60 s, 2.0496 at 80 s"
        if baseline is None
        else f"; baseline {baseline['best_bpb']} at {baseline['seconds']:.0f} s"
    )
    diffusion = _find(records, case="dlm-shakespeare-config")
    measured = "; ".join(
        f"{r['case']}: {r.get('bits_per_byte')} after {r['train_wall_s']} s, {r['steps']} steps" for r in runs
    )
    bits = None if diffusion is None else diffusion.get("bits_per_byte")
    return {
        "target": f"configs/shakespeare.toml: <= {TARGETS['bits_per_byte']} bits/byte in <= 60 s of training",
        "measured": (measured + baseline_text) if runs else None,
        "met": None
        if bits is None or diffusion is None
        else bits <= TARGETS["bits_per_byte"] and diffusion["seconds_budget"] <= TARGETS["dlm_seconds"],
    }


def _load_target(records: list[dict[str, Any]]) -> Target:
    load = next((r for r in records if r.get("part") == "load" and "gpu_ratio" in r), None)
    return {
        "target": f"an 8B bfloat16 LLaDA directory loads with peak GPU memory <= {TARGETS['load_ratio']}x its weights",
        "measured": None
        if load is None
        else f"{load['peak_gpu_bytes'] / 2**30:.2f} GiB peak for {load['weight_bytes'] / 2**30:.2f} GiB of weights "
        f"= {load['gpu_ratio']}x, {load['seconds']} s, host RSS {load['rss_ratio']}x",
        "met": None if load is None else load["gpu_ratio"] <= TARGETS["load_ratio"],
    }


def _lora_record(records: list[dict[str, Any]]) -> Target:
    lora = next((r for r in records if r.get("part") == "lora" and r.get("peak_gpu_bytes")), None)
    return {
        "target": "8B LoRA rank 16 at seq 2048 (configs/llada-8b-lora.toml): measured peak <= the estimate",
        "measured": None
        if lora is None
        else f"{lora['peak_gpu_bytes'] / 2**30:.2f} GiB measured, {lora['estimate_bytes'] / 2**30:.2f} GiB "
        f"estimated ({lora['ratio_to_estimate']}x), {lora['seconds_per_step']} s a step of 2 micro-batches",
        "met": None if lora is None else lora["ratio_to_estimate"] <= 1.0,
    }


def fastest_within_bound(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per batch, the fastest setting whose judge perplexity is within 10% of the default sampler's."""

    rows = [r for r in records if r.get("part") == "generate" and "tokens_per_s" in r]
    best: dict[int, dict[str, Any]] = {}
    for row in rows:
        reference = next((r for r in rows if r["default"] and r["batch"] == row["batch"]), None)
        if reference is None or row["default"]:
            continue
        change = row["judge_perplexity"] / reference["judge_perplexity"] - 1
        speedup = row["tokens_per_s"] / reference["tokens_per_s"]
        if change <= TARGETS["generate_perplexity"] and speedup > best.get(row["batch"], {}).get("speedup", 0.0):
            best[row["batch"]] = {"speedup": speedup, "setting": row["setting"], "perplexity_change": change}
    return dict(sorted(best.items()))


def _generate_target(records: list[dict[str, Any]]) -> Target:
    measured_any = any(r.get("part") == "generate" and "tokens_per_s" in r for r in records)
    best = fastest_within_bound(records)
    measured = "; ".join(
        f"batch {batch}: {b['speedup']:.2f}x with {b['setting']} "
        f"({100 * b['perplexity_change']:+.1f}% judge perplexity)"
        for batch, b in best.items()
    )
    return {
        "target": f"generation: >= {TARGETS['generate_speedup']}x the default sampler's tokens/s at judge perplexity "
        f"within {100 * TARGETS['generate_perplexity']:.0f}%",
        "measured": (measured or "no setting within the bound") if measured_any else None,
        "met": None if not measured_any else any(b["speedup"] >= TARGETS["generate_speedup"] for b in best.values()),
    }


def targets(records: list[dict[str, Any]]) -> dict[str, Target]:
    """Every target of the check, in the order of the report."""

    return {
        "speed_110m": _ratio_target(records, "110M"),
        "speed_1_3b": _ratio_target(records, "1.3B"),
        "block_step": _block_target(records),
        **_memory_targets(records),
        "quality": _quality_target(records),
        "load": _load_target(records),
        "lora": _lora_record(records),
        "generate": _generate_target(records),
    }


def figure_key(case: str) -> str:
    """A case's name as a figures key: lower case, no dots (a placeholder's path splits on them)."""

    return re.sub(r"[^a-z0-9]+", "_", case.lower()).strip("_")


def figures_of(records: list[dict[str, Any]], goals: dict[str, Target], pytest_summary: str | None) -> dict[str, Any]:
    def picked(record: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
        return {key.lower(): record[key] for key in keys if key in record}

    measured = [r for r in records if "error" not in r and r.get("case") not in (None, "machine", "matmul-ceiling")]
    ceiling = _find(records, case="matmul-ceiling")
    memory = {part: _find(records, part=part) for part in ("write", "load", "lora")}
    return {
        "targets": goals,
        "pytest": pytest_summary,
        "matmul_bf16_tflops": None if ceiling is None else ceiling["matmul_bf16_tflops"],
        "throughput": {
            figure_key(r["case"]): picked(r, THROUGHPUT_FIGURES) for r in measured if r.get("part") == "throughput"
        },
        "quality": {figure_key(r["case"]): picked(r, QUALITY_FIGURES) for r in measured if r.get("part") == "quality"},
        "generate": {f"batch_{batch}": best for batch, best in fastest_within_bound(records).items()},
        "memory": {
            part: {k: v for k, v in record.items() if k not in ("part", "device")}
            for part, record in memory.items()
            if record is not None and record.get("case") != "machine"
        },
        "parts": {
            r["name"]: {"rc": r["rc"], "seconds": r["seconds"], "limit": r["limit"]}
            for r in records
            if r.get("part") == "status"
        },
    }


def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _throughput_rows(records: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| case | params M | batch | compile | tokens/s | model TFLOP/s | MFU % (measured ceiling) | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        case = str(r.get("case", ""))
        if (
            r.get("part") != "throughput"
            or case in ("machine", "matmul-ceiling")
            or case.startswith("dlm-shakespeare-14M")
        ):
            continue
        note = r.get("error") or (
            f"{r.get('optimizer')}, checkpointing {r.get('activation_checkpointing')}, {r.get('attention')}"
            if r.get("source") == "dlm"
            else ""
        )
        lines.append(
            f"| {r['case']} | {_cell(r.get('params_M'))} | {_cell(r.get('batch'))} | "
            f"{_cell(r.get('compile'))} | {_cell(r.get('tokens_per_s'))} | "
            f"{_cell(r.get('model_tflops'))} | {_cell(r.get('mfu_measured_pct'))} | "
            f"{_cell(r.get('peak_gib'))} | {note} |"
        )
    return lines


def markdown_tables(
    records: list[dict[str, Any]], goals: dict[str, Target], pytest_summary: str | None, stamp: MachineStamp
) -> str:
    ceiling = _find(records, case="matmul-ceiling")
    lines = [
        f"GPU check: {stamp.gpu or 'no GPU'}, torch {stamp.torch}, measured bf16 matmul ceiling "
        f"{'?' if ceiling is None else ceiling['matmul_bf16_tflops']} TFLOP/s, commit {stamp.commit or 'unknown'}.",
        "",
    ]
    if pytest_summary:
        lines += [f"`pytest -m gpu`: {pytest_summary}", ""]
    lines += ["| target | measured | met |", "|---|---|---|"]
    lines += [f"| {g['target']} | {_cell(g['measured'])} | {_cell(g['met'])} |" for g in goals.values()]
    lines += ["", *_throughput_rows(records)]
    generated = [r for r in records if r.get("part") == "generate" and "tokens_per_s" in r]
    if generated:
        lines += [
            "",
            "| batch | setting | tokens/s | passes/token | judge ppl | entropy bits | distinct-2 |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch']} | {r['setting'] or 'defaults'}{' (default)' if r['default'] else ''} | "
            f"{r['tokens_per_s']} | {r['passes_per_token']} | {r['judge_perplexity']} | {r['entropy_bits']} | "
            f"{r['distinct_2']} |"
            for r in generated
        ]
    memory = [r for r in records if r.get("part") in ("write", "load", "lora") and r.get("case") != "machine"]
    if memory:
        lines += ["", "Memory records:", ""] + [f"- `{json.dumps(r)}`" for r in memory]
    parts = [r for r in records if r.get("part") == "status"]
    if parts:
        lines += ["", "| part | exit code | seconds | limit s |", "|---|---|---|---|"]
        lines += [f"| {p['name']} | {p['rc']} | {p['seconds']} | {p['limit']} |" for p in parts]
    return "\n".join(lines) + "\n"


def read_inputs(paths: list[Path]) -> tuple[list[dict[str, Any]], str | None]:
    """Every JSON record of the files that exist, and the last summary line of pytest's log (*.log)."""

    records: list[dict[str, Any]] = []
    pytest_summary = None
    for path in paths:
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".log":  # pytest's output: keep its final summary line ("3 passed, 2 skipped in 9.1s")
            summaries = [line.strip("= ") for line in text.splitlines() if PYTEST_SUMMARY.search(line)]
            pytest_summary = summaries[-1] if summaries else None
            continue
        records += [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    return records, pytest_summary


def gpu_report(
    inputs: Annotated[
        list[Path],
        typer.Argument(help="The parts' JSON lines, the check's status lines, pytest's log (*.log); missing: skipped."),
    ],
    results: Annotated[Path, typer.Option(help="Directory of the result file gpu.json.")] = harness.RESULTS,
    markdown: Annotated[Path | None, typer.Option(help="Also write the tables here.")] = None,
) -> None:
    """The GPU check's targets, met or missed, and its tables, from its parts' records."""

    run = harness.start("gpu", inputs=[str(path) for path in inputs])
    records, pytest_summary = read_inputs(inputs)
    measured_on = next((r["machine"] for r in records if r.get("case") == "machine"), None)
    # The GPU machine the parts ran on, where this report may be written elsewhere.
    run.stamp = with_commit(run.stamp if measured_on is None else MachineStamp(**measured_on))
    goals = targets(records)
    path = run.save(figures_of(records, goals, pytest_summary), {"records": records}, results=results)
    tables = markdown_tables(records, goals, pytest_summary, run.stamp)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(tables, encoding="utf-8")
    typer.echo(tables)
    met = sum(goal["met"] is True for goal in goals.values())
    typer.echo(f"{met} of {len(goals)} targets met; wrote {path}")
