"""Noise schedules: their mathematics, the registry, and `[diffusion]` from config to training, eval and sampling."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import warnings
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from helpers import ROOT, tiny_experiment
from rich.console import Console

import dlm
import dlm.diffusion.schedules as schedule_module
from dlm.artifacts.checkpoint import LATEST_NAME, load_checkpoint
from dlm.artifacts.checksum import with_checksum
from dlm.artifacts.events import Event, StartEvent, TrainEvent, ValidationEvent
from dlm.artifacts.export import export_model
from dlm.artifacts.loading import load_model_with_info
from dlm.artifacts.run_dir import load_run
from dlm.cli.dashboard import TrainingDashboard
from dlm.config.schema import ExperimentConfig, MovedFieldNote, load_config
from dlm.data.dataset import load_packed_dataset
from dlm.diffusion.objective import corrupt_tokens, elbo_nll, truncation_factor
from dlm.diffusion.schedules import (
    NOISE_BUCKETS,
    CosineSchedule,
    LinearSchedule,
    Schedule,
    get_schedule,
    model_schedule,
    register_schedule,
    schedule_names,
)
from dlm.errors import UserError
from dlm.evaluation.evaluate import evaluate_model, evaluate_source
from dlm.sampling.reverse import reveal_count
from dlm.train.loop import train

VOCAB, MASK_ID, EPS = 50, 1, 1e-3
SCHEDULES = ("linear", "cosine")


# ------------------------------------------------------------------------------- the mathematics


def test_linear_masks_with_probability_t_and_weighs_by_one_over_t() -> None:
    linear = get_schedule("linear")
    t = torch.tensor([EPS, 0.25, 0.5, 1.0])
    assert linear.mask_probability(t) is t  # the drawn time itself: masks stay exactly today's
    assert torch.equal(linear.loss_weight(t), 1 / t)
    assert torch.equal(linear.alpha(t), 1 - t)
    assert linear.mask_probability(0.3) == 0.3 and linear.loss_weight(0.25) == 4.0
    assert truncation_factor(linear, EPS) == 1.0  # so training's weights are exactly 1 / t


@pytest.mark.parametrize(
    ("t", "mask_probability", "weight"),
    [
        # m = 1 - cos(πt/2); w = (π/2) sin(πt/2) / m, worked out by hand.
        (1 / 3, 1 - math.sqrt(3) / 2, (math.pi / 4) / (1 - math.sqrt(3) / 2)),
        (0.5, 1 - math.sqrt(2) / 2, (math.pi / 2) * (math.sqrt(2) / 2) / (1 - math.sqrt(2) / 2)),
        (1.0, 1.0, math.pi / 2),
    ],
)
def test_cosine_values_by_hand(t: float, mask_probability: float, weight: float) -> None:
    cosine = get_schedule("cosine")
    assert cosine.mask_probability(t) == pytest.approx(mask_probability, rel=1e-12)
    assert cosine.alpha(t) == pytest.approx(math.cos(math.pi * t / 2), abs=1e-15)
    assert cosine.loss_weight(t) == pytest.approx(weight, rel=1e-12)
    as_tensor = cosine.loss_weight(torch.tensor([t], dtype=torch.float64))
    assert as_tensor.item() == pytest.approx(weight, rel=1e-12)


def test_cosine_keeps_its_precision_near_zero() -> None:
    # 1 - cos(x) in float32 would be 0 or off by tens of percent at t = eps; 2 sin²(x / 2) is not.
    cosine = get_schedule("cosine")
    small = cosine.mask_probability(torch.tensor([EPS], dtype=torch.float32)).item()
    assert small == pytest.approx(2 * math.sin(math.pi * EPS / 4) ** 2, rel=1e-6)


@pytest.mark.parametrize("name", SCHEDULES)
def test_reveal_probability_is_the_alpha_formula(name: str) -> None:
    schedule = get_schedule(name)
    for s, t in ((Fraction(0), Fraction(1, 7)), (Fraction(2, 7), Fraction(3, 7)), (Fraction(5, 6), Fraction(1))):
        alpha_s, alpha_t = 1 - schedule.mask_probability(float(s)), 1 - schedule.mask_probability(float(t))
        expected = (alpha_s - alpha_t) / (1 - alpha_t)
        assert float(schedule.reveal_probability(s, t)) == pytest.approx(expected, rel=1e-12)
    # The last step reveals everything that is left.
    assert schedule.reveal_probability(Fraction(0), Fraction(1, 9)) == 1
    # Linear stays exact on the sampler's grid: 1 / p is the number of steps left.
    if name == "linear":
        assert schedule.reveal_probability(Fraction(3, 10), Fraction(4, 10)) == Fraction(1, 4)


@pytest.mark.parametrize("name", SCHEDULES)
def test_uniform_model_elbo_is_log_vocab(name: str) -> None:
    schedule = get_schedule(name)
    # Exactly in expectation: with M ~ Binomial(L, m(t)) masked tokens, E[loss] = log V times the mean
    # of c m'(t) over t ~ U[eps, 1], which the truncation factor c makes exactly 1 (midpoint rule).
    t = EPS + (1 - EPS) * (torch.arange(1_000_000, dtype=torch.float64) + 0.5) / 1_000_000
    mean_weighted_rate = (schedule.mask_rate(t) * truncation_factor(schedule, EPS)).mean().item()
    assert mean_weighted_rate == pytest.approx(1.0, abs=1e-9)
    # And the antithetic Monte Carlo estimator agrees within a tight standard error.
    clean = torch.randint(VOCAB, (256, 64), generator=torch.Generator().manual_seed(4))

    def uniform(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(int(mask.sum()), VOCAB)

    nll, _ = elbo_nll(uniform, clean, MASK_ID, 32, EPS, torch.Generator().manual_seed(5), schedule=schedule)
    # The sequences are independent: their spread gives the error of the mean (the per-sequence
    # error treats the antithetic times as independent, far too loosely for cosine's varying weight).
    error = (nll.std() / math.sqrt(nll.numel())).item()
    assert error < 0.005 * math.log(VOCAB)
    assert abs(nll.mean().item() - math.log(VOCAB)) < 5 * error


def test_corruption_masks_at_the_schedules_probability() -> None:
    cosine = get_schedule("cosine")
    clean = torch.randint(2, VOCAB, (2, 40_000), generator=torch.Generator().manual_seed(2))
    times = torch.tensor([0.5, 0.9])
    corruption = corrupt_tokens(clean, MASK_ID, times, EPS, torch.Generator().manual_seed(3), schedule=cosine)
    assert torch.equal(corruption.time, times)
    expected = cosine.mask_probability(times)
    assert torch.equal(corruption.mask_probability, expected)
    for rate, m in zip(corruption.mask.float().mean(dim=1).tolist(), expected.tolist(), strict=True):
        assert abs(rate - m) < 5 * math.sqrt(m * (1 - m) / 40_000)


@pytest.mark.parametrize("name", SCHEDULES)
def test_reveal_counts_follow_the_schedule(name: str) -> None:
    schedule = get_schedule(name)
    for n in (1, 5, 24, 64):
        for steps in (1, 3, 6, 50):
            counts = [reveal_count(n, steps, step, schedule) for step in range(steps)]
            assert sum(counts) == n and min(counts) >= 0
            masked = n
            for step, count in enumerate(counts):
                masked -= count
                s = Fraction(steps - step - 1, steps)
                # floor(n m(s)) positions stay masked at time s, m from the α of each schedule.
                alpha = 1 - s if name == "linear" else math.cos(math.pi * s / 2)
                assert masked == math.floor(n * (1 - alpha) + Fraction(1, 10**9))
    # 24 positions in 6 steps: the cosine plan keeps fewer masked than linear's 20, 16, 12, 8, 4, 0.
    assert [reveal_count(24, 6, step, get_schedule("cosine")) for step in range(6)] == [7, 5, 5, 4, 3, 0]


# ------------------------------------------------------------------------------- the registry


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the registry, so schedules registered by a test leave with it."""

    monkeypatch.setattr(schedule_module, "_SCHEDULES", schedule_module._SCHEDULES.copy())


def test_registry_names_builds_and_refuses() -> None:
    assert schedule_names()[:2] == SCHEDULES
    assert get_schedule("cosine") == CosineSchedule() and isinstance(get_schedule("linear"), LinearSchedule)
    with pytest.raises(UserError, match=r"unknown noise schedule 'sqrt'.*linear, cosine"):
        get_schedule("sqrt")
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("linear")(CosineSchedule)
    with pytest.raises(TypeError):
        register_schedule("not-a-schedule")(int)  # type: ignore[type-var]


def test_models_default_to_linear_and_keep_an_attached_schedule() -> None:
    model = torch.nn.Linear(2, 2)
    assert model_schedule(model) == LinearSchedule()
    schedule_module.attach_schedule(model, "cosine")
    assert model_schedule(model) == CosineSchedule()
    assert model.state_dict().keys() == {"weight", "bias"}  # not a tensor: checkpoints are unchanged


def settings(*extra: str) -> tuple[str, ...]:
    steps = ("max_steps=2", "warmup_steps=1", "log_interval=1", "save_interval=2", "eval_interval=2")
    return (*(f"training.{step}" for step in steps), *extra)


def first_loss(events: list[Event]) -> float:
    loss = next(event.loss for event in events if isinstance(event, TrainEvent))
    assert loss is not None
    return loss


def test_a_schedule_registered_outside_the_library_trains(registry: None, tiny_data_dir: Path, tmp_path: Path) -> None:
    @register_schedule("quadratic")
    class QuadraticSchedule(Schedule):
        """α(t) = 1 - t²."""

        times_seen: ClassVar[list[torch.Tensor]] = []

        def mask_probability(self, t):  # type: ignore[no-untyped-def]
            if isinstance(t, torch.Tensor):
                QuadraticSchedule.times_seen.append(t.detach().clone())
            return t * t

        def mask_rate(self, t):  # type: ignore[no-untyped-def]
            return 2 * t

    events: list[Event] = []
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "toy", *settings("diffusion.schedule=quadratic"))
    assert train(experiment, sink=events.append).status == "complete"
    assert math.isfinite(first_loss(events))
    # Training and validation handed their times (batches of 8, in [eps, 1]) to the toy schedule.
    training_times = [t for t in QuadraticSchedule.times_seen if t.shape == (8,)]
    assert training_times and all(bool(((t >= EPS) & (t <= 1)).all()) for t in training_times)
    linear_events: list[Event] = []
    train(tiny_experiment(tiny_data_dir, tmp_path / "linear", *settings()), sink=linear_events.append)
    assert first_loss(events) != first_loss(linear_events)  # same weights, data and draws: other masks


# ------------------------------------------------------------------------------- [diffusion] in configs


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_old_training_mask_eps_loads_with_a_note_as_the_diffusion_field(tmp_path: Path) -> None:
    new = load_config(write(tmp_path / "new.toml", "[diffusion]\nmask_eps = 0.01\n"))
    with pytest.warns(MovedFieldNote, match=r"move training\.mask_eps to \[diffusion\] mask_eps"):
        old = load_config(write(tmp_path / "old.toml", "[training]\nmask_eps = 0.01\n"))
    assert old == new and old.diffusion.mask_eps == 0.01
    with pytest.warns(MovedFieldNote) as notes:  # the file's note, then the override's
        overridden = load_config(tmp_path / "old.toml", ["training.mask_eps=0.02"])
    assert "--set training.mask_eps has moved: use --set diffusion.mask_eps=0.02" in [str(n.message) for n in notes]
    assert overridden.diffusion.mask_eps == 0.02
    with pytest.warns(MovedFieldNote):
        assert load_config(tmp_path / "old.toml", ["diffusion.mask_eps=0.03"]).diffusion.mask_eps == 0.03
    both = write(tmp_path / "both.toml", "[training]\nmask_eps = 0.01\n[diffusion]\nmask_eps = 0.02\n")
    with pytest.raises(UserError, match=r"training\.mask_eps: is set as well as diffusion\.mask_eps"):
        load_config(both)
    # A run directory's config.json (and a checkpoint's config) is dlm's own file: read silently.
    stored = new.to_dict()
    stored["training"]["mask_eps"] = stored.pop("diffusion")["mask_eps"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(write(tmp_path / "config.json", json.dumps(stored))) == new
        assert ExperimentConfig.from_dict(stored) == new


def test_the_cli_prints_the_move_once(tmp_path: Path, run_cli, narrow_console: int) -> None:
    old = write(tmp_path / "old.toml", "[training]\nmask_eps = 0.01\n")
    result = run_cli("config", "show", old, "--json")
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert notes == [f"warning: {old}: move training.mask_eps to [diffusion] mask_eps (the old place is deprecated)"]
    assert json.loads(result.stdout)["diffusion"] == {"schedule": "linear", "mask_eps": 0.01}


def test_cosine_config_loads_and_unknown_schedules_are_named(tmp_path: Path) -> None:
    experiment = load_config(ROOT / "configs" / "tiny.toml", ["diffusion.schedule=cosine"])
    assert experiment.diffusion.schedule == "cosine"
    with pytest.raises(UserError, match=r"diffusion\.schedule: 'sqrt' is not a registered noise schedule"):
        load_config(ROOT / "configs" / "tiny.toml", ["diffusion.schedule=sqrt"])


def old_layout(config: dict) -> dict:
    """A config as dlm wrote it before `[diffusion]`: mask_eps under training, no diffusion section."""

    config = json.loads(json.dumps(config))
    config["training"]["mask_eps"] = config.pop("diffusion")["mask_eps"]
    return config


def test_an_old_run_directory_resumes_bit_identically(tiny_data_dir: Path, tmp_path: Path) -> None:
    names = ("max_steps=6", "warmup_steps=1", "log_interval=1", "save_interval=100", "eval_interval=3")
    steps = tuple(f"training.{name}" for name in names)
    straight: list[Event] = []
    done = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *steps), sink=straight.append)
    run = tmp_path / "old"
    first: list[Event] = []
    paused = train(tiny_experiment(tiny_data_dir, run, *steps), max_run_steps=3, sink=first.append)
    # Rewrite the run as an older dlm left it: config.json and the checkpoint without [diffusion].
    (run / "config.json").write_text(json.dumps(old_layout(json.loads((run / "config.json").read_text()))))
    checkpoint = load_checkpoint(paused.checkpoint)
    checkpoint["config"] = old_layout(checkpoint["config"])
    torch.save(with_checksum(checkpoint), paused.checkpoint)
    experiment, source = load_run(run)
    assert source.name == LATEST_NAME and experiment.diffusion.mask_eps == EPS
    second: list[Event] = []
    resumed = train(experiment, resume=source, sink=second.append)

    def losses(events: list[Event]) -> list[float | None]:
        return [event.loss for event in events if isinstance(event, TrainEvent | ValidationEvent)]

    assert losses(first + second) == losses(straight)
    ours, theirs = load_checkpoint(resumed.checkpoint)["model"], load_checkpoint(done.checkpoint)["model"]
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


# ------------------------------------------------------------------------------- cosine end to end


@pytest.fixture(scope="module")
def cosine_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("cosine") / "run"
    train(tiny_experiment(tiny_data_dir, run, *settings("diffusion.schedule=cosine")))
    return run


def test_cosine_run_validates_and_evaluates_with_cosine(cosine_run: Path, tiny_data_dir: Path) -> None:
    report = evaluate_source(cosine_run, mc_samples=2)
    assert report.schedule == "cosine" and math.isfinite(report.nll) and report.bits_per_byte is not None
    events = [json.loads(line) for line in (cosine_run / "metrics.jsonl").read_text().splitlines()]
    validation = next(event for event in events if event["event"] == "validation")
    # The training loop validated with the run's schedule: `dlm eval` repeats its figure exactly.
    assert report.fixed_noise_loss == validation["loss"]
    loaded = load_model_with_info(cosine_run)
    assert loaded.info.diffusion.schedule == "cosine"
    data = load_packed_dataset(tiny_data_dir / "val.bin", 64)
    as_linear = evaluate_model(loaded.model, data, batches=2, batch_size=8, mc_samples=2, schedule="linear")
    assert as_linear.fixed_noise_loss != validation["loss"]


def test_an_exported_cosine_model_samples_with_cosine(cosine_run: Path, tmp_path: Path) -> None:
    exported = export_model(cosine_run, tmp_path / "model", dtype="float32")
    assert json.loads((exported / "config.json").read_text())["diffusion"] == {"schedule": "cosine", "mask_eps": EPS}
    assert "cosine noise schedule" in (exported / "README.md").read_text()
    model, tokenizer = dlm.load(exported)
    assert model_schedule(model) == CosineSchedule()
    masked_per_step: list[int] = []

    def count(step: int, tokens: torch.Tensor) -> None:
        masked_per_step.append(int((tokens[0] == model.config.mask_token_id).sum()))

    result = dlm.sample(model, tokenizer, length=24, steps=6, remasking="confidence", on_step=count)
    assert "<|mask|>" not in result.texts[0]
    assert masked_per_step == [24, 17, 12, 7, 3, 0, 0]  # floor(24 m(s)) for cosine; linear: 20, 16, ...
    dlm.sample(model, tokenizer, length=24, steps=6, remasking="confidence", on_step=count, schedule="linear")
    assert masked_per_step[7:] == [24, 20, 16, 12, 8, 4, 0]
    random = dlm.sample(model, tokenizer, length=24, steps=6, remasking="random")
    assert "<|mask|>" not in random.texts[0] and 1 <= random.forward_passes <= 6


def test_an_export_without_diffusion_settings_is_linear(cosine_run: Path, tmp_path: Path) -> None:
    exported = export_model(cosine_run, tmp_path / "model", dtype="float32")
    config = json.loads((exported / "config.json").read_text())
    del config["diffusion"]
    config["training"]["mask_eps"] = 0.02  # where older exports kept it
    (exported / "config.json").write_text(json.dumps(config))
    loaded = load_model_with_info(exported)
    assert loaded.info.diffusion.schedule == "linear" and loaded.info.diffusion.mask_eps == 0.02
    assert model_schedule(loaded.model) == LinearSchedule()


# ------------------------------------------------------------------------------- loss by noise level


def test_training_reports_noise_buckets_and_the_dashboard_reads_any_count(tiny_data_dir: Path, tmp_path: Path) -> None:
    events: list[Event] = []
    train(tiny_experiment(tiny_data_dir, tmp_path / "run", *settings()), sink=events.append)
    trained = [event for event in events if isinstance(event, TrainEvent)]
    assert trained and all(len(event.loss_by_t) == NOISE_BUCKETS for event in trained)
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=160, color_system=None)
    with TrainingDashboard(console) as dashboard:
        dashboard(next(event for event in events if isinstance(event, StartEvent)))
        dashboard(dataclasses.replace(trained[0], loss_by_t=[1.0, 2.0, None, 4.0]))
    for cell in ("0-0.25: 1.00", "0.25-0.5: 2.00", "0.5-0.75: -", "0.75-1: 4.00"):
        assert cell in output.getvalue(), cell
