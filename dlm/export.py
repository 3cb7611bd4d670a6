"""Export a trained model to a self-contained directory, and load any model source without pickle.

An exported directory holds everything needed to use the model on another machine:

    model.safetensors   the weights (bf16 or fp32), each storage written once
    config.json         format "dlm-export-v1", model and diffusion config, step, tokenizer sha256, ...
    tokenizer.json      the exact tokenizer the model was trained with (hash checked)
    README.md           a short model card: how it was trained, eval figures, how to load it

`load_model` reads an exported directory, a training checkpoint, an inference checkpoint or a run
directory (its `latest.pt`); checkpoints go through `dlm.checkpoint.load_checkpoint`
(`weights_only=True`) and exports through safetensors, so no path ever unpickles code. The model
it returns carries its noise schedule (`dlm.schedule.model_schedule`), which sampling uses; an
export written before the `[diffusion]` section existed was trained with the linear schedule.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from tokenizers import Tokenizer
from torch import Tensor

from dlm import __version__
from dlm.checkpoint import INFERENCE_FORMAT, TRAINING_FORMAT, load_checkpoint
from dlm.choices import ExportDtype
from dlm.config import DiffusionConfig, ExperimentConfig, ModelConfig, format_validation_error
from dlm.corpus import temporary_path
from dlm.errors import UserError, check_can_create, reported_os_errors
from dlm.model import DiffusionTransformer, format_parameter_count
from dlm.schedule import attach_schedule
from dlm.tokenizer import load_tokenizer, tokenizer_sha256

EXPORT_FORMAT = "dlm-export-v1"
WEIGHTS_NAME, CONFIG_NAME, TOKENIZER_NAME, CARD_NAME = "model.safetensors", "config.json", "tokenizer.json", "README.md"
EVAL_NAME = "eval.json"  # what `dlm eval --output` writes; a run dir's copy feeds the model card
EXPORT_DTYPES: dict[ExportDtype, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Machine-specific paths stay out of an export (they mean nothing elsewhere and leak home dirs).
_PATH_FIELDS = ("tokenizer", "train_data", "val_data", "output_dir")


@dataclass
class SourceInfo:
    """What is known about a model source besides its weights."""

    path: Path  # the checkpoint file or the exported directory actually read
    kind: str  # "training" | "inference" | "export"
    model: ModelConfig
    weights: str  # "ema" | "live"
    step: int | None
    tokens_seen: int | None
    tokenizer_sha256: str
    tokenizer_path: Path  # where the tokenizer should be (checked when it is loaded)
    diffusion: DiffusionConfig  # the noise schedule and mask_eps the model was trained with
    experiment: ExperimentConfig | None = None  # full config: checkpoints only
    training: dict[str, Any] = field(default_factory=dict)  # path-free training settings

    @property
    def run_dir(self) -> Path | None:
        """The run directory a checkpoint lives in (its metrics feed the model card)."""

        return None if self.kind == "export" else self.path.parent

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "weights": self.weights,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


@dataclass
class LoadedModel:
    """A model ready for inference, its tokenizer, and where it came from."""

    model: DiffusionTransformer
    tokenizer: Tokenizer
    info: SourceInfo


# ------------------------------------------------------------------------------------ reading


def _training_settings(experiment: ExperimentConfig) -> dict[str, Any]:
    return {k: v for k, v in experiment.training.model_dump(mode="json").items() if k not in _PATH_FIELDS}


def _checkpoint_weights(checkpoint: dict[str, Any], path: Path, use_ema: bool) -> tuple[dict[str, Tensor], str]:
    """The model weights of a checkpoint: EMA when present and wanted, else the live ones."""

    weights = dict(checkpoint["model"])
    if checkpoint["format"] == INFERENCE_FORMAT:
        stored = str(checkpoint.get("weights", "live"))
        if stored == "ema" and not use_ema:
            raise UserError(
                "this inference checkpoint holds only the EMA weights",
                path=path,
                fix="use latest.pt (the training checkpoint) for the live weights, or keep --ema",
            )
        return weights, stored
    ema = checkpoint.get("ema")
    if not use_ema or ema is None:
        return weights, "live"
    shadow = ema["shadow"]
    if unknown := sorted(set(shadow) - set(weights)):
        raise UserError(f"the EMA weights name tensors the model lacks ({unknown[:3]})", path=path)
    for name, value in shadow.items():
        weights[name] = value.to(weights[name].dtype)
    return weights, "ema"


def _read_checkpoint(path: Path, use_ema: bool) -> tuple[SourceInfo, dict[str, Tensor]]:
    checkpoint = load_checkpoint(path)
    if path.is_dir():
        path = path / "latest.pt"
    required = ("config", "model", "step", "tokens_seen", "tokenizer_sha256")
    if missing := [key for key in required if key not in checkpoint]:
        raise UserError(f"damaged checkpoint: it lacks {', '.join(missing)}", path=path)
    experiment = ExperimentConfig.from_dict(checkpoint["config"], source=path)
    weights, kind = _checkpoint_weights(checkpoint, path, use_ema)
    info = SourceInfo(
        path=path,
        kind="training" if checkpoint["format"] == TRAINING_FORMAT else "inference",
        model=experiment.model,
        weights=kind,
        step=int(checkpoint["step"]),
        tokens_seen=int(checkpoint["tokens_seen"]),
        tokenizer_sha256=str(checkpoint["tokenizer_sha256"]),
        tokenizer_path=Path(experiment.training.tokenizer),
        diffusion=experiment.diffusion,
        experiment=experiment,
        training=_training_settings(experiment),
    )
    return info, weights


def read_export_config(directory: str | Path) -> dict[str, Any]:
    """The `config.json` of an exported directory, refused unless it is a dlm export."""

    path = Path(directory) / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"no {CONFIG_NAME} here, so this is not an exported dlm model", path=directory) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"unreadable {CONFIG_NAME}: {exc}", path=path) from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise UserError(
            f"not a dlm export: {CONFIG_NAME} lacks format {EXPORT_FORMAT!r}",
            path=path,
            fix="pass a directory written by `dlm export`, a checkpoint or a run directory",
        )
    return config


def _export_diffusion(config: dict[str, Any]) -> DiffusionConfig:
    """The `[diffusion]` settings of an export; older exports hold only a training mask_eps, and
    were trained with the linear schedule (the only one there was)."""

    if "diffusion" in config:
        return DiffusionConfig.model_validate(config["diffusion"])
    legacy = config.get("training", {}).get("mask_eps")
    return DiffusionConfig() if legacy is None else DiffusionConfig(mask_eps=legacy)


def _read_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_export_config(directory)
    try:
        model_config = ModelConfig.model_validate(config["model"])
        diffusion = _export_diffusion(config)
        weights = load_file(str(directory / WEIGHTS_NAME), device="cpu")
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=directory / CONFIG_NAME) from None
    except (KeyError, OSError, SafetensorError) as exc:
        raise UserError(f"damaged export: {exc}", path=directory, fix="export the checkpoint again") from None
    for alias, canonical in config.get("tied", {}).items():
        weights[alias] = weights[canonical]  # re-tie what was stored once
    info = SourceInfo(
        path=directory,
        kind="export",
        model=model_config,
        weights=str(config.get("weights", "live")),
        step=config.get("step"),
        tokens_seen=config.get("tokens_seen"),
        tokenizer_sha256=str(config.get("tokenizer_sha256", "")),
        tokenizer_path=directory / TOKENIZER_NAME,
        diffusion=diffusion,
        training=dict(config.get("training", {})),
    )
    return info, weights


def read_model_source(path: str | Path, use_ema: bool = True) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and CPU weights of an exported dir, a checkpoint file or a run dir (its latest.pt)."""

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent  # the weights file of an export: the directory is the model
    if path.is_dir() and (path / WEIGHTS_NAME).exists():
        return _read_export(path)
    return _read_checkpoint(path, use_ema)


# ------------------------------------------------------------------------------------ building


def _check_weights(expected: dict[str, Tensor], weights: dict[str, Tensor], source: Path) -> None:
    """Refuse weights whose names or shapes do not fit the model config, naming a few of each."""

    missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = [n for n in expected.keys() & weights.keys() if tuple(expected[n].shape) != tuple(weights[n].shape)]
    if missing or extra or wrong:
        raise UserError(
            f"the weights do not fit the model config (missing {missing[:3]}, unexpected {extra[:3]}, "
            f"wrong shape {sorted(wrong)[:3]})",
            path=source,
            fix="the file was written by another model or dlm version; export it again",
        )


def build_model(
    config: ModelConfig,
    weights: dict[str, Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    source: Path = Path("<weights>"),
) -> DiffusionTransformer:
    """A model in eval mode on `device` holding `weights`; `dtype` None keeps the stored float dtype."""

    if dtype is None:
        dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
    # Built directly on the device. Its random init is wasted, but building on the meta device
    # instead would import torch._dynamo (seconds) for the meta kernels of the init functions.
    # MPS lacks the float64 the rotary tables are computed in: build on the CPU and move.
    device = torch.device(device)
    with torch.device("cpu" if device.type == "mps" else device):
        model = DiffusionTransformer(config)
    _check_weights(model.state_dict(), weights, source)
    with torch.no_grad():
        for parameter in model.parameters():  # parameters only: the rotary tables stay float32
            parameter.data = parameter.data.to(dtype)
        model.load_state_dict(weights, strict=True)
    return model.to(device).eval()


def _checked_tokenizer(info: SourceInfo) -> Path:
    path = info.tokenizer_path
    if not path.is_file():
        raise UserError(
            "the tokenizer the model was trained with is missing",
            path=path,
            fix="restore that file (the checkpoint records its sha256), or work on the machine that trained it",
        )
    if tokenizer_sha256(path) != info.tokenizer_sha256:
        raise UserError(
            f"the tokenizer file changed since training (sha256 differs from the one {info.path} records)",
            path=path,
            fix="restore the tokenizer the model was trained with",
        )
    return path


def load_model_with_info(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> LoadedModel:
    """Model (eval mode, on `device`), checked tokenizer and metadata of any model source."""

    info, weights = read_model_source(path, use_ema)
    tokenizer = load_tokenizer(_checked_tokenizer(info))
    model = build_model(info.model, weights, device, dtype, source=info.path)
    attach_schedule(model, info.diffusion.schedule)
    return LoadedModel(model, tokenizer, info)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> tuple[DiffusionTransformer, Tokenizer]:
    """(model, tokenizer) from an exported dir, a checkpoint or a run dir; no pickle involved."""

    loaded = load_model_with_info(path, device, dtype, use_ema)
    return loaded.model, loaded.tokenizer


# ------------------------------------------------------------------------------------ exporting


def _store_once(weights: dict[str, Tensor], dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Cast floating tensors to `dtype`, keeping each shared storage once (safetensors refuses
    aliases); returns the tensors to store and {alias: stored name} to re-tie on load."""

    stored: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(weights):
        tensor = weights[name]
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        value = tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        stored[name] = value.contiguous()
    return stored, tied


def _check_output(output: Path, overwrite: bool) -> None:
    check_can_create(output, "--output")
    if not output.exists():
        return
    if not overwrite:
        raise UserError("output already exists", path=output, fix="pass --overwrite to replace it, or pick another")
    if not output.is_dir():
        raise UserError("output exists and is not a directory", path=output, fix="choose another --output")
    # --overwrite deletes the old directory, so it must be one of ours, never a user's folder.
    if not (output / CONFIG_NAME).is_file():
        raise UserError(
            "output is not a dlm export, refusing to replace it", path=output, fix="choose another --output"
        )
    read_export_config(output)


def _last_validation(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash; the rest of the file is still good
        if isinstance(event, dict) and event.get("event") == "validation":
            last = event
    return last


def _eval_figures(run_dir: Path | None) -> list[str]:
    """Markdown lines of the run's evaluation figures, if it has any."""

    if run_dir is None:
        return []
    lines = []
    validation = _last_validation(run_dir)
    if validation is not None:
        lines.append(
            f"- validation at step {validation.get('step')}: masked CE {validation.get('loss', math.nan):.4f} nats, "
            f"masked accuracy {validation.get('masked_accuracy', math.nan):.3f} (fixed noise levels)"
        )
    try:
        report = json.loads((run_dir / EVAL_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        report = None
    if isinstance(report, dict) and isinstance(report.get("nll"), (int, float)):
        step = (report.get("context") or {}).get("step")
        stderr, bpb = report.get("nll_stderr"), report.get("bits_per_byte")
        text = f"- `dlm eval` at step {step}: ELBO NLL {report['nll']:.4f} nats/token"
        text += f" (± {stderr:.4f})" if isinstance(stderr, (int, float)) else ""
        text += f", perplexity <= {math.exp(min(report['nll'], 700.0)):.2f}"
        text += f", {bpb:.4f} bits per byte" if isinstance(bpb, (int, float)) else ""
        lines.append(text)
    return lines


def model_card(info: SourceInfo, config: dict[str, Any], figures: list[str]) -> str:
    """The README.md of an export: what the model is, how it was trained, how to use it."""

    model, training = info.model, info.training
    name = config["name"]
    lines = [
        f"# {name}",
        "",
        f"A masked discrete diffusion language model (MDLM / LLaDA family) trained with dlm {__version__}.",
        "",
        "## Model",
        "",
        f"- {format_parameter_count(config['parameters'])} parameters: {model.n_layers} layers, d_model "
        f"{model.d_model}, {model.n_heads} heads, rotary positions, tied embedding / output head",
        f"- vocabulary {model.vocab_size} (byte-level BPE, `tokenizer.json`), context {model.max_seq_len} tokens",
        f"- weights: {info.weights} ({'exponential moving average' if info.weights == 'ema' else 'as trained'}), "
        f"stored as {config['dtype']}",
        "",
        "## Training",
        "",
        f"- {info.step} optimizer steps, {info.tokens_seen:,} tokens seen",
    ]
    if training:
        lines.append(
            f"- {training.get('optimizer')} lr {training.get('learning_rate')} (warmup {training.get('warmup_steps')}, "
            f"cosine to {training.get('min_learning_rate')}), batch {training.get('batch_size')} x "
            f"{training.get('gradient_accumulation_steps')} accumulation, {training.get('precision')} precision, "
            f"seed {training.get('seed')}"
        )
    lines.append(f"- {info.diffusion.schedule} noise schedule, diffusion times in [{info.diffusion.mask_eps}, 1]")
    lines += ["", "## Evaluation", ""] + (figures or ["No evaluation figures were recorded for this run."])
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import dlm",
        "",
        f'model, tokenizer = dlm.load("{name}")',
        'print(dlm.sample(model, tokenizer, prompt="ROMEO:", length=32).texts[0])',
        "```",
        "",
        "```bash",
        f'dlm sample {name} --prompt "ROMEO:" --length 32',
        f"dlm eval {name} --data DATA_DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def _write_export(
    directory: Path, stored: dict[str, Tensor], config: dict[str, Any], card: str, tokenizer: Path
) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(stored, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "dlm_format": EXPORT_FORMAT})
    shutil.copyfile(tokenizer, directory / TOKENIZER_NAME)
    (directory / CARD_NAME).write_text(card, encoding="utf-8")
    # config.json last: it is what marks the directory as a complete export.
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _swap_into_place(built: Path, output: Path) -> None:
    """Rename the finished directory to `output`, replacing an old export only at the very end."""

    if not output.exists():
        built.rename(output)
        return
    retired = output.with_name(f".{output.name}.old-{os.getpid()}")
    output.rename(retired)
    try:
        built.rename(output)
    except OSError:
        retired.rename(output)  # put the old export back rather than leave nothing
        raise
    shutil.rmtree(retired)


def export_model(
    source: str | Path,
    output: str | Path,
    dtype: ExportDtype = "bfloat16",
    use_ema: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write an exported model directory from a training / inference checkpoint or a run dir."""

    output = Path(output)
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}", fix=f"use one of {', '.join(EXPORT_DTYPES)}")
    _check_output(output, overwrite)
    info, weights = read_model_source(source, use_ema)
    if info.kind == "export":
        raise UserError("this is already an exported model", path=info.path, fix="copy the directory instead")
    tokenizer = _checked_tokenizer(info)
    stored, tied = _store_once(weights, EXPORT_DTYPES[dtype])
    config = {
        "format": EXPORT_FORMAT,
        "name": output.name,
        "dlm_version": __version__,
        "model": info.model.model_dump(mode="json"),
        "diffusion": info.diffusion.model_dump(mode="json"),
        "parameters": sum(t.numel() for t in stored.values()),
        "dtype": dtype,
        "weights": info.weights,
        "step": info.step,
        "tokens_seen": info.tokens_seen,
        "tokenizer_sha256": info.tokenizer_sha256,
        "tied": tied,
        "training": info.training,
        "source": {"kind": info.kind, "file": info.path.name},
    }
    card = model_card(info, config, _eval_figures(info.run_dir))
    building = temporary_path(output)
    # A full disk or a file size limit fails the build, never the old export: it is replaced last.
    with reported_os_errors("the export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)  # leftovers of a killed export with our pid
        try:
            _write_export(building, stored, config, card, tokenizer)
            _swap_into_place(building, output)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return output
