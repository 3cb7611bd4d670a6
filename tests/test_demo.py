"""`dlm demo`: the pipeline end to end with the tiny config, reuse of finished stages, the time
budget turned into a complete schedule, the CLI's JSON lines and terminal view."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlm.artifacts.events import CheckpointEvent, StartEvent, StreamEvent, TrainEvent
from dlm.artifacts.run_dir import BUDGET_PLAN_NAME as PLAN_NAME
from dlm.assets import shakespeare_files
from dlm.config.schema import load_config
from dlm.data.tokenizer import tokenizer_sha256
from dlm.demo.baseline import SpreadBlocks
from dlm.demo.run import DemoResult, bundled_config, demo_experiment, run_demo
from dlm.errors import UserError
from dlm.evaluation.sample_quality import corpus_words, sample_quality
from dlm.evaluation.unigram import unigram_bits_per_byte, unigram_verdict
from dlm.sampling.prompting import template_fixed_text
from dlm.train.budget import SCHEDULE_SHARE, latest_step, plan_schedule
from dlm.train.plan import TrainingPlan

ROOT = Path(__file__).resolve().parents[1]
HAS_MUON = hasattr(torch.optim, "Muon")  # torch 2.9 and later: the demo's CPU model trains with it
CPU_OPTIMIZER = "Muon" if HAS_MUON else "AdamW (this torch has no Muon)"
TINY_CONFIG = ROOT / "configs" / "tiny.toml"
MINUTES = 0.15  # 9 s of training (calibration included): enough for the whole tiny schedule
STAGES = ("tokenizer", "data", "validate", "calibrate", "train", "evaluate", "export", "samples")
REUSABLE = ("tokenizer", "data", "calibrate", "train", "evaluate", "export")
WATCHED_FILES = (
    "data/tokenizer.json",
    "data/train.bin",
    "data/val.json",
    "run/latest.pt",
    "run/eval.json",
    "model/model.safetensors",
    "model/config.json",
)


@dataclass
class DemoRun:
    output: Path
    result: DemoResult
    events: list[StreamEvent]


def demo_events(events: list[StreamEvent], kind: str) -> list[dict[str, Any]]:
    """The demo's own events of `kind` (the training events it passes on are typed, not dicts)."""

    return [event for event in events if isinstance(event, dict) and event["event"] == kind]


def stage_events(events: list[StreamEvent], status: str | None = None) -> dict[str, dict[str, Any]]:
    """The last event of each stage (with `status`, when given)."""

    found = {}
    for event in demo_events(events, "demo_stage"):
        if status is None or event["status"] == status:
            found[event["stage"]] = event
    return found


def mtimes(output: Path) -> dict[str, int]:
    return {name: (output / name).stat().st_mtime_ns for name in WATCHED_FILES}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One complete tiny demo, shared by the tests that only read it (copy it to change it)."""

    output = tmp_path_factory.mktemp("demo") / "demo"
    events: list[StreamEvent] = []
    with pytest.MonkeyPatch.context() as patch:
        # Planned to fill half the budget, not 0.9 of it: the schedule still completes when other
        # work slows the machine down after calibration (the view of a run cut short is tested below).
        patch.setattr("dlm.train.budget.SCHEDULE_SHARE", 0.5)
        result = run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG, sink=events.append)
    return DemoRun(output, result, events)


def copy_demo(demo_run: DemoRun, tmp_path: Path) -> Path:
    target = tmp_path / "demo"
    shutil.copytree(demo_run.output, target)
    return target


# ---------------------------------------------------------------------------------------- config


def test_bundled_config_is_configs_shakespeare_toml() -> None:
    # The installed package cannot read the repository's configs/, so the package holds the one copy
    # and configs/shakespeare.toml is a link to it.
    linked = ROOT / "configs" / "shakespeare.toml"
    assert linked.is_symlink() and linked.resolve() == (ROOT / "dlm" / "assets" / "shakespeare.toml").resolve()
    assert bundled_config().read_bytes() == linked.read_bytes()
    experiment = load_config(bundled_config())
    assert (experiment.model.vocab_size, experiment.model.max_seq_len) == (8192, 256)


# ---------------------------------------------------------------------------------------- planning


def test_a_fresh_plan_fits_its_schedule_and_validations_in_the_budget() -> None:
    base = load_config(bundled_config())
    fields = plan_schedule(budget_seconds=600, spent_seconds=20, seconds_per_step=2.0, base=base, validation_steps=3)
    assert isinstance(fields, dict)
    steps = fields["max_steps"]
    validations = steps // fields["eval_interval"]
    assert validations >= 4
    assert steps * 2.0 + validations * 3 * 2.0 <= (600 - 20) * SCHEDULE_SHARE
    assert steps * 2.0 >= (600 - 20) * SCHEDULE_SHARE * 0.9  # and it does not waste the budget
    # The config's 200 warmup steps of 20000 are scaled down, to a tenth of this short run.
    assert fields["warmup_steps"] == steps // 10
    assert fields["save_interval"] <= steps // 4 and 1 <= fields["log_interval"] <= base.training.log_interval


def test_a_long_plan_keeps_the_config_intervals_and_its_warmup_share() -> None:
    base = load_config(bundled_config())
    fields = plan_schedule(budget_seconds=600, spent_seconds=0, seconds_per_step=1 / 64, base=base)
    assert isinstance(fields, dict)
    assert fields["max_steps"] == int(600 * SCHEDULE_SHARE * 64)  # 34560: a GPU's pace
    assert fields["warmup_steps"] == round(fields["max_steps"] * 200 / 20000)
    assert (fields["eval_interval"], fields["save_interval"]) == (500, 1000)


def test_a_continued_plan_starts_at_the_step_and_keeps_its_warmup() -> None:
    base = load_config(TINY_CONFIG)
    fields = plan_schedule(
        budget_seconds=100, spent_seconds=50, seconds_per_step=1.0, base=base, start_step=40, warmup_steps=7
    )
    assert fields == {
        "max_steps": 40 + 45,
        "warmup_steps": 7,
        "eval_interval": 11,
        "save_interval": 11,
        "log_interval": 1,
    }


def test_a_budget_too_short_for_a_schedule_plans_nothing() -> None:
    base = load_config(TINY_CONFIG)
    assert plan_schedule(budget_seconds=10, spent_seconds=9, seconds_per_step=0.6, base=base) == 1
    assert plan_schedule(budget_seconds=10, spent_seconds=12, seconds_per_step=0.1, base=base, start_step=5) == 0


def test_unigram_bits_per_byte_of_a_uniform_corpus(tmp_path: Path) -> None:
    # Four tokens equally often: 2 bits per token; 2 bytes of text per token: 1 bit per byte.
    two_bytes_each = np.full(4, 2)
    tokens = np.tile(np.arange(4, dtype="<u2"), 64)
    metadata = dict(
        format="dlm-packed-v1",
        vocab_size=4,
        tokenizer_sha256="0" * 64,
        seq_len=8,
        dtype="uint16",
        num_blocks=32,
        num_tokens=256,
        dropped_tokens=0,
        text_bytes=512,
    )
    for split in ("train", "val"):
        tokens.tofile(tmp_path / f"{split}.bin")
        (tmp_path / f"{split}.json").write_text(json.dumps(metadata))
    assert unigram_bits_per_byte(tmp_path, blocks=range(10), token_bytes=two_bytes_each) == pytest.approx(1.0)
    assert unigram_bits_per_byte(tmp_path, blocks=range(10)) is None  # no tokenizer.json: no byte count


def test_spread_blocks_cover_the_whole_split_in_order() -> None:
    class Split:
        def __init__(self) -> None:
            self.metadata = {"text_bytes": 1}

        def __len__(self) -> int:
            return 100

        def __getitem__(self, index: int) -> int:
            return index * 10

    spread = SpreadBlocks(Split(), 5)
    assert spread.indices == [0, 25, 50, 74, 99] and spread.metadata == {"text_bytes": 1}
    assert [spread[i] for i in range(len(spread))] == [0, 250, 500, 740, 990]
    assert SpreadBlocks(Split(), 500).indices == list(range(100))  # never more blocks than the split


# ---------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_the_tiny_demo_trains_evaluates_exports_and_samples(demo_run: DemoRun) -> None:
    result, output, events = demo_run.result, demo_run.output, demo_run.events
    assert result.status == "complete" and result.exit_code == 0
    assert result.stages == dict.fromkeys(STAGES, "done")
    running = stage_events(events, "running")
    assert set(running) == set(STAGES)  # every stage announced itself before its work
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
        assert (output / "model" / name).is_file(), name
    assert result.model_dir == output / "model"
    # The training loop's own events reached the sink, and the schedule ran to its end.
    plan = TrainingPlan.load(output / "run")
    assert plan is not None and plan.budget_seconds == MINUTES * 60
    assert stage_events(events, "done")["train"]["outcome"] == "complete"
    assert result.step == plan.max_steps == latest_step(output / "run")
    last_train = [event for event in events if isinstance(event, TrainEvent)][-1]
    tiny = load_config(TINY_CONFIG).training
    assert last_train.step == plan.max_steps
    assert last_train.learning_rate == pytest.approx(tiny.min_learning_rate)  # the cosine reached its floor
    assert stage_events(events, "done")["train"]["learning_rate"] == last_train.learning_rate
    # One `train` call, its schedule re-fitted on the clock to the pace it kept.
    replans = demo_events(events, "demo_replan")
    assert replans and len([event for event in events if isinstance(event, StartEvent)]) == 1
    assert all(replan["max_steps"] > replan["step"] for replan in replans)
    run_config = json.loads((output / "run" / "config.json").read_text())
    assert run_config["training"]["max_steps"] == plan.max_steps
    assert run_config["training"]["warmup_steps"] == plan.warmup_steps < plan.max_steps
    # Evaluation: bits per byte beside the unigram baseline of the same validation blocks.
    report = json.loads((output / "run" / "eval.json").read_text())
    assert report["context"]["step"] == result.step
    assert result.bits_per_byte == report["bits_per_byte"] and 0 < result.bits_per_byte < 16
    assert result.unigram_bits_per_byte == report["context"]["unigram_bits_per_byte"] > 0
    assert (output / "model" / "tokenizer.json").read_bytes() == (output / "data" / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_the_samples_keep_their_prompt_and_template(demo_run: DemoRun) -> None:
    samples = {sample["label"]: sample for sample in demo_run.result.samples}
    assert set(samples) == {"unconditional", "prompt", "infill"}
    assert demo_run.result.sample_length == 48  # 3/4 of the tiny model's 64-token context
    assert samples["prompt"]["text"].startswith("ROMEO:")
    assert samples["infill"]["text"].startswith("ROMEO: ") and samples["infill"]["text"].endswith(" fair Verona")
    assert all("<|mask|>" not in sample["text"] for sample in samples.values())
    assert len(samples["unconditional"]["text"]) > 0
    written = json.loads((demo_run.output / "samples.json").read_text())
    assert [sample["text"] for sample in written] == [sample["text"] for sample in demo_run.result.samples]
    assert [e["label"] for e in demo_events(demo_run.events, "demo_sample")] == list(samples)
    # The words each sample wrote, scored against the training plays; pooled on the result.
    vocabulary = corpus_words(shakespeare_files("train")).vocabulary
    for sample, saved in zip(demo_run.result.samples, written, strict=True):
        fixed = sample["prompt"] if sample["template"] is None else template_fixed_text(sample["template"])
        generated = 16 if sample["label"] == "infill" else 48
        expected = sample_quality(sample["text"], fixed, generated, vocabulary).to_dict()
        assert sample["quality"] == saved["quality"] == expected
    pooled_words = sum(sample["quality"]["words"] for sample in written)
    quality = demo_run.result.sample_quality
    assert quality["words"] == pooled_words and quality["generated_tokens"] == 48 + 48 + 16
    assert 0.3 < quality["held_out_words_per_token"] < 0.9  # real text: about one word in two tokens


@pytest.mark.slow
def test_a_second_run_reuses_every_finished_stage(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)
    before = mtimes(output)
    events: list[StreamEvent] = []
    result = run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG, sink=events.append)
    assert result.status == "complete"
    reused = stage_events(events, "reused")
    assert set(reused) == set(REUSABLE)
    assert not set(stage_events(events, "running")) & set(REUSABLE)
    assert mtimes(output) == before  # nothing was written again
    assert not [event for event in events if isinstance(event, StartEvent | TrainEvent | CheckpointEvent)]
    assert result.step == demo_run.result.step and result.bits_per_byte == demo_run.result.bits_per_byte
    # Samples are drawn again, with the same seeds: the same texts.
    assert [s["text"] for s in result.samples] == [s["text"] for s in demo_run.result.samples]


@pytest.mark.slow
def test_a_demo_run_planned_before_the_neutral_plan_name_is_still_reused(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)
    plan_path = output / "run" / PLAN_NAME
    earlier = json.loads(plan_path.read_text()) | {"format": "dlm-demo-plan-v1"}
    (output / "run" / "demo-plan.json").write_text(json.dumps(earlier))
    plan_path.unlink()
    events: list[StreamEvent] = []
    result = run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG, sink=events.append)
    assert set(stage_events(events, "reused")) == set(REUSABLE)
    assert result.step == demo_run.result.step and not plan_path.exists()  # reused as it was: nothing written


@pytest.mark.slow
def test_a_larger_budget_continues_training_from_latest(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)  # a copy: latest.pt is no hard link now, so its step is read
    events: list[StreamEvent] = []
    result = run_demo(output, minutes=2 * MINUTES, config_path=TINY_CONFIG, sink=events.append)
    stages = stage_events(events)
    assert stages["tokenizer"]["status"] == stages["data"]["status"] == stages["calibrate"]["status"] == "reused"
    assert stages["train"]["status"] == stages["evaluate"]["status"] == stages["export"]["status"] == "done"
    first_start = next(event for event in events if isinstance(event, StartEvent))
    assert first_start.start_step == demo_run.result.step and first_start.resumed_from is not None
    assert result.step > demo_run.result.step
    assert any("warm restart" in event["message"] for event in demo_events(events, "demo_note"))
    plan = TrainingPlan.load(output / "run")
    assert plan is not None and plan.budget_seconds == 2 * MINUTES * 60 and plan.max_steps >= result.step
    assert json.loads((output / "model" / "config.json").read_text())["step"] == result.step


# ---------------------------------------------------------------------------------------- refusals


def test_a_non_positive_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--minutes"):
        run_demo(tmp_path / "demo", minutes=0, config_path=TINY_CONFIG)


def test_a_demo_directory_with_another_tokenizer_is_refused(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    (tmp_path / "demo" / "data").mkdir(parents=True)
    shutil.copy(tiny_tokenizer_path, tmp_path / "demo" / "data" / "tokenizer.json")  # 512 tokens, config: 8192
    with pytest.raises(UserError, match="512-token tokenizer, the config asks for 8192"):
        run_demo(tmp_path / "demo", device="cpu")


@pytest.mark.slow
def test_a_run_the_demo_did_not_plan_is_refused(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)
    (output / "run" / PLAN_NAME).unlink()
    with pytest.raises(UserError, match="did not plan"):
        run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG)


@pytest.mark.slow
def test_a_run_of_another_model_is_refused_before_its_data_is_touched(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)
    before = mtimes(output)
    # The bundled config on the CPU: the same tokenizer file name, another model and block length.
    with pytest.raises(UserError, match="holds a run of another model"):
        run_demo(output, device="cpu")
    assert mtimes(output) == before


@pytest.mark.slow
def test_a_budget_too_short_for_two_steps_is_refused_with_the_minutes_needed(demo_run: DemoRun, tmp_path: Path) -> None:
    output = copy_demo(demo_run, tmp_path)
    shutil.rmtree(output / "run")
    with pytest.raises(UserError, match=r"leaves time for \d training steps .*pass --minutes"):
        run_demo(output, minutes=0.0005, config_path=TINY_CONFIG)
    assert tokenizer_sha256(output / "data" / "tokenizer.json")  # the finished stages are still there


# ---------------------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_the_cli_prints_json_lines_and_exits_0(demo_run: DemoRun, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    output = copy_demo(demo_run, tmp_path)
    cli = run_cli("demo", "--output", output, "--minutes", str(MINUTES), "--config", TINY_CONFIG, "--json")
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    assert events[0]["event"] == "demo_start" and events[-1]["event"] == "demo_done"
    assert set(stage_events(events, "reused")) == set(REUSABLE)
    assert events[-1]["bits_per_byte"] == demo_run.result.bits_per_byte


@pytest.mark.slow
def test_the_terminal_view_renders_every_event(demo_run: DemoRun, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from dlm.cli import demo_view

    recorder = Console(record=True, width=120, force_terminal=True)
    monkeypatch.setattr(demo_view, "console", recorder)
    view = demo_view.DemoView()
    reused = [{**event, "status": "reused"} for event in stage_events(demo_run.events, "done").values()]
    cut_short = {**stage_events(demo_run.events, "done")["train"], "outcome": "paused", "learning_rate": 1.25e-4}
    try:
        for event in [*demo_run.events, *reused, cut_short]:
            view(event)
    finally:
        view.close()
    text = recorder.export_text()
    for stage in STAGES:
        assert f"✓ {stage}" in text and f"↺ {stage}" in text, stage
    assert "bits per byte (unigram baseline" in text and "fair Verona" in text
    assert "(the budget ran out first), final learning rate 1.25e-04 (floor 3.00e-04)" in text
    assert "dlm train" in text  # the training dashboard's panel


def test_unigram_verdict_names_the_level_and_what_to_do() -> None:
    assert unigram_verdict(2.70, 2.97) is None and unigram_verdict(None, 2.97) is None
    for bits in (2.96, 2.985, 3.4):  # within 0.02 of the unigram level, or above it
        verdict = unigram_verdict(bits, 2.976)
        assert verdict is not None and f"{bits:.3f} bits per byte against 2.976" in verdict
        assert "longer" in verdict and "GPU" in verdict and "smaller model" in verdict and "data" in verdict


@pytest.mark.slow
def test_the_view_keeps_one_clock_a_rising_percentage_and_no_pause_across_replans(demo_run: DemoRun) -> None:
    import io
    import re

    from rich.console import Console

    from dlm.cli import demo_view

    assert demo_events(demo_run.events, "demo_replan")  # the real sequence holds re-fits
    view, frames = demo_view.DemoView(), []
    try:
        for event in demo_run.events:
            view(event)
            if view.dashboard is not None:
                output = io.StringIO()
                Console(file=output, width=80, force_terminal=True, color_system=None).print(view.dashboard.render())
                frames.append(output.getvalue())
    finally:
        view.close()
    shown = [float(re.findall(r"(\d+\.\d)%", text)[0]) for text in frames]
    clocks = [re.findall(r"(\d:\d\d:\d\d) of 0:00:09", text)[0] for text in frames]
    assert shown == sorted(shown) and clocks == sorted(clocks)
    assert all("status paused" not in text.replace("│", " ") for text in frames)


@pytest.mark.slow
def test_the_cli_warns_at_the_unigram_level_and_lists_the_samples_at_80_columns(
    demo_run: DemoRun, tmp_path: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, narrow_console: int
) -> None:
    monkeypatch.setattr("dlm.cli.common.wants_json", lambda flag: False)
    output = copy_demo(demo_run, tmp_path / "a-demo-directory-whose-name-alone-fills-most-of-an-80-column-line")
    assert len(str(output)) > narrow_console
    report_path = output / "run" / "eval.json"
    report = json.loads(report_path.read_text())
    report["bits_per_byte"] = report["context"]["unigram_bits_per_byte"] + 0.01  # the evaluation is reused as written
    report_path.write_text(json.dumps(report))
    cli = run_cli("demo", "--output", output, "--minutes", str(MINUTES), "--config", TINY_CONFIG)
    assert cli.exit_code == 0, cli.stderr
    assert "warning: the model ends at the unigram level" in cli.stdout
    lines = cli.stdout.splitlines()
    # Not a terminal: plain lines, each label followed by its sample's text.
    for label in ("unconditional: no prompt", "prompt: ROMEO:", "infill: ROMEO: [MASK*16] fair Verona"):
        assert label in lines, label
    assert lines[lines.index("prompt: ROMEO:") + 1].startswith("ROMEO:")


def test_the_samples_sit_side_by_side_on_a_terminal() -> None:
    from rich.console import Console

    from dlm.cli.demo_view import samples_renderable

    samples = [
        {"label": "unconditional", "prompt": "", "template": None, "text": "alpha " * 12},
        {"label": "prompt", "prompt": "ROMEO:", "template": None, "text": "ROMEO: beta " * 6},
        {"label": "infill", "prompt": "", "template": "A [MASK*2] B", "text": "A gamma B"},
    ]
    console = Console(width=80, force_terminal=True, color_system=None, record=True)
    console.print(samples_renderable(samples, terminal=True))
    text = console.export_text()
    assert "unconditional: no prompt" in text and "prompt: ROMEO:" in text and "infill: A [MASK*2] B" in text
    first = next(line for line in text.splitlines() if "alpha" in line)
    assert "beta" in first and "gamma" in first  # one row: the three texts next to each other
    assert max(len(line) for line in text.splitlines()) <= 80


def test_the_demos_cpu_model_is_the_cpu_recipe(tmp_path: Path) -> None:
    """configs/cpu.toml ships what the demo trains on a CPU: one recipe, measured once."""

    demo, notes = demo_experiment(tmp_path / "demo", None, "cpu")
    recipe = load_config(ROOT / "configs" / "cpu.toml")
    assert demo.model == recipe.model and demo.diffusion == recipe.diffusion
    names = ("min_learning_rate", "weight_decay", "grad_clip", "clip_mask_min", "clip_mask_max")
    for name in names:
        assert getattr(demo.training, name) == getattr(recipe.training, name), name
    assert recipe.training.optimizer == "muon" and demo.training.optimizer == ("muon" if HAS_MUON else "adamw")
    assert recipe.training.learning_rate == 4e-3 and demo.training.learning_rate == (4e-3 if HAS_MUON else 2e-3)
    assert recipe.training.batch_size == 64 and demo.training.batch_size == (64 if HAS_MUON else 32)
    assert "mask probabilities 0.3-0.8 in training" in notes[0] and f", {CPU_OPTIMIZER} (configs/cpu.toml)" in notes[0]


def test_the_demo_takes_adamw_on_a_torch_without_muon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    demo, notes = demo_experiment(tmp_path / "demo", None, "cpu")
    assert demo.training.optimizer == "adamw" and ", AdamW (this torch has no Muon) (configs/cpu.toml)" in notes[0]
    assert demo.training.learning_rate == 2e-3  # AdamW's measured rate and batch, not Muon's 4e-3 and 64
    assert demo.training.batch_size == 32 and "batch 32" in notes[0]


@pytest.mark.parametrize("native", [True, False])
def test_the_demo_takes_bfloat16_where_the_cpu_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """bfloat16 autocast (the recipe's precision) only on a CPU that multiplies it natively."""

    from dlm.runtime import device

    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: native)
    demo, notes = demo_experiment(tmp_path / "demo", None, "cpu")
    expected = "bfloat16" if native else "float32"
    assert f", {expected}, {CPU_OPTIMIZER} (configs/cpu.toml)" in notes[0]
    assert demo.training.precision == "auto" == load_config(ROOT / "configs" / "cpu.toml").training.precision
    assert device.resolve_training_precision(demo.training.precision, torch.device("cpu")) == expected


def test_distill_minutes_distils_the_model_and_shows_both_samples(
    demo_run: DemoRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from dlm.cli import demo_view

    output = copy_demo(demo_run, tmp_path)
    events: list[StreamEvent] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dlm.distill.budget.BUDGET_SHARE", 0.4)  # ends in time on a loaded machine too
        result = run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG, sink=events.append, distill_minutes=0.15)
    assert stage_events(events, "done")["distill"]["path"] == str(output / "student")
    comparison = result.comparison
    assert comparison is not None
    assert comparison["teacher"]["steps"] == result.sample_length and comparison["student"]["steps"] == 8
    assert comparison["student"]["forward_passes"] <= 8 < comparison["teacher"]["forward_passes"]
    record = json.loads((output / "student" / "config.json").read_text())["distillation"]
    assert record["remasking"] == "dilated"  # the order whose 8 passes keep the quality (docs/distill.md)
    assert [e for e in events if isinstance(e, dict) and e.get("event") == "demo_compare"] == [
        {"event": "demo_compare", **comparison}
    ]
    again: list[StreamEvent] = []
    second = run_demo(output, minutes=MINUTES, config_path=TINY_CONFIG, sink=again.append, distill_minutes=0.15)
    assert "distill" in stage_events(again, "reused") and second.comparison is not None
    for side in ("teacher", "student"):  # the same seed: the same texts
        assert second.comparison[side]["text"] == comparison[side]["text"]
    recorder = Console(record=True, width=100, force_terminal=True)
    monkeypatch.setattr(demo_view, "console", recorder)
    view = demo_view.DemoView()
    try:
        for event in events:
            view(event)
    finally:
        view.close()
    text = recorder.export_text()
    assert "teacher: " in text and "student: 8 steps" in text and "✓ distill" in text
