"""`dlm distill`: the two-step target, the rounds, exact resume, and the student's steps downstream."""

from __future__ import annotations

import itertools
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_weights, tiny_experiment, train_losses

from dlm.artifacts.events import Event
from dlm.artifacts.export import export_model
from dlm.artifacts.loading import load_model, read_model_source
from dlm.artifacts.run_dir import RunDir
from dlm.config.schema import ExperimentConfig
from dlm.data.dataset import load_packed_dataset
from dlm.data.tokenizer import tokenizer_sha256
from dlm.diffusion.distillation import (
    TwoStepTimes,
    allowed_log_probs,
    draw_tokens,
    first_reveals,
    grid_times,
    planned_masks,
    two_step_log_target,
)
from dlm.diffusion.divergences import get_divergence
from dlm.diffusion.schedules import get_schedule
from dlm.distill.run import distill, distillation_experiment
from dlm.distill.step import DistillStep
from dlm.errors import UserError
from dlm.model.denoiser import masked_logits
from dlm.sampling.generation import generate
from dlm.train.distributed import current_context
from dlm.train.init_from import initial_weights, load_initial_weights
from dlm.train.loop import train
from dlm.train.step import LogWindow

DISTILL = {"teacher_steps": 16, "rounds": 2, "steps_per_round": 4}


@pytest.fixture(scope="module")
def teacher(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained 60 steps, exported: enough that its predictions depend on the context."""

    base = tmp_path_factory.mktemp("teacher")
    train(tiny_experiment(tiny_data_dir, base / "run"))
    return export_model(base / "run", base / "model", dtype="float32")


@pytest.fixture(scope="module")
def weak_model(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model after 2 steps: far from the teacher, a student with much to learn."""

    base = tmp_path_factory.mktemp("weak")
    train(tiny_experiment(tiny_data_dir, base / "run", "training.max_steps=2", "training.warmup_steps=1"))
    return export_model(base / "run", base / "model", dtype="float32")


def _experiment(teacher: Path, data: Path, run: Path, *overrides: str, **distill_fields: object) -> ExperimentConfig:
    fields = DISTILL | distill_fields
    return distillation_experiment(teacher, data, run, fields, ["training.eval_batches=1", *overrides])


def _step(experiment: ExperimentConfig) -> DistillStep:
    """A distillation step on one CPU process, its student started from `training.init_from` and its
    round-0 teacher loaded, as `dlm.train.loop` builds them."""

    experiment = experiment.with_absolute_paths()
    step = DistillStep(experiment, torch.device("cpu"), "float32", current_context(experiment))
    source = experiment.training.init_from
    assert source is not None
    load_initial_weights(step.model, initial_weights(source, experiment.model, step.teachers.tokenizer_sha256))
    step.teachers.ensure(0, step.model)
    return step


# ------------------------------------------------------------------------------ the target


def test_grid_times_are_the_students_sampling_times() -> None:
    times = grid_times(torch.tensor([0.0, 0.01, 0.25, 0.26, 1.0]), 4)
    assert times.t.tolist() == [0.25, 0.25, 0.25, 0.5, 1.0]
    assert times.u.tolist() == [0.125, 0.125, 0.125, 0.375, 0.875]
    assert times.s.tolist() == [0.0, 0.0, 0.0, 0.25, 0.75]
    # (m(t) - m(u)) / m(t) on the linear schedule: (t - u) / t.
    assert times.first_reveal_probability(get_schedule("linear")).tolist() == [0.5, 0.5, 0.5, 0.25, 0.125]


@pytest.mark.parametrize("schedule_name", ["linear", "cosine"])
def test_target_averages_to_the_enumerated_two_step_prediction(schedule_name: str) -> None:
    """Two masked positions i and j over a 5-token vocabulary, a teacher whose prediction at i depends on
    what j holds. Enumerating the two-step process gives the teacher's prediction of x_i after it: the
    prediction of the step that revealed i, else of the last step. The distillation's target (the first
    step's prediction where that step revealed i, else the second's at the z_u the first step wrote),
    averaged exactly over the first step's outcomes, is that distribution."""

    vocab, mask = 5, 4  # token 4 is the mask, never predicted
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, vocab, generator=generator, dtype=torch.float64) * 2

    def teacher_logits(j_token: int) -> torch.Tensor:
        """The teacher's logits at i when j holds j_token (a different prediction for each, masked included)."""

        return table[j_token][None]

    forbidden = torch.tensor([mask])
    p_j = allowed_log_probs(table[:1].roll(1, dims=1), forbidden)[0].double().exp()  # j's prediction at z_t
    schedule = get_schedule(schedule_name)
    times = TwoStepTimes(
        t=torch.tensor([0.75], dtype=torch.float64),
        u=torch.tensor([0.5], dtype=torch.float64),
        s=torch.tensor([0.25], dtype=torch.float64),
    )
    first = float(times.first_reveal_probability(schedule)[0])
    at_t = allowed_log_probs(teacher_logits(mask), forbidden).double().exp()[0]

    # The process, enumerated: j's first step, then i's belief after the two steps.
    reference = first * at_t
    for j_token in range(vocab):
        chance = (1 - first) if j_token == mask else first * float(p_j[j_token])
        reference += (1 - first) * chance * allowed_log_probs(teacher_logits(j_token), forbidden).double().exp()[0]

    # The target, as the distillation builds it for each outcome of the first step at i and j.
    expected = torch.zeros(vocab, dtype=torch.float64)
    for i_revealed, j_token in itertools.product((True, False), range(vocab)):
        chance = (1 - first) if j_token == mask else first * float(p_j[j_token])
        chance *= first if i_revealed else 1 - first
        revealed = torch.tensor([i_revealed])
        second = allowed_log_probs(teacher_logits(j_token), forbidden)[~revealed]
        target = two_step_log_target(allowed_log_probs(teacher_logits(mask), forbidden), second, revealed)
        expected += chance * target[0].double().exp()
    torch.testing.assert_close(expected, reference, rtol=1e-6, atol=1e-7)
    assert expected.sum().item() == pytest.approx(1.0, abs=1e-6) and expected[mask] == 0


def test_first_step_reveals_with_its_probability_and_draws_from_the_teacher() -> None:
    logits = torch.tensor([[0.7, 0.2, 0.1, 0.3]]).log().expand(40_000, 4)
    generator = torch.Generator().manual_seed(0)
    revealed = first_reveals(torch.full((40_000,), 0.25, dtype=torch.float64), generator)
    assert abs(revealed.double().mean().item() - 0.25) < 0.01
    tokens = draw_tokens(logits, torch.tensor([3]), generator)  # token 3 forbidden: never drawn
    frequencies = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64), atol=0.01, rtol=0)


def test_divergences_vanish_on_equal_distributions_and_order_as_defined() -> None:
    forbidden = torch.tensor([2])
    target = allowed_log_probs(torch.tensor([[0.5, 0.5, 9.0]]).log(), forbidden)
    student = allowed_log_probs(torch.tensor([[0.25, 0.75, 9.0]]).log(), forbidden)
    assert target.isfinite().all() and target[0, 2].exp() == 0
    for name in ("kl", "reverse-kl", "tvd"):
        assert get_divergence(name)(target, target).item() == pytest.approx(0.0, abs=1e-7)
    kl = 0.5 * torch.tensor(0.5 / 0.25).log() + 0.5 * torch.tensor(0.5 / 0.75).log()
    reverse = 0.25 * torch.tensor(0.25 / 0.5).log() + 0.75 * torch.tensor(0.75 / 0.5).log()
    assert get_divergence("kl")(target, student).item() == pytest.approx(kl.item(), rel=1e-6)
    assert get_divergence("reverse-kl")(target, student).item() == pytest.approx(reverse.item(), rel=1e-6)
    assert get_divergence("tvd")(target, student).item() == pytest.approx(0.25, rel=1e-6)


def test_teacher_target_is_built_from_the_teachers_two_passes(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    """The target is the teacher's prediction at z_t where its first step revealed the position, and its
    prediction at the z_u that step wrote everywhere else."""

    step = _step(_experiment(teacher, tiny_data_dir, tmp_path / "run"))
    clean = load_packed_dataset(tiny_data_dir / "train.bin", 64)[0][None].repeat(4, 1)
    noisy = clean.clone()
    mask = torch.zeros_like(clean, dtype=torch.bool)
    mask[:, 10:40] = True
    noisy[mask] = 1
    times = grid_times(torch.tensor([0.2, 0.45, 0.7, 1.0]), 8)
    log_target = step.teacher_target(clean, noisy, mask, times, torch.Generator().manual_seed(1))
    assert log_target.shape == (int(mask.sum()), 512)
    with torch.no_grad():
        first_logits = masked_logits(step.teacher, noisy, mask, clean)
        # The same draws in the same order: the reveals, then a token for each revealed position.
        generator = torch.Generator().manual_seed(1)
        reveal = times.first_reveal_probability(step.schedule)[:, None].expand_as(clean)[mask]
        revealed = first_reveals(reveal, generator)
        assert revealed.any() and not revealed.all()
        tokens = draw_tokens(first_logits[revealed], step.forbidden, generator)
        assert (tokens != 1).all()  # never the mask token
        middle = noisy.clone()
        middle[mask] = noisy[mask].masked_scatter(revealed, tokens)
        still = mask.clone()
        still[mask] = ~revealed
        second = allowed_log_probs(masked_logits(step.teacher, middle, still, clean), step.forbidden)
        first = allowed_log_probs(first_logits, step.forbidden)
    torch.testing.assert_close(log_target[revealed], first[revealed])
    torch.testing.assert_close(log_target[~revealed], second)
    assert (log_target[:, 1].exp() == 0).all()  # the mask token is never a target


def test_before_any_update_the_student_predicts_as_the_teacher(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    step = _step(_experiment(teacher, tiny_data_dir, tmp_path / "run"))
    clean = torch.stack([load_packed_dataset(tiny_data_dir / "train.bin", 64)[index] for index in range(4)])
    noisy = clean.clone()
    mask = torch.rand(clean.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    noisy[mask] = 1
    with torch.no_grad():
        student = masked_logits(step.model, noisy, mask, clean)
        teacher_logits = masked_logits(step.teacher, noisy, mask, clean)
    assert torch.equal(student, teacher_logits)


def test_the_teacher_is_built_without_drawing_weights(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlm.model.transformer import DiffusionTransformer

    drawn: list[str] = []
    init_weights = DiffusionTransformer.init_weights

    def recorded(model: DiffusionTransformer) -> None:
        drawn.append(next(model.parameters()).device.type)
        init_weights(model)

    monkeypatch.setattr(DiffusionTransformer, "init_weights", recorded)
    experiment = _experiment(teacher, tiny_data_dir, tmp_path / "run").with_absolute_paths()
    source = experiment.training.init_from
    assert source is not None
    initial = initial_weights(source, experiment.model, tokenizer_sha256(experiment.training.tokenizer))
    DistillStep(experiment, torch.device("cpu"), "float32", current_context(experiment), initial)
    # The student takes the initial weights, the teacher those of its round when it begins: no draw.
    assert drawn and set(drawn) == {"meta"}


def test_planned_masks_are_those_of_the_dilated_sampler(teacher: Path) -> None:
    """At each of a student's n steps, the masks and the teacher's first reveals are those the dilated
    sampler of 2n steps leaves and makes (recorded from `generate`), on a row and on a model's blocks."""

    model, tokenizer = load_model(teacher)
    length, student_steps = 12, 3
    history: list[torch.Tensor] = []
    generate(
        model,
        tokenizer,
        length=length,
        steps=2 * student_steps,
        remasking="dilated",
        on_step=lambda step, tokens: history.append(tokens[0] == model.config.mask_token_id),
    )
    assert len(history) == 2 * student_steps + 1
    k = torch.arange(student_steps, 0, -1, dtype=torch.float64)  # t = 1, 2/3, 1/3: the student's steps
    times = grid_times(k / student_steps, student_steps)
    planned = planned_masks(times, length, 0, student_steps, get_schedule("linear"))
    for row, done in enumerate(range(0, 2 * student_steps, 2)):
        assert planned.masked[row].tolist() == history[done].tolist(), row
        assert planned.first[row].tolist() == (history[done] & ~history[done + 1]).tolist(), row
    # A block model's blocks (the last cut short) each follow the plan of a row of their own size.
    blocks = grid_times(torch.tensor([[1.0, 0.5, 0.2]]), 2)
    by_block = planned_masks(blocks, 10, 4, 2, get_schedule("linear"))
    for index, (start, size) in enumerate([(0, 4), (4, 4), (8, 2)]):
        alone = planned_masks(grid_times(blocks.t[:, index], 2), size, 0, 2, get_schedule("linear"))
        assert by_block.masked[:, start : start + size].tolist() == alone.masked.tolist()
        assert by_block.first[:, start : start + size].tolist() == alone.first.tolist()


def _fixed_divergence(step: DistillStep, clean: torch.Tensor) -> float:
    """The divergence on a fixed batch, mask and first step: only the student's weights change it."""

    times = grid_times(torch.linspace(0.05, 1.0, clean.shape[0]), 8)
    with torch.no_grad():
        result = step.divergence_at(clean, times, torch.Generator().manual_seed(7))
    return result.per_token.mean().item()


def _batches(data: Path, batch_size: int) -> Iterator[torch.Tensor]:
    dataset = load_packed_dataset(data / "train.bin", 64)
    for start in itertools.count(0, batch_size):
        yield torch.stack([dataset[(start + offset) % len(dataset)] for offset in range(batch_size)])


@pytest.mark.parametrize("remasking", ["random", "dilated"])
def test_a_round_lowers_the_divergence_to_the_two_step_teacher(
    teacher: Path, weak_model: Path, tiny_data_dir: Path, tmp_path: Path, remasking: str
) -> None:
    """A student that starts far from its teacher (from a 2-step model) comes closer over one round."""

    experiment = _experiment(
        teacher,
        tiny_data_dir,
        tmp_path / "run",
        f"training.init_from={weak_model}",
        "training.learning_rate=3e-3",
        "training.warmup_steps=1",
        teacher_steps=16,
        rounds=1,
        steps_per_round=30,
        remasking=remasking,
    )
    step = _step(experiment)
    step.prepare()
    fixed = next(_batches(tiny_data_dir, 16))
    before = _fixed_divergence(step, fixed)
    batches, window = _batches(tiny_data_dir, 8), LogWindow(step.device)
    for _ in range(30):
        step.optimizer_step(batches, window)
    after = _fixed_divergence(step, fixed)
    assert after < 0.8 * before, (before, after)


# ------------------------------------------------------------------------------ the run


def test_resume_in_the_middle_of_a_round_is_bit_identical(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    """Round 1's teacher is the student at step 4, saved beside the checkpoints: a run paused at step 6
    and resumed reloads it, and ends on the very weights of an uninterrupted run."""

    settings = ("training.save_interval=2", "training.eval_interval=100")
    straight_events: list[Event] = []
    straight = distill(
        _experiment(teacher, tiny_data_dir, tmp_path / "straight", *settings), sink=straight_events.append
    )
    split = _experiment(teacher, tiny_data_dir, tmp_path / "split", *settings)
    first: list[Event] = []
    paused = distill(split, max_run_steps=6, sink=first.append)
    assert paused.status == "paused" and paused.step == 6
    run = RunDir(tmp_path / "split")
    assert run.teacher_snapshots() == {1: run.teacher_snapshot(1)}
    second: list[Event] = []
    resumed = distill(split, resume=paused.checkpoint, sink=second.append)
    assert resumed.status == "complete" and resumed.step == straight.step == 8
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    assert train_losses(first) + train_losses(second) == train_losses(straight_events)
    # The recorded teacher hash guards the resume: a changed teacher is refused, not silently used.
    recorded = json.loads(run.config.read_text())["distill"]["teacher_sha256"]
    assert isinstance(recorded, str) and len(recorded) == 64


def test_a_changed_teacher_is_refused_on_resume(
    teacher: Path, weak_model: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    experiment = _experiment(teacher, tiny_data_dir, tmp_path / "run")
    paused = distill(experiment, max_run_steps=2)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    moved = ExperimentConfig.from_dict(recorded)
    moved = moved.model_copy(update={"distill": moved.distill.model_copy(update={"teacher": weak_model})})
    with pytest.raises(UserError, match="weights changed since this run began"):
        distill(moved, resume=paused.checkpoint)


def test_plain_training_refuses_a_distillation_config(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"\[distill\]"):
        train(_experiment(teacher, tiny_data_dir, tmp_path / "run"))


def test_distillation_rules_are_checked_up_front(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="max_steps 5 is not rounds x steps_per_round"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", "training.max_steps=5")
    with pytest.raises(UserError, match="do not halve 2 times"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", teacher_steps=6)
    with pytest.raises(UserError, match="not a registered divergence"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", divergence="wasserstein")
    with pytest.raises(UserError, match="autoregressive"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", "model.block_size=1", "model.attention=causal")


def test_a_run_never_starts_over_where_its_teacher_lies(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    """Started over (`--overwrite`) in the teacher's own directory, or in a run whose checkpoint is the
    teacher, the run would delete it: refused before anything is written. A teacher in a directory of
    its own inside the run's (`RUN/model`) is not the run's, and is kept."""

    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    before = sorted((path.name, path.read_bytes()) for path in copy.iterdir())
    with pytest.raises(UserError, match=r"which starting over in .* deletes"):
        distill(_experiment(copy, tiny_data_dir, copy), overwrite=True)
    assert sorted((path.name, path.read_bytes()) for path in copy.iterdir()) == before
    run = tmp_path / "run"
    distill(_experiment(copy, tiny_data_dir, run, rounds=1, steps_per_round=1))
    with pytest.raises(UserError, match=r"which starting over in .* deletes"):
        distill(_experiment(run / "latest.pt", tiny_data_dir, run, rounds=1, steps_per_round=1), overwrite=True)
    inside = run / "model"
    shutil.copytree(teacher, inside)
    distill(_experiment(inside, tiny_data_dir, run, rounds=1, steps_per_round=1), overwrite=True)
    assert (inside / "model.safetensors").is_file()


def test_the_cli_refuses_what_its_method_ignores_and_too_few_samples(teacher: Path, tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    run_cli("distill", teacher, "--teacher-samples", "2", "--output", tmp_path / "a").assert_refused(
        "--teacher-samples must be at least 16"
    )
    run_cli("distill", teacher, "--teacher-samples", "16", "--output", teacher, "--overwrite").assert_refused(
        "which starting over in"
    )
    options = ("--teacher-samples", "16", "--output", tmp_path / "b")
    run_cli("distill", teacher, *options, "--certainty-weight", "2").assert_refused(
        "--certainty-weight does not apply to --method sdtt"
    )
    run_cli("distill", teacher, *options, "--method", "certainty", "--divergence", "tvd").assert_refused(
        "--divergence does not apply to --method certainty"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any sampling


def test_a_student_distilled_further_teaches_from_its_own_steps(
    student: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    further = distillation_experiment(student, tiny_data_dir, tmp_path / "run", {"rounds": 1})
    assert further.distill is not None and further.distill.teacher_steps == 4
    chosen = distillation_experiment(student, tiny_data_dir, tmp_path / "run", {"rounds": 1, "teacher_steps": 8})
    assert chosen.distill is not None and chosen.distill.teacher_steps == 8
    with pytest.raises(UserError, match="samples in the 4 steps it was distilled for") as refused:
        distillation_experiment(student, tiny_data_dir, tmp_path / "run", {"rounds": 3})
    assert refused.value.fix is not None and "--rounds" in refused.value.fix


# ------------------------------------------------------------------------------ the student


@pytest.fixture(scope="module")
def student(teacher: Path, tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("student")
    distill(_experiment(teacher, tiny_data_dir, base / "run"))
    return export_model(base / "run", base / "model")


def test_the_student_records_its_steps_and_teacher(student: Path, teacher: Path) -> None:
    config = json.loads((student / "config.json").read_text())
    record = config["distillation"]
    _, teacher_weights = read_model_source(teacher)
    from dlm.artifacts.checksum import weights_sha256

    assert record["steps"] == 4 and record["teacher_steps"] == 16 and record["rounds_done"] == 2
    assert record["method"] == "sdtt" and record["divergence"] == "kl"
    assert record["teacher_sha256"] == weights_sha256(teacher_weights)
    card = (student / "README.md").read_text()
    assert "**4 sampling steps**" in card
    learning_rate = json.loads((student / "config.json").read_text())["training"]["learning_rate"]
    assert f"lr {learning_rate:.6g} " in card and "00000000" not in card  # as written, not a division's tail
    teacher_config = json.loads((teacher / "config.json").read_text())
    assert teacher_config["distillation"] is None


def test_sampling_defaults_to_the_students_steps(student: Path, teacher: Path) -> None:
    model, tokenizer = load_model(student)
    assert generate(model, tokenizer, length=16, seed=1).steps == 4
    assert generate(model, tokenizer, length=16, steps=8, seed=1).steps == 8
    with pytest.warns(UserWarning, match="below the 4 steps this model was distilled for"):
        assert generate(model, tokenizer, length=16, steps=2, seed=1).steps == 2
    teacher_model, teacher_tokenizer = load_model(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(teacher_model, teacher_tokenizer, length=16, seed=1).steps == 64


def test_the_cli_samples_and_serves_in_the_students_steps(student: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    result = run_cli("sample", student, "--length", "16", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 4
    model, tokenizer = load_model(student)
    assert _served_options(model, tokenizer, {}).steps == 4
    assert _served_options(model, tokenizer, {"steps": 16}).steps == 16


def _served_options(model: Any, tokenizer: Any, body: dict[str, Any]) -> Any:
    """The sampler options `dlm serve` gives a completion request with `body`'s fields for this model."""

    from dlm.diffusion.distillation import distilled_remasking, distilled_steps
    from dlm.serving.protocol import CompletionRequest, Limits, check_generation

    request = CompletionRequest.model_validate({"prompt": "ROMEO:", "max_tokens": 16} | body)
    generation = check_generation(
        request,
        ["ROMEO:"],
        chat=False,
        served="s",
        config=model.config,
        tokenizer=tokenizer,
        limits=Limits(),
        model_steps=distilled_steps(model),
        model_remasking=distilled_remasking(model),
    )
    return generation.options


def test_a_student_distilled_for_the_dilated_order_samples_in_it(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    distill(_experiment(teacher, tiny_data_dir, tmp_path / "run", remasking="dilated"))
    student = export_model(tmp_path / "run", tmp_path / "model")
    record = json.loads((student / "config.json").read_text())["distillation"]
    assert record["remasking"] == "dilated" and record["steps"] == 4
    model, tokenizer = load_model(student)
    own = generate(model, tokenizer, length=16, seed=3)
    assert own.steps == 4 and own.forward_passes == 4
    assert own.token_ids == generate(model, tokenizer, length=16, seed=3, remasking="dilated").token_ids
    assert own.token_ids != generate(model, tokenizer, length=16, seed=3, remasking="random").token_ids
    assert _served_options(model, tokenizer, {}).remasking == "dilated"
    assert _served_options(model, tokenizer, {"remasking": "random"}).remasking == "random"
    with pytest.raises(UserError, match="remasking"):
        _experiment(teacher, tiny_data_dir, tmp_path / "cf", method="certainty", rounds=1, remasking="dilated")


def test_the_hugging_face_export_keeps_the_students_steps(student: Path, tmp_path: Path) -> None:
    from dlm.artifacts.hf_export import export_hf

    exported = export_hf(student, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert config["dlm"]["distillation"]["steps"] == 4
    info, _ = read_model_source(exported)
    assert info.distillation is not None and info.distillation["steps"] == 4
    model, _ = load_model(exported)
    from dlm.diffusion.distillation import distilled_steps

    assert distilled_steps(model) == 4


def test_dlm_distill_runs_and_resumes_from_the_cli(teacher: Path, tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    args = (
        "distill",
        teacher,
        "--data",
        tiny_data_dir,
        "--output",
        run,
        "--teacher-steps",
        "8",
        "--rounds",
        "1",
        "--steps-per-round",
        "4",
        "--json",
    )
    result = run_cli(*args, "--max-run-steps", "2")
    assert result.exit_code == 0, result.stderr
    assert "continue with: dlm resume" in result.stderr
    trained = [json.loads(line) for line in result.stdout.splitlines() if '"event": "train"' in line]
    assert trained and trained[-1]["phase"].startswith("round 1/1: 8 -> 4 sampling steps; loss is the kl")
    resumed = run_cli("resume", run, "--json")
    assert resumed.exit_code == 0, resumed.stderr
    events = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "complete" and events[-1]["step"] == 4
    # Done: the way on is an export, or a further distillation from the 4 steps the student samples in.
    run_cli("resume", run).assert_refused(f"dlm export {run}", "from the 4 steps it samples in")


def test_dlm_distill_refuses_data_packed_with_another_tokenizer(teacher: Path, tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    from conftest import tiny_train_files

    from dlm.data.pack import pack_corpus
    from dlm.data.tokenizer import train_tokenizer

    other = tmp_path / "other-tokenizer.json"
    train_tokenizer(tiny_train_files()[:1], 400, other)
    pack_corpus(tiny_train_files()[:1], other, 64, tmp_path / "data")
    result = run_cli("distill", teacher, "--data", tmp_path / "data", "--output", tmp_path / "run")
    result.assert_refused("tokenizer")
    assert not (tmp_path / "run").exists()
    missing = run_cli("distill", teacher, "--data", tmp_path / "nowhere", "--output", tmp_path / "run")
    missing.assert_refused("no train.bin here")


def test_dlm_distill_plans_its_rounds_to_fill_minutes(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path, run_cli
) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    result = run_cli(
        "distill",
        teacher,
        "--data",
        tiny_data_dir,
        "--output",
        run,
        "--teacher-steps",
        "8",
        "--rounds",
        "2",
        "--minutes",
        "0.1",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    plan = lines[0]
    assert plan["event"] == "distill_plan" and plan["rounds"] == 2 and plan["steps_per_round"] >= 1
    config = json.loads((run / "config.json").read_text())
    assert config["distill"]["steps_per_round"] == plan["steps_per_round"]
    assert config["training"]["max_steps"] == 2 * plan["steps_per_round"]
    assert lines[-1]["event"] in ("complete", "paused")  # a loaded machine stops at the budget, resumable
    refused = run_cli(
        "distill",
        teacher,
        "--data",
        tiny_data_dir,
        "--output",
        tmp_path / "other",
        "--minutes",
        "1",
        "--steps-per-round",
        "5",
    )
    refused.assert_refused("--steps-per-round")


def test_the_memory_estimate_counts_the_teacher(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    from dlm.train.memory import estimate_training_memory

    experiment = _experiment(teacher, tiny_data_dir, tmp_path / "run")
    with_teacher = estimate_training_memory(experiment, "float32")
    alone = estimate_training_memory(experiment.model_copy(update={"distill": None}), "float32")
    assert with_teacher.teacher == with_teacher.weights > 0 and alone.teacher == 0
    assert with_teacher.total == alone.total + with_teacher.weights
    assert "teacher" in with_teacher.breakdown()


def test_a_checkpoint_of_an_earlier_round_keeps_its_teacher(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    """Saves that do not fall on the rounds' starts: the run keeps round 1's teacher while a checkpoint in
    round 1 remains, and a resume from it (the later checkpoint lost) ends on the uninterrupted weights."""

    settings = ("training.save_interval=3", "training.eval_interval=100", "training.keep_last_checkpoints=2")
    fields = {"teacher_steps": 8, "rounds": 3, "steps_per_round": 2}
    straight = distill(_experiment(teacher, tiny_data_dir, tmp_path / "straight", *settings, **fields))
    split = _experiment(teacher, tiny_data_dir, tmp_path / "split", *settings, **fields)
    paused = distill(split, max_run_steps=5)
    run = RunDir(tmp_path / "split")
    assert paused.step == 5 and run.checkpoint_steps() == [3, 5]
    assert set(run.teacher_snapshots()) == {1, 2}  # round 2 began at step 4, while step 3's checkpoint was kept
    resumed = distill(split, resume=run.step_checkpoint(3))
    assert resumed.status == "complete" and resumed.step == straight.step == 6
    assert_same_weights(straight.checkpoint, resumed.checkpoint)


def test_the_frontier_benchmark_measures_models_at_their_own_steps(
    student: Path, teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import math

    from benchmarks import distill as frontier
    from benchmarks import harness

    entry = frontier.parse_entry(f"{teacher}@threshold=0.01")
    assert entry.threshold == 0.01 and entry.steps is None and entry.path == teacher
    entry = frontier.parse_entry(f"{teacher}@steps=4,remasking=dilated")
    assert (entry.steps, entry.remasking, entry.threshold) == (4, "dilated", None)
    assert frontier.parse_entry(str(teacher)).remasking is None  # the model's own order
    models = [str(teacher), f"{teacher}@4", str(student), f"{teacher}@threshold=0.01"]
    frontier.distill(models, judge=teacher, length=16, num_samples=2, seeds="0,1", repeats=1, results=tmp_path)
    result = harness.load("distill", tmp_path)
    rows = result["figures"]["models"]
    assert [row["steps"] for row in rows] == [16, 4, 4, 16]  # one a token, as asked, the student's own
    assert rows[0]["speedup"] == 1.0 and [row["passes_per_token"] for row in rows][1:3] == [0.25, 0.25]
    assert rows[-1]["over_last"] == 1.0 and rows[0]["over_last"] == pytest.approx(1 / rows[-1]["speedup"])
    assert rows[3]["passes_per_token"] < 1  # a threshold low enough commits several positions a pass
    assert all(math.isfinite(row["judge_perplexity"]) and 0 < row["distinct_2"] <= 1 for row in rows)
    assert (rows[0]["perplexity_change_low"], rows[0]["perplexity_change_high"]) == (0.0, 0.0)
    for row in rows[1:]:  # the interval is around the change itself
        assert row["perplexity_change_low"] < row["perplexity_change"] < row["perplexity_change_high"]
    assert set(result["rounds"]) == {"seed_0", "seed_1"} and set(result["rounds"]["seed_0"]) == set(models)
    table = frontier.table([frontier.Figures(**row) for row in rows])
    assert table.count("\n") == len(rows) + 1 and "(+0.0%)" in table.splitlines()[2]
    assert table in capsys.readouterr().out


def test_the_frontier_benchmarks_interval_is_the_normal_one_of_the_mean_nll() -> None:
    import math

    from benchmarks import distill as frontier

    reference = [(1.0, 4), (3.0, 4)]  # mean 2, variance of the mean (16 + 16) / 64 = 0.5
    other = [(2.5, 2), (2.5, 6)]  # mean 2.5, no spread
    low, high = frontier.change_interval(reference, other)
    half = 1.96 * math.sqrt(0.5)
    assert low == pytest.approx(math.exp(0.5 - half) - 1) and high == pytest.approx(math.exp(0.5 + half) - 1)
    assert frontier.change_interval(reference, reference) == (0.0, 0.0)
    assert frontier.change_interval(other, list(other)) == (0.0, 0.0)  # the same rows: no spread, no change


def test_dlm_distill_on_the_teachers_own_samples(teacher: Path, tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    args = (
        "distill",
        teacher,
        "--teacher-samples",
        "24",
        "--output",
        run,
        "--teacher-steps",
        "8",
        "--rounds",
        "1",
        "--steps-per-round",
        "2",
        "--json",
    )
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    samples = run / "teacher-samples"
    lines = (samples / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 24 and all(json.loads(line)["text"] for line in lines)
    progress = [json.loads(line) for line in result.stdout.splitlines() if '"progress"' in line]
    assert progress[-1]["samples"] == progress[-1]["total"] == 24
    config = json.loads((run / "config.json").read_text())
    assert Path(config["training"]["train_data"]) == (samples / "train.bin").resolve()
    written = (samples / "samples.jsonl").stat().st_mtime_ns
    again = run_cli(*args, "--overwrite")  # a new run on the same samples: not sampled again
    assert again.exit_code == 0, again.stderr
    assert (samples / "samples.jsonl").stat().st_mtime_ns == written
    assert not [line for line in again.stdout.splitlines() if '"progress"' in line]
    refused = run_cli("distill", teacher, "--teacher-samples", "24", "--output", run)
    refused.assert_refused("already holds a run")
    both = run_cli("distill", teacher, "--teacher-samples", "8", "--data", tiny_data_dir, "--output", tmp_path / "b")
    both.assert_refused("give one of --data")
    neither = run_cli("distill", teacher, "--output", tmp_path / "c")
    neither.assert_refused("give one of --data")


def test_teacher_samples_are_reused_only_in_the_dtype_they_were_drawn_in(teacher: Path, tmp_path: Path) -> None:
    from dlm.distill.samples import RECORD_NAME, SAMPLES_NAME, teacher_samples

    output = teacher_samples(teacher, 16, tmp_path / "run")
    record = json.loads((output / RECORD_NAME).read_text())
    assert record["compute_dtype"] == "float32"  # the test teacher is stored in float32
    written = (output / SAMPLES_NAME).stat().st_mtime_ns
    assert teacher_samples(teacher, 16, tmp_path / "run") == output  # the same call: reused
    assert (output / SAMPLES_NAME).stat().st_mtime_ns == written
    # Samples a machine drew in bfloat16 are not this machine's: drawn again, and recorded as such.
    (output / RECORD_NAME).write_text(json.dumps(record | {"compute_dtype": "bfloat16"}))
    teacher_samples(teacher, 16, tmp_path / "run")
    assert (output / SAMPLES_NAME).stat().st_mtime_ns != written
    assert json.loads((output / RECORD_NAME).read_text())["compute_dtype"] == "float32"


@pytest.mark.hf_extra
def test_transformers_generates_in_the_students_steps(student: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from dlm.artifacts.hf_export import export_hf

    exported = export_hf(student, tmp_path / "hf", dtype="float32")
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(exported, trust_remote_code=True).float().eval()
    model, tokenizer = load_model(student, dtype=torch.float32)
    expected = generate(model, tokenizer, length=16, num_samples=2, seed=5)  # its 4 steps, not 64
    ids = hf_model.generate(None, max_new_tokens=16, num_samples=2, seed=5)
    assert expected.steps == 4 and ids.tolist() == expected.token_ids
    assert hf_model.generate(None, max_new_tokens=16, num_samples=2, seed=5, steps=16).tolist() != ids.tolist()


def test_dlm_distills_options_default_to_the_distill_sections_defaults() -> None:
    import inspect

    from dlm.cli.distill_cmd import distill_command
    from dlm.config.distill import DistillConfig

    parameters = inspect.signature(distill_command).parameters
    fields = DistillConfig.model_fields
    shared = [name for name, field in fields.items() if name in parameters and not field.is_required()]
    assert {"teacher_steps", "rounds", "steps_per_round", "divergence", "remasking", "method"} <= set(shared)
    assert parameters["teacher_steps"].default is None  # the teacher's own steps where it is a student
    for name in set(shared) - {"teacher_steps"}:  # the [distill] section owns each default; --help repeats it
        assert parameters[name].default == fields[name].default, name
