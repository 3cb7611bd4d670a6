"""The README.md of an export: what the model is, how it was trained and evaluated, how to use it.

`dlm.artifacts.export` writes it beside the weights; `dlm.artifacts.card_data` gives it the run's
title, data and a usage prompt.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from dlm import __version__
from dlm.artifacts.card_data import card_title, data_lines, usage_prompt
from dlm.artifacts.eval_report import eval_report_problem
from dlm.artifacts.events import ValidationEvent, read_events
from dlm.artifacts.export_layout import SourceInfo
from dlm.artifacts.hf.foreign import SOURCE_KIND
from dlm.artifacts.run_dir import RunDir
from dlm.config.schema import ModelConfig
from dlm.config.shapes import format_parameter_count
from dlm.errors import UserNote


def _last_validation(run_dir: Path) -> ValidationEvent | None:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return None
    validations = [event for event in read_events(path) if isinstance(event, ValidationEvent)]
    return validations[-1] if validations else None


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value  # metrics.jsonl writes a non-finite loss as null


def eval_figures(run_dir: Path | None) -> list[str]:
    """Markdown lines of the run's evaluation figures, if it has any."""

    if run_dir is None:
        return []
    lines = []
    validation = _last_validation(run_dir)
    if validation is not None:
        lines.append(
            f"- validation at step {validation.step}: masked CE {_or_nan(validation.loss):.4f} nats, "
            f"masked accuracy {_or_nan(validation.masked_accuracy):.3f} (fixed noise levels)"
        )
    try:
        report = json.loads(RunDir(run_dir).eval_report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        report = None
    if isinstance(report, dict) and (problem := eval_report_problem(report)) is not None:
        path = RunDir(run_dir).eval_report
        warnings.warn(f"{path}: a damaged eval report ({problem}); left out of the model card", UserNote, stacklevel=2)
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


def _progress_line(info: SourceInfo) -> str:
    """Steps and tokens seen; a Hugging Face directory without dlm's record (`"dlm"` null, empty or
    absent, as transformers may save it) knows neither, and the card says so rather than guessing."""

    facts = [f"{info.step} optimizer steps"] if info.step is not None else []
    facts += [f"{info.tokens_seen:,} tokens seen"] if info.tokens_seen is not None else []
    return "- " + (", ".join(facts) if facts else "optimizer steps and tokens seen not recorded")


def _kind_line(model: ModelConfig, origin: str) -> str:
    """The card's first sentence: what kind of model this is, and where it came from."""

    if model.is_autoregressive:
        return (
            f"An autoregressive language model (causal attention, one token at a time), {origin}: the "
            "baseline of dlm's diffusion models, sampled one forward pass per token."
        )
    kind = f"A masked discrete diffusion language model (MDLM / LLaDA family) {origin}"
    return kind + (
        "; its attention is causal, as imported: adapt it before sampling." if model.attention == "causal" else "."
    )


def model_card(info: SourceInfo, config: dict[str, Any], figures: list[str]) -> str:
    """The README.md of an export: what the model is, how it was trained, how to use it."""

    model, training = info.model, info.training
    name, prompt = config["name"], usage_prompt(info)
    origin = f"trained with dlm {__version__}"
    if info.kind == SOURCE_KIND:
        origin = f"imported by dlm {__version__} from the Hugging Face directory `{info.path.name}`"
    heads = f"{model.n_heads} heads"
    heads += f" ({model.kv_heads} key / value heads)" if model.kv_heads != model.n_heads else ""
    lines = [
        f"# {card_title(info, format_parameter_count(config['parameters']))}",
        "",
        _kind_line(model, origin),
        "",
        "## Model",
        "",
        f"- {format_parameter_count(config['parameters'])} parameters: {model.n_layers} layers, d_model "
        f"{model.d_model}, {heads}, rotary positions, "
        + ("tied embedding / output head" if model.tie_embeddings else "separate output head"),
        f"- vocabulary {model.vocab_size} (byte-level BPE, `tokenizer.json`), context {model.max_seq_len} tokens",
        f"- weights: {info.weights} ({'exponential moving average' if info.weights == 'ema' else 'as trained'}), "
        f"stored as {config['dtype']}",
        "",
        "## Training",
        "",
        _progress_line(info),
    ]
    if training:
        lines.append(
            f"- {training.get('optimizer')} lr {_rounded(training.get('learning_rate'))} (warmup "
            f"{training.get('warmup_steps')}, cosine to {_rounded(training.get('min_learning_rate'))}), batch "
            f"{training.get('batch_size')} x {training.get('gradient_accumulation_steps')} accumulation, "
            f"{training.get('precision')} precision, "
            f"seed {training.get('seed')}"
        )
    lines.append(f"- {info.diffusion.schedule} noise schedule, diffusion times in [{info.diffusion.mask_eps}, 1]")
    lines += _distillation_lines(info.distillation)
    lines += ["", "## Data", ""] + (data_lines(info) or ["The run's packed data could not be read at export time."])
    lines += ["", "## Evaluation", ""] + (figures or ["No evaluation figures were recorded for this run."])
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import dlm",
        "",
        f'model, tokenizer = dlm.load("{name}")',
        f'print(dlm.sample(model, tokenizer, prompt="{prompt}", length=32).texts[0])',
        "```",
        "",
        "```bash",
        f'dlm sample {name} --prompt "{prompt}" --length 32',
        f"dlm eval {name} --data DATA_DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def _rounded(value: Any) -> str:
    """A rate as a person writes it: 7.5e-05, not the 7.500000000000001e-05 a division leaves."""

    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _distillation_lines(record: dict[str, Any] | None) -> list[str]:
    """The card's word on a distilled student: what it was distilled for, and from which teacher."""

    if record is None:
        return []
    teacher = record.get("teacher_sha256")
    if record.get("method") == "certainty":
        return [
            f"- trained by certainty forcing (entropy weight {record.get('certainty_weight')}) for sampling with "
            f"`--threshold`, from a teacher sampling in {record.get('teacher_steps')} steps"
            + (f"; teacher weights sha256 `{teacher[:16]}`" if teacher else "")
        ]
    return [
        f"- distilled ({record.get('method')}, {record.get('divergence')}) from a teacher sampling in "
        f"{record.get('teacher_steps')} steps to **{record['steps']} sampling steps**, which `dlm sample`, "
        "`dlm serve`, `dlm bench --generate` and the lm-eval harness default to"
        + (f"; teacher weights sha256 `{teacher[:16]}`" if teacher else "")
    ]
