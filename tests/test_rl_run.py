"""`dlm rl` end to end on a tiny model of the bundled addition task: rollouts, resume, failures, CLI."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from dlm.artifacts.events import Event, HeldoutEvent, RolloutEvent
from dlm.config.rl import RewardSpec
from dlm.config.schema import load_config
from dlm.errors import UserError
from dlm.rl.run import rl
from tests.helpers import ROOT, assert_same_weights, build_addition_task, rl_config, train_addition_sft


@pytest.fixture(scope="module")
def addition(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_addition_task(tmp_path_factory.mktemp("addition"))


@pytest.mark.parametrize(
    "estimator, extra",
    [("coupled", ()), ("one-step", ("rl.inner_updates=2", "rl.kl_weight=0.1")), ("elbo", ("rl.estimator_samples=2",))],
)
def test_a_paused_and_resumed_rl_run_equals_an_uninterrupted_one(
    addition: Path, estimator: str, extra: tuple[str, ...]
) -> None:
    settings = (f"rl.estimator={estimator}", *extra)
    events: list[Event] = []
    straight = rl(rl_config(addition, f"straight-{estimator}", *settings), sink=events.append)
    assert straight.status == "complete" and straight.step == 4
    split = rl_config(addition, f"split-{estimator}", *settings)
    paused = rl(split, max_run_steps=2)
    assert paused.status == "paused" and paused.step == 2
    resumed = rl(split, resume=paused.checkpoint)
    assert resumed.step == 4
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    rollouts = [event for event in events if isinstance(event, RolloutEvent)]
    assert [event.step for event in rollouts] == [2, 4]
    assert all(0.0 <= event.accuracy <= 1.0 and event.sample for event in rollouts)
    heldout = [event for event in events if isinstance(event, HeldoutEvent)]
    assert [(event.step, event.prompts) for event in heldout] == [(2, 6), (4, 6)]
    # Every event reached metrics.jsonl, the RL kinds included.
    kinds = [json.loads(line)["event"] for line in (addition / f"straight-{estimator}" / "metrics.jsonl").open()]
    assert kinds.count("rollout") == 2 and kinds.count("heldout") == 2
    if "rl.kl_weight=0.1" in extra:
        assert rollouts[-1].kl > 0
    else:
        assert all(event.kl == 0 for event in rollouts)
    if "rl.estimator_samples=2" in extra:  # two samples per estimate: their spread is reported
        assert all(event.estimator_variance is not None and event.estimator_variance > 0 for event in rollouts)
    else:
        assert all(event.estimator_variance is None for event in rollouts)
    if "rl.inner_updates=2" not in extra:  # one update: the ratio is 1, never clipped
        assert all(event.clip_fraction == 0 for event in rollouts)


def test_the_rollouts_of_a_step_do_not_depend_on_the_batch_they_share(addition: Path) -> None:
    from dlm.rl.step import RLStep

    experiment = rl_config(addition, "rollout-check").with_absolute_paths()
    step = RLStep(experiment, torch.device("cpu"), "float32", _single())
    weights = load_sft_weights(addition)
    step.model.load_state_dict(weights, strict=False)
    first = step.rollouts(3)
    again = step.rollouts(3)
    assert torch.equal(first.tokens, again.tokens)
    assert first.prompt_indices == step.step_prompts(3)[1] and first.positions == [0, 1]
    assert first.tokens.shape[0] == 2 * 4


def load_sft_weights(root: Path) -> dict[str, torch.Tensor]:
    from dlm.artifacts.loading import read_model_source

    return read_model_source(root / "sft", use_ema=True)[1]


def _single():  # type: ignore[no-untyped-def]
    from dlm.train.distributed import current_context

    return current_context(None)


def test_a_reward_that_raises_stops_the_run_with_its_checkpoints_kept(
    addition: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flaky_reward.py").write_text(
        "calls = 0\n"
        "def after_a_while(completion, record):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 2 * 8 + 6:  # two steps of 8 rollouts and the held-out check at step 2, then it breaks\n"
        "        raise RuntimeError('the verifier crashed')\n"
        "    return 1.0\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    experiment = rl_config(addition, "flaky")
    assert experiment.rl is not None
    flaky = experiment.rl.model_copy(update={"rewards": [RewardSpec(name="flaky_reward:after_a_while")]})
    with pytest.raises(UserError, match=r"raised RuntimeError: the verifier crashed on prompt \d+ of .*prompts.jsonl"):
        rl(experiment.model_copy(update={"rl": flaky}))
    run = addition / "flaky"
    assert (run / "step-00000002.pt").is_file() and (run / "latest.pt").is_file()
    assert (run / "config.json").is_file()
    sys.modules.pop("flaky_reward", None)


def test_prompts_and_configs_that_cannot_run_are_refused_before_anything_is_written(
    addition: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-answers.jsonl"
    missing.write_text('{"prompt": "1+1"}\n', encoding="utf-8")
    with pytest.raises(UserError, match="prompt 1 has no 'answer' field"):
        rl(rl_config(addition, "refused", f"rl.prompts={missing}"))
    assert not (addition / "refused" / "config.json").exists()
    with pytest.raises(UserError, match="exact only for a model whose blocks are one token"):
        rl(rl_config(addition, "refused", "rl.estimator=exact"))
    with pytest.raises(UserError, match="init_from is not set"):
        load_config(ROOT / "configs" / "addition-rl.toml", ["training.init_from=none", "rl.prompts=x.jsonl"])


def test_the_task_eval_and_rl_commands(addition: Path, tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    result = run_cli(
        "task",
        "addition",
        "--output",
        tmp_path / "task",
        "--digits",
        "2",
        "--sft",
        "50",
        "--prompts",
        "20",
        "--heldout",
        "10",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    files = {name: (tmp_path / "task" / name).read_text().splitlines() for name in ("sft.jsonl", "prompts.jsonl")}
    sft = {json.loads(line)["prompt"] for line in files["sft.jsonl"]}
    rl_prompts = {json.loads(line)["prompt"] for line in files["prompts.jsonl"]}
    assert len(sft) == 50 and not sft & rl_prompts
    run_cli("task", "addition", "--output", tmp_path / "task").assert_refused("already exists", "--overwrite")
    # Demonstrations of mixed quality: the same problems, a share of the responses one digit off.
    noisy = run_cli(
        *("task", "addition", "--output", tmp_path / "noisy", "--sft", "50", "--prompts", "20", "--heldout", "10"),
        *("--noise", "0.4", "--json"),
    )
    assert noisy.exit_code == 0, noisy.stderr
    clean = [json.loads(line) for line in files["sft.jsonl"]]
    mixed = [json.loads(line) for line in (tmp_path / "noisy" / "sft.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in mixed] == [row["prompt"] for row in clean]
    wrong = [(row["response"], right["response"]) for row, right in zip(mixed, clean, strict=True) if row != right]
    assert len(wrong) == json.loads(noisy.stdout)["wrong_responses"] and 10 <= len(wrong) <= 30
    for response, answer in wrong:  # one digit moved by one: a dropped or added carry
        difference = abs(int(response) - int(answer))
        assert int(response) >= 0 and difference in (1, 10, 100) and difference <= int(answer) + 100
    for name in ("prompts.jsonl", "heldout.jsonl"):
        assert (tmp_path / "noisy" / name).read_text() == (tmp_path / "task" / name).read_text()
    run_cli("task", "addition", "--output", tmp_path / "x", "--noise", "1").assert_refused("--noise")

    heldout = addition / "task" / "heldout.jsonl"
    args = ("eval", addition / "sft", "--prompts", heldout, "--samples", "2", "--pass-at", "1", "--pass-at", "2")
    result = run_cli(*args, "--json", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prompts"] == 12 and report["samples"] == 2
    assert 0.0 <= report["pass_at"]["1"] <= report["pass_at"]["2"] <= 1.0
    again = json.loads(run_cli(*args, "--json", "--device", "cpu").stdout)
    assert again == report  # the same prompts are asked the same way
    run_cli(*args, "--reward", "nope", "--device", "cpu").assert_refused("no reward named 'nope'")

    config = tmp_path / "rl.toml"
    config.write_text("[rl]\nprompts = 'x.jsonl'\n", encoding="utf-8")
    run_cli("rl", "--config", config).assert_refused("init_from")


def test_the_dashboard_shows_rewards_and_held_out_accuracy() -> None:
    from rich.console import Console

    from dlm.cli.dashboard import TrainingDashboard

    console = Console(width=80, record=True, file=io.StringIO())
    dashboard = TrainingDashboard(console)
    for step, reward in ((5, 0.25), (10, 0.5)):
        dashboard(RolloutEvent(step, reward, reward, 0.3, 0.25, 0.01, 0.05, 0.2, 0.3, "47+38=85"))
    dashboard(HeldoutEvent(10, 0.42, 0.03, 0.42, 200))
    console.print(dashboard.render())
    text = console.export_text()
    assert "reward 0.500  accuracy 0.500  flat groups 25%" in text
    assert "held-out accuracy 0.420 +- 0.030 on 200 prompts at step 10" in text
    assert "47+38=85" in text


@pytest.mark.report_extra
def test_the_report_of_an_rl_run_charts_its_rewards(addition: Path) -> None:
    pytest.importorskip("plotly")
    from dlm.report.page import write_report

    run = rl(rl_config(addition, "reported", "training.max_steps=2"))
    page = write_report(run.run_dir).read_text(encoding="utf-8")
    assert "Rewards (dlm rl)" in page and "held-out accuracy ± 1 s.e." in page
    assert "Rollouts (dlm rl)" in page and "held-out accuracy" in page


@pytest.mark.lora
def test_a_lora_rl_run_keeps_its_base_as_the_reference_and_resumes_exactly(addition: Path) -> None:
    pytest.importorskip("peft")
    settings = ("training.lora.rank=4", "rl.kl_weight=0.1", "rl.heldout=none")

    def config(run: str):  # type: ignore[no-untyped-def]
        # A reward that the tiny model's replies sometimes earn: groups that are not flat move the adapters.
        experiment = rl_config(addition, run, *settings)
        assert experiment.rl is not None
        some_digit = experiment.rl.model_copy(
            update={"rewards": [RewardSpec(name="regex", options={"pattern": "[0-4]"})]}
        )
        return experiment.model_copy(update={"rl": some_digit})

    events: list[Event] = []
    straight = rl(config("lora-straight"), sink=events.append)
    split = config("lora-split")
    paused = rl(split, max_run_steps=2)
    resumed = rl(split, resume=paused.checkpoint)
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    rollouts = [event for event in events if isinstance(event, RolloutEvent)]
    # The adapters start at zero: the first steps' policy is the base, then it moves away from it.
    assert rollouts[-1].kl > 0


@pytest.mark.parametrize(
    "layout", [("model.block_size=4",), ("model.block_size=1", "model.attention=causal")], ids=["block", "causal"]
)
def test_a_block_model_learns_from_prompts_of_different_lengths(
    addition: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """A block model (and the autoregressive one) scores its rollouts left-padded, each row's blocks from its
    own first token: prompts of any token length share a step, and a resumed run is still exact."""

    from dlm.rl.step import RLStep

    sft = train_addition_sft(addition, tmp_path / "sft", *layout)
    settings = (f"training.init_from={sft}", "rl.prompts_per_step=4", "rl.group_size=2")
    experiment = rl_config(addition, str(tmp_path / "straight"), *settings).with_absolute_paths()
    step = RLStep(experiment, torch.device("cpu"), "float32", _single())
    lengths = [len(step.prompts.token_ids[index]) for index in step.step_prompts(1)[1]]
    assert len(set(lengths)) > 1  # the step's prompts differ in token length: the rollouts are padded
    assert len(set(step.rollouts(1).pad.tolist())) > 1
    straight = rl(rl_config(addition, str(tmp_path / "straight"), *settings))
    assert straight.status == "complete" and straight.step == 4
    split = rl_config(addition, str(tmp_path / "split"), *settings)
    paused = rl(split, max_run_steps=2)
    resumed = rl(split, resume=paused.checkpoint)
    assert resumed.step == 4
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
