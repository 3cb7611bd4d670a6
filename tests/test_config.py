"""Config schema: bounds, cross-field rules, TOML + overrides, shipped configs, generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm.config.reference import config_reference_markdown
from dlm.config.schema import ExperimentConfig, ModelConfig, TrainingConfig, load_config
from dlm.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "experiment.toml"
    path.write_text(text, encoding="utf-8")
    return path


def error_text(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_every_shipped_config_loads() -> None:
    names = {path.stem for path in CONFIGS}
    assert {"tiny", "shakespeare", "gpt2-small", "1b"} <= names
    for path in CONFIGS:
        experiment = load_config(path)
        assert experiment.model.mask_token_id < experiment.model.vocab_size


def test_shipped_sizes_match_their_names() -> None:
    from dlm.model.transformer import DiffusionTransformer

    def params(name: str) -> int:
        model_config = load_config(ROOT / "configs" / f"{name}.toml").model
        import torch

        with torch.device("meta"):
            return DiffusionTransformer(model_config).num_parameters

    assert 100e6 < params("gpt2-small") < 125e6
    assert 1.2e9 < params("1b") < 1.4e9
    assert 10e6 < params("shakespeare") < 20e6


def test_cpu_recipe_builds_and_trains_on_a_cpu() -> None:
    """configs/cpu.toml, the measured CPU recipe: 64-token blocks, about a million parameters, the
    clipped masking range and precision auto (bfloat16 autocast where the CPU has it)."""

    import torch

    from dlm.model.transformer import DiffusionTransformer

    experiment = load_config(ROOT / "configs" / "cpu.toml")
    assert experiment.model.max_seq_len == 64
    training = experiment.training
    assert experiment.diffusion.schedule == "linear"  # the clipped range needs it
    assert (training.clip_mask_min, training.clip_mask_max) == (0.3, 0.8)  # the measured winner
    assert training.device == "cpu" and training.precision == "auto"
    assert experiment.training.warmup_steps < experiment.training.max_steps
    model = DiffusionTransformer(experiment.model)
    assert 1e6 < model.num_parameters < 2e6
    tokens = torch.randint(2, experiment.model.vocab_size, (2, experiment.model.max_seq_len))
    assert model(tokens).shape[:2] == tokens.shape


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("[model]\nd_model = 100\nn_heads = 3\n", "model.n_heads"),
        ("[model]\nd_model = 96\nn_heads = 32\n", "model.n_heads"),  # odd head dim 3
        ("[model]\nvocab_size = 100\nmask_token_id = 100\n", "model.mask_token_id"),
        ("[model]\nvocab_size = 2\n", "model.vocab_size"),
        ("[model]\nmax_seq_len = 1\n", "model.max_seq_len"),
        ("[training]\nwarmup_steps = 10\nmax_steps = 10\n", "training.warmup_steps"),
        ("[training]\nlearning_rate = 1e-4\nmin_learning_rate = 1e-3\n", "training.min_learning_rate"),
        ("[diffusion]\nmask_eps = 1.0\n", "diffusion.mask_eps"),
        ("[diffusion]\nmask_eps = 0\n", "diffusion.mask_eps"),
        ('[diffusion]\nschedule = "sqrt"\n', "diffusion.schedule"),
        ('[training]\ndevice = "cpu"\nprecision = "float16"\n', "training.precision"),
        ('[training]\ndevice = "tpu"\n', "training.device"),
        ('[training]\noptimizer = "sgd"\n', "training.optimizer"),
        ("[training]\nbatch_size = 0\n", "training.batch_size"),
        ("[training]\nlearning_rate = -1\n", "training.learning_rate"),
        ("[training]\nema_decay = 1.5\n", "training.ema_decay"),
        ("[training]\nlerning_rate = 1e-3\n", "training.lerning_rate"),
        ("[modle]\nd_model = 64\n", "modle"),
    ],
)
def test_invalid_field_is_named_with_file_and_fix(tmp_path: Path, toml: str, field: str) -> None:
    path = write(tmp_path, toml)
    message = error_text(path)
    assert str(path) in message
    assert f"{field}:" in message
    assert "fix:" in message
    assert "\n" not in message  # the CLI prints one `error:` line per failure


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nbatch_size = 0\nlearning_rate = -1\n")
    message = error_text(path)
    assert "training.batch_size" in message and "training.learning_rate" in message
    assert "\n" not in message and "invalid config, 2 problems: (1) training." in message
    assert "; (2) training." in message


def test_an_invalid_config_is_one_error_line_and_writes_nothing(tmp_path: Path, run_cli) -> None:
    run_dir = tmp_path / "run"
    path = write(tmp_path, f'[training]\noutput_dir = "{run_dir}"\nbatch_size = 0\n')
    problem = "training.batch_size: Input should be greater than or equal to 1 (got 0)"
    for command in (("train", "--config", path), ("config", "show", path)):
        run_cli(*command).assert_refused(f"error: {path}: invalid config: {problem}; fix: set training.batch_size")
    assert not run_dir.exists()
    several = run_cli("train", "--config", path, "--set", "training.learning_rate=-1")
    several.assert_refused(
        f"error: {path}: invalid config, 2 problems: (1) training.learning_rate: ", f"; (2) {problem}"
    )
    assert not run_dir.exists()


def test_overrides_are_parsed_with_the_field_type(tmp_path: Path) -> None:
    path = write(tmp_path, '[training]\nval_data = "v.bin"\n')
    experiment = load_config(
        path,
        [
            "training.learning_rate=1e-3",
            "training.max_steps=777",
            "training.save_inference_checkpoint=false",
            "training.val_data=none",
            "training.compile=true",
            "model.rope_theta=500000",
            "training.device=cpu",
        ],
    )
    training = experiment.training
    assert training.learning_rate == pytest.approx(1e-3)
    assert training.max_steps == 777 and isinstance(training.max_steps, int)
    assert training.save_inference_checkpoint is False
    assert training.val_data is None
    assert training.compile is True
    assert training.device == "cpu"
    assert experiment.model.rope_theta == 500000.0


@pytest.mark.parametrize("override", ["training.nope=1", "nosection.x=1", "training.max_steps", "x=1"])
def test_bad_override_is_a_user_error(tmp_path: Path, override: str) -> None:
    path = write(tmp_path, "")
    message = error_text(path, [override])
    assert override.split("=")[0] in message or "section.field=value" in message


def test_override_value_of_wrong_type_names_field(tmp_path: Path) -> None:
    message = error_text(write(tmp_path, ""), ["training.max_steps=many"])
    assert "training.max_steps" in message and "'many'" in message


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    assert "not found" in error_text(tmp_path / "absent.toml")
    assert "not valid TOML" in error_text(write(tmp_path, "[model\n"))


def test_json_round_trip_and_absolute_paths(tmp_path: Path) -> None:
    experiment = load_config(ROOT / "configs" / "tiny.toml")
    again = ExperimentConfig.from_dict(experiment.to_dict())
    assert again == experiment
    absolute = experiment.with_absolute_paths()
    assert absolute.training.output_dir.is_absolute()
    assert absolute.training.val_data is not None and absolute.training.val_data.is_absolute()
    json_path = tmp_path / "config.json"
    import json

    json_path.write_text(json.dumps(absolute.to_dict()), encoding="utf-8")
    assert load_config(json_path) == absolute


def test_derived_sizes() -> None:
    model = ModelConfig(d_model=768, n_heads=12, vocab_size=50257)
    assert model.head_dim == 64
    assert model.ffn_size % 64 == 0 and model.ffn_size >= 8 * 768 // 3
    assert model.padded_vocab_size == 50304
    assert TrainingConfig().compile == "auto"


def test_configuration_reference_is_current() -> None:
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == config_reference_markdown(), "run: dlm config docs --output docs/configuration.md"
