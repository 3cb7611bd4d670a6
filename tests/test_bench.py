"""`dlm bench`: sane figures from the real training step, comparisons, the batch search, the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import typing
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
import typer
from typer.testing import CliRunner

from benchmarks import load_memory
from benchmarks.__main__ import BENCHMARKS
from benchmarks.__main__ import app as benchmarks_app
from benchmarks.gpu import quality as gpu_quality
from benchmarks.gpu import report as gpu_report
from benchmarks.gpu import throughput as gpu_throughput
from benchmarks.gpu.common import DLM_COMMON, QUALITY_DEFAULT, QUALITY_VARIANTS, SIZES
from dlm.bench import results, throughput
from dlm.bench.measure import machine_stamp
from dlm.bench.results import report_table
from dlm.bench.setup import compare_settings, config_key, parse_compare
from dlm.bench.throughput import BenchOutOfMemoryError, benchmark, run_benchmark, search_max_batch
from dlm.cli import main
from dlm.config.schema import ExperimentConfig, load_config
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def tiny(tmp_path: Path, *overrides: str) -> ExperimentConfig:
    # Data and tokenizer paths that do not exist: bench must never need them.
    return load_config(
        TINY,
        [
            f"training.tokenizer={tmp_path / 'missing' / 'tokenizer.json'}",
            f"training.train_data={tmp_path / 'missing' / 'train.bin'}",
            "training.val_data=none",
            *overrides,
        ],
    )


def test_cpu_bench_gives_consistent_figures_without_any_data(tmp_path: Path) -> None:
    experiment = tiny(tmp_path)
    assert not experiment.training.train_data.exists()
    result = run_benchmark(experiment, steps=3, warmup=1, batch_size=4)

    seq_len = experiment.model.max_seq_len
    model = DiffusionTransformer(experiment.model)
    assert result.parameters == model.num_parameters
    assert result.flops_per_token == model.flops_per_token(seq_len)
    assert (result.device, result.precision, result.compile, result.optimizer) == ("cpu", "float32", False, "adamw")
    assert result.batch_size == 4 and result.seq_len == seq_len and result.steps == 3
    assert result.step_time_min_s <= result.step_time_s <= result.step_time_max_s
    assert result.tokens_per_second > 0
    assert result.tokens_per_second == pytest.approx(4 * seq_len / result.step_time_s)
    assert result.model_flops_per_second == pytest.approx(result.flops_per_token * result.tokens_per_second)
    # No peak FLOP/s is known for a CPU: MFU is "n/a", never a made-up figure.
    assert result.peak_flops_per_second is None and result.mfu is None
    assert result.peak_allocated_gib is None and result.peak_rss_gib is not None and result.peak_rss_gib > 0
    # A uniform-ish untrained model's masked cross-entropy is near log V (the ELBO weights average ~1).
    assert math.isfinite(result.loss) and 0.5 * math.log(512) < result.loss < 3 * math.log(512)
    assert result.attention_backend and result.torch_version == torch.__version__


def test_synthetic_tokens_never_contain_the_mask_id() -> None:
    experiment = load_config(TINY, ["model.vocab_size=4", "model.mask_token_id=1"])
    tokens = next(throughput.synthetic_batches(experiment.model, 64, torch.device("cpu"), seed=0))
    assert tokens.shape == (64, experiment.model.max_seq_len)
    assert set(tokens.unique().tolist()) == {0, 2, 3}


def test_compare_runs_the_cartesian_product_in_order(tmp_path: Path) -> None:
    report = benchmark(
        tiny(tmp_path),
        steps=1,
        warmup=0,
        compare=["activation_checkpointing=false,true", "batch_size=2,3"],
    )
    settings = [row.settings for row in report.rows]
    assert settings == [
        {"model.activation_checkpointing": a, "training.batch_size": b} for a in ("false", "true") for b in ("2", "3")
    ]
    assert [(row.activation_checkpointing, row.batch_size) for row in report.rows] == [
        (False, 2),
        (False, 3),
        (True, 2),
        (True, 3),
    ]
    # Recomputation changes the memory, not the arithmetic: same seed, same loss.
    assert report.rows[0].loss == pytest.approx(report.rows[2].loss, rel=1e-5)
    headers, rows = report_table(report)
    assert len(rows) == 4 and all(len(row) == len(headers) for row in rows)
    assert headers[0] == "activation_checkpointing" and "batch_size" not in headers  # shown as "batch"


def test_compare_parsing() -> None:
    assert config_key("optimizer") == "training.optimizer"
    assert config_key("activation_checkpointing") == "model.activation_checkpointing"
    assert config_key("model.d_model") == "model.d_model"
    parsed = parse_compare(["optimizer=adamw,adamw8bit", "compile = false, true"])
    assert parsed == [("training.optimizer", ["adamw", "adamw8bit"]), ("training.compile", ["false", "true"])]
    assert len(compare_settings(parsed)) == 4
    assert compare_settings([]) == [{}]
    for bad in (["nonsense=1,2"], ["optimizer"], ["optimizer="], ["optimizer=adamw", "optimizer=adamw8bit"]):
        with pytest.raises(UserError):
            parse_compare(bad)


def test_a_compared_value_is_validated_like_the_config(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"training\.optimizer"):
        benchmark(tiny(tmp_path), steps=1, warmup=0, compare=["optimizer=sgd"])


def test_out_of_memory_becomes_a_user_error_and_a_failure_row(tmp_path: Path, monkeypatch) -> None:
    real_measure = throughput._measure

    def measure(experiment: ExperimentConfig, *args, **kwargs):  # the allocator refusing batches above 2
        if experiment.training.batch_size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_measure(experiment, *args, **kwargs)

    monkeypatch.setattr(throughput, "_measure", measure)
    with pytest.raises(BenchOutOfMemoryError, match="batch size 4 does not fit"):
        run_benchmark(tiny(tmp_path), steps=1, warmup=0, batch_size=4)
    report = benchmark(tiny(tmp_path), steps=1, warmup=0, compare=["batch_size=2,4"])
    assert [row.batch_size for row in report.rows] == [2]
    assert report.failures[0]["training.batch_size"] == "4" and "does not fit" in report.failures[0]["error"]
    headers, rows = report_table(report)
    assert rows[1][headers.index("batch")] == "4" and "out of memory" in rows[1]


def test_other_runtime_errors_are_not_mistaken_for_out_of_memory(tmp_path: Path, monkeypatch) -> None:
    def measure(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(throughput, "_measure", measure)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_benchmark(tiny(tmp_path), steps=1, warmup=0)


def test_bad_arguments_are_user_errors(tmp_path: Path) -> None:
    experiment = tiny(tmp_path)
    with pytest.raises(UserError, match="steps"):
        run_benchmark(experiment, steps=0, warmup=0)
    with pytest.raises(UserError, match="CUDA"):
        run_benchmark(experiment, steps=1, warmup=0, memory_limit_gib=1.0)
    with pytest.raises(UserError, match="--fused-attention: the flash"):
        run_benchmark(experiment, steps=1, warmup=0, fused_attention=True)
    with pytest.raises(UserError, match="CUDA device"):
        throughput.find_max_batch(experiment)


# ---- the batch search, with a fake "fits in memory" predicate ----------------------------------


def counting(capacity: int) -> tuple[list[int], object]:
    asked: list[int] = []

    def fits(batch_size: int) -> bool:
        asked.append(batch_size)
        return batch_size <= capacity

    return asked, fits


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8, 37, 64, 100, 1000])
@pytest.mark.parametrize("start", [1, 8, 48])
def test_search_finds_the_largest_batch_that_fits(capacity: int, start: int) -> None:
    asked, fits = counting(capacity)
    search = search_max_batch(fits, start=start, limit=4096)
    assert search.batch_size == capacity
    assert [size for size, _ in search.probes] == asked
    assert all(ok == (size <= capacity) for size, ok in search.probes)
    assert len(asked) == len(set(asked))  # every size is tried once: each probe costs a model build
    # Doubling then bisection: about 2 log2 probes, far fewer than a linear scan.
    assert len(asked) <= 2 * math.ceil(math.log2(max(capacity, start) + 1)) + 2


def test_search_stops_at_the_limit_and_reports_nothing_fitting() -> None:
    asked, fits = counting(10**9)
    assert search_max_batch(fits, start=3, limit=40).batch_size == 40
    assert max(asked) == 40
    _, fits = counting(0)
    search = search_max_batch(fits, start=16)
    assert search.batch_size == 0 and [size for size, _ in search.probes][-1] == 1
    with pytest.raises(ValueError):
        search_max_batch(fits, start=0)


# ---- the command line -------------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_json_output_parses(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train.bin"
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--config",
        str(TINY),
        "--set",
        f"training.train_data={missing}",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--json",
    )
    assert code == 0
    payload = json.loads(out)
    (row,) = payload["results"]
    assert row["batch_size"] == 2 and row["device"] == "cpu" and row["tokens_per_second"] > 0
    assert row["mfu"] is None and payload["failures"] == [] and payload["batch_search"] is None


def test_cli_fused_attention_on_cpu_exits_2_with_a_clear_message(capsys) -> None:
    code, out, err = run_cli(capsys, "bench", "--config", str(TINY), "--fused-attention", "--json")
    assert code == 2 and out == ""
    assert "error:" in err and "--fused-attention" in err and "CUDA" in err
    assert "Traceback" not in err


# ---- the GPU check (scripts/gpu_check.sh, benchmarks/gpu/, benchmarks/load_memory.py) without a GPU ----

SCRIPTS = ROOT / "scripts"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["gpu_check.sh", "prepare_gpu_check.sh"])
def test_shell_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)
    # Every benchmark the GPU check runs is one of the kit's subcommands.
    called = set(re.findall(r"-m benchmarks ([a-z-]+)", (SCRIPTS / script).read_text()))
    assert called and called <= set(BENCHMARKS)


def test_measured_peak_gives_a_second_mfu_column(tmp_path: Path) -> None:
    report = benchmark(tiny(tmp_path), steps=2, warmup=1, batch_size=2, measure_peak=True)
    row = report.rows[0]
    assert row.measured_peak_flops_per_second is not None and row.measured_peak_flops_per_second > 0
    assert row.mfu_measured == pytest.approx(row.model_flops_per_second / row.measured_peak_flops_per_second)
    assert row.mfu is None  # the datasheet MFU stays unknown on a CPU
    headers, rows = report_table(report)
    assert rows[0][headers.index("MFU measured")] == f"{100 * row.mfu_measured:.1f}%"
    summary = results.report_summary(report)
    assert any(line.startswith("measured ceiling: a large float32 matmul ran at") for line in summary)
    # Without the flag neither the column nor the figure appears.
    plain = benchmark(tiny(tmp_path), steps=1, warmup=0, batch_size=2)
    assert plain.rows[0].mfu_measured is None and "MFU measured" not in report_table(plain)[0]


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_step_equals_eager_on_cpu(tmp_path: Path, scope: str) -> None:
    # Per-block and whole-model graphs, and the compiled loss, compute the eager step's arithmetic.
    pytest.importorskip("torch._inductor")
    overrides = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32"]
    eager = run_benchmark(tiny(tmp_path, *overrides), steps=2, warmup=2, batch_size=2)
    compiled = run_benchmark(
        tiny(tmp_path, *overrides, "training.compile=true", f"training.compile_scope={scope}"),
        steps=2,
        warmup=2,
        batch_size=2,
    )
    assert compiled.compile and not eager.compile
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-5)


def gpu_app() -> typer.Typer:
    """`python -m benchmarks`, every subcommand registered (the GPU check's among them)."""

    return benchmarks_app


def test_gpu_bench_arguments() -> None:
    app = gpu_app()
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]

    def parsed(command: str, *args: str) -> dict[str, object]:
        return commands[command].make_context(command, list(args)).params

    params = parsed("gpu-throughput", "--out", "t.jsonl", "--stage", "extra")
    assert (params["stage"], params["steps"], params["warmup"], params["baseline"]) == ("extra", 10, 4, True)
    params = parsed("gpu-quality", "--out", "q.jsonl", "--dlm-seconds", "30")
    assert (params["dlm_seconds"], params["baseline_seconds"], params["device"], params["baseline"]) == (
        30.0,
        80.0,
        "cuda",
        False,
    )
    assert str(params["variants"]).split(",") == QUALITY_DEFAULT
    for bad in (
        ["gpu-throughput", "--out", "t", "--stage", "everything"],
        ["gpu-throughput", "--out", "t", "--steps", "0"],
        ["gpu-quality", "--out", "q", "--dlm-seconds", "0"],
        ["gpu-quality", "--out", "q", "--variants", "config,huge"],
        ["gpu-throughput"],
        ["load-memory", "write", "d", "--shape", "huge"],
        ["nonsense"],
    ):
        result = CliRunner().invoke(app, bad)
        assert result.exit_code == 2, (bad, result.output)
    # Every dlm case and quality variant names a config that exists and overrides that validate.
    for cases in gpu_throughput.DLM_CASES.values():
        for size, _, overrides in cases:
            config = ROOT / SIZES[size]["config"]
            assert load_config(config, DLM_COMMON[:-1] + overrides)
    for config, overrides in QUALITY_VARIANTS.values():
        assert load_config(ROOT / config, overrides)
    assert set(typing.get_args(load_memory.Shape)) == set(load_memory.SHAPES)


@pytest.mark.lora  # the LoRA step needs peft
def test_gpu_load_memory_writes_loads_and_steps_a_tiny_model(tmp_path: Path) -> None:
    # The 8B parts of the GPU check at a CPU's size: write, load (its own result file) and a LoRA step
    # (its record appended to JSON lines after the machine it ran on, as the check collects them).
    pytest.importorskip("peft", reason="the LoRA step needs peft (pip install -e '.[lora]')")
    app, model = gpu_app(), tmp_path / "tiny"
    for args in (["write", str(model), "--shape", "llada-tiny"], ["load", str(model)]):
        result = CliRunner().invoke(app, ["load-memory", *args, "--results", str(tmp_path)])
        assert result.exit_code == 0, result.output
    loaded = json.loads((tmp_path / "load-memory-load.json").read_text())
    assert loaded["figures"]["logits_finite"] and loaded["figures"]["weight_bytes"] == 332416
    assert loaded["machine"]["gpu"] is None and loaded["parameters"]["device"] == "cpu"
    tiny = ["model.vocab_size=512", "model.mask_token_id=510", "model.d_model=64", "model.n_layers=2"]
    tiny += ["model.n_heads=4", "model.ffn_hidden_size=176"]
    lines = tmp_path / "results.jsonl"
    sets = [item for override in tiny for item in ("--set", override)]
    result = CliRunner().invoke(
        app, ["load-memory", "lora", "--device", "cpu", "--seq-len", "32", *sets, "--out", str(lines)]
    )
    assert result.exit_code == 0, result.output
    machine, lora = [json.loads(line) for line in lines.read_text().splitlines()]
    assert machine["case"] == "machine" and machine["machine"]["cores"] >= 1
    assert (
        lora["part"] == "lora" and lora["rank"] == 16 and math.isfinite(lora["loss"]) and lora["peak_gpu_bytes"] is None
    )
    assert CliRunner().invoke(app, ["load-memory", "load"]).exit_code == 2  # load needs the directory


def test_quality_schedule_is_fitted_to_the_budget(tmp_path: Path) -> None:
    throughput = tmp_path / "t.jsonl"
    fit = gpu_quality.fitted_max_steps
    assert fit(throughput, "config", 60, 20000, 200) is None  # nothing measured
    record = {"case": "dlm-shakespeare-14M-config", "step_ms": 20.0, "warmup_s": 10.0}
    throughput.write_text(json.dumps(record) + "\n")
    assert fit(throughput, "config", 60, 20000, 200) == 2250  # 90% of (60 - 10) s at 20 ms
    assert fit(throughput, "config", 60, 1000, 200) == 1000  # never beyond the config
    assert fit(throughput, "config", 5, 20000, 200) == 201  # always past the warmup
    assert fit(throughput, "batch512", 60, 20000, 200) is None  # each variant has its own step time


def test_gpu_report_checks_the_targets(tmp_path: Path) -> None:
    dlm = {"part": "throughput", "source": "dlm", "compile": True, "optimizer": "adamw"}
    figures = {"passes_per_token": 1.0, "entropy_bits": 8.0, "distinct_2": 0.9}
    h200 = machine_stamp().to_dict() | {"gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc"}
    records = [
        {"part": "throughput", "case": "machine", "machine": h200},
        {"part": "throughput", "case": "matmul-ceiling", "matmul_bf16_tflops": 700.0},
        {"part": "throughput", "case": "baseline-110M", "compile": True, "tokens_per_s": 500_000},
        {**dlm, "size": "110M", "case": "dlm-110M", "tokens_per_s": 560_000, "peak_gib": 20},
        {**dlm, "size": "110M", "case": "dlm-110M-cudnn", "tokens_per_s": 600_000, "peak_gib": 20},
        {**dlm, "size": "1.3B", "case": "dlm-1.3B-adamw", "error": "OutOfMemoryError()"},
        {"part": "throughput", "case": "dlm-1.3B-adamw8bit-ckpt-eager", "peak_gib": 19.5, "reserved_gib": 21.0},
        {"part": "throughput", "case": gpu_throughput.MEMORY_CASE[1], "max_batch": 30, "probes": [[8, True]]},
        {"part": "throughput", "case": "dlm-shakespeare-14M-config", "step_ms": 9.0},
        {
            "part": "quality",
            "case": "dlm-shakespeare-batch256",
            "bits_per_byte": 2.01,
            "seconds_budget": 60.0,
            "train_wall_s": 60.2,
            "steps": 2500,
        },
        {
            "part": "quality",
            "case": "dlm-shakespeare-config",
            "bits_per_byte": 2.09,
            "seconds_budget": 60.0,
            "train_wall_s": 60.1,
            "steps": 5000,
        },
        {"part": "status", "name": "core", "rc": 124, "seconds": 200, "limit": 200},
        {**dlm, "size": "110M", "case": "dlm-110M-block16", "tokens_per_s": 300_000, "step_ms": 107.0},
        {
            "part": "load",
            "peak_gpu_bytes": 16 * 2**30,
            "weight_bytes": 16 * 2**30,
            "gpu_ratio": 1.0,
            "seconds": 8.2,
            "rss_ratio": 1.6,
        },
        {
            "part": "lora",
            "peak_gpu_bytes": 22 * 10**9,
            "estimate_bytes": 20 * 10**9,
            "ratio_to_estimate": 1.1,
            "seconds_per_step": 1.7,
        },
        # The default sampler, 8 tokens a pass (6x at +8% judge perplexity), and a threshold (faster, +40%).
        {
            "part": "generate",
            "batch": 32,
            "compare": ["steps=256,32"],
            "setting": {"steps": 256},
            "default": True,
            "tokens_per_s": 100.0,
            "judge_perplexity": 50.0,
            **figures,
        },
        {
            "part": "generate",
            "batch": 32,
            "compare": ["steps=256,32"],
            "setting": {"steps": 32},
            "default": False,
            "tokens_per_s": 600.0,
            "judge_perplexity": 54.0,
            **figures,
        },
        {
            "part": "generate",
            "batch": 32,
            "compare": ["threshold=0.9"],
            "setting": {"threshold": 0.9},
            "default": False,
            "tokens_per_s": 900.0,
            "judge_perplexity": 70.0,
            **figures,
        },
    ]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "pytest.log").write_text("....s\n9 passed, 1 skipped, 290 deselected in 41.20s\n")
    gpu_report.gpu_report(
        [tmp_path / "all.jsonl", tmp_path / "pytest.log", tmp_path / "missing.jsonl"],
        results=tmp_path,
        markdown=tmp_path / "results.md",
    )
    result = json.loads((tmp_path / "gpu.json").read_text())
    goals = result["figures"]["targets"]
    met = [target["met"] for target in goals.values()]
    # 1.20x with the faster kernel order; no 1.3B figure (it failed); the block step 1.87x; 19.5 GiB; batch 30;
    # the config's own run 2.09 (over 2.00); the load 1.0x; LoRA 10% over its estimate; 6x within 10%.
    assert met == [True, None, False, True, True, False, True, False, True]
    assert "batch 32: 6.00x with {'steps': 32} (+8.0% judge perplexity)" in goals["generate"]["measured"]
    assert goals["speed_110m"]["measured"].startswith("dlm-110M-cudnn 600000 tok/s = 1.20x the baseline")
    assert "2.32x ModernBERT" in goals["speed_110m"]["measured"]
    assert goals["speed_110m"]["ratio"] == pytest.approx(1.2)
    assert result["figures"]["pytest"] == "9 passed, 1 skipped, 290 deselected in 41.20s"
    # The figures a document quotes, and where they were measured: the parts' machine, not the report's.
    assert result["figures"]["throughput"]["dlm_110m_cudnn"]["tokens_per_s"] == 600_000
    assert result["figures"]["generate"]["batch_32"]["speedup"] == pytest.approx(6.0)
    assert result["figures"]["parts"]["core"] == {"rc": 124, "seconds": 200, "limit": 200}
    assert result["figures"]["matmul_bf16_tflops"] == 700.0
    assert result["machine"]["gpu"] == "NVIDIA H200" and result["rounds"]["records"] == records
    table = (tmp_path / "results.md").read_text()
    assert "NVIDIA H200" in table and "OutOfMemoryError()" in table and "| core | 124 | 200 | 200 |" in table
    assert "dlm-shakespeare-14M" not in table  # the step-time probes are not throughput rows


def test_slim_wheel_drops_members_and_their_record_lines(tmp_path: Path) -> None:
    slim_wheel = load_script("slim_wheel")
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    members = {
        "pkg/__init__.py": "",
        "pkg/lib_cuda118.so": "x" * 100,
        "pkg/lib_cuda130.so": "y",
        "pkg-1.0.dist-info/METADATA": "Name: pkg\n",
    }
    record = "".join(f"{name},sha256=0,1\n" for name in members) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**members, "pkg-1.0.dist-info/RECORD": record}.items():
            archive.writestr(name, text)
    assert slim_wheel.slim(wheel, r"lib_cuda11\d\.so$") == ["pkg/lib_cuda118.so"]
    with zipfile.ZipFile(wheel) as archive:
        assert "pkg/lib_cuda118.so" not in archive.namelist() and "pkg/lib_cuda130.so" in archive.namelist()
        assert "lib_cuda118" not in archive.read("pkg-1.0.dist-info/RECORD").decode()


def test_the_cpu_baseline_runs_alone_from_the_repository() -> None:
    # The plain-PyTorch baseline stays a script a person runs as it is (train-step imports its model).
    baseline = ROOT / "benchmarks" / "baselines" / "plain_cpu.py"
    output = subprocess.run(
        [sys.executable, str(baseline), "32", "1", "2", "16", "2", "64"], capture_output=True, text=True, check=True
    )
    match = re.search(r"params=\d+ tokens/s=(?P<tokens>[\d.]+) model_GFLOP/s=[\d.]+ step_s=[\d.]+", output.stdout)
    assert match is not None and float(match["tokens"]) > 0


def test_cli_table_at_80_columns_keeps_every_header_word_whole(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("dlm.cli.bench_cmd.wants_json", lambda flag: flag)  # the table, as on a terminal
    monkeypatch.setattr("dlm.cli.common.console.width", 80)
    missing = tmp_path / "a-long-temporary-directory-name" / "nope" / "train.bin"
    code, out, err = run_cli(
        capsys,
        "bench",
        "--config",
        str(TINY),
        "--set",
        f"training.train_data={missing}",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--batch-size",
        "2",
        "--device",
        "cpu",
    )
    assert code == 0, err
    assert "…" not in out and "tokens/s" in out and "batch" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "note: too narrow for attention" in out and "--json has every column" in out


def test_fit_columns_drops_the_least_useful_columns_first() -> None:
    from dlm.cli.bench_cmd import fit_columns

    headers = ["batch", "dtype", "compile", "tokens/s", "attention"]
    rows = [["2", "float32", "no", "1,234", "math"]]
    assert fit_columns(headers, rows, 200) == (headers, rows, [])
    kept, cells, left_out = fit_columns(headers, rows, 39)  # 40 fits once attention is out
    assert left_out == ["attention", "dtype"] and kept == ["batch", "compile", "tokens/s"]
    assert cells == [["2", "no", "1,234"]]


def test_interleaved_cpu_steps_time_every_run_each_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' shared timer: warm-up steps untimed, then one timed step of each run a round,
    the order rotating (the second run goes first in the second round)."""

    order: list[str] = []
    real = throughput.TrainingStep.optimizer_step

    def recorded(self: throughput.TrainingStep, *args: object) -> object:
        order.append(self.experiment.training.output_dir)
        return real(self, *args)

    monkeypatch.setattr(throughput.TrainingStep, "optimizer_step", recorded)
    runs = {name: (tiny(tmp_path, f"training.output_dir={tmp_path / name}"), "float32") for name in ("a", "b")}
    seconds = throughput.interleaved_cpu_step_seconds(runs, rounds=3, warmup=1)
    assert list(seconds) == ["a", "b"]
    assert all(len(values) == 3 and min(values) > 0 for values in seconds.values())
    a, b = (runs[name][0].training.output_dir for name in ("a", "b"))
    assert a != b
    assert order == [a, b, a, b, b, a, a, b]
