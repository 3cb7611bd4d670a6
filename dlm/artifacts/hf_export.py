"""Write the Hugging Face transformers format (`dlm export --format hf`).

An HF export is a directory that `AutoModelForMaskedLM.from_pretrained(dir, trust_remote_code=True)`
and `AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` load without dlm:

    config.json              model_type "dlm_diffusion", auto_map, the shapes; dlm's own settings under "dlm"
    configuration_dlm.py     the config class       } copied from `dlm/artifacts/hf/`: they import
    modeling_dlm.py          the model and sampler  } only torch and transformers
    model.safetensors        the weights under transformers-style names, the tied embedding once
    tokenizer.json           the tokenizer the model was trained with (byte for byte)
    tokenizer_config.json    PreTrainedTokenizerFast with the eos / mask / pad special tokens (and the
                             chat_template of a tokenizer_config.json beside the model's tokenizer)
    special_tokens_map.json
    README.md                how to load and sample it

Writing needs no transformers. `dlm.artifacts.hf.dlm_format` turns the directory back into dlm weights
and a `SourceInfo`, so `dlm.load`, `dlm sample` and `dlm export` accept it too. A block diffusion
model (`[model] block_size`) exports with its block size: the bundled file attends block-causally and
samples block by block, as dlm's inference does. Refused: noise schedules other than linear and
cosine, which the bundled sampler does not implement.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from dlm import __version__
from dlm.artifacts.card_data import export_tokenizer_config
from dlm.artifacts.export import EXPORT_DTYPES, check_export_output
from dlm.artifacts.export_layout import (
    CODE_FILES,
    CONFIG_NAME,
    HF_TOKENIZER_FILES,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    SourceInfo,
    checked_tokenizer,
    is_dlm_export,
)
from dlm.artifacts.hf.dlm_format import MODEL_TYPE, is_hf_export
from dlm.artifacts.hf.names import to_hf_names
from dlm.artifacts.loading import check_weight_shapes, read_model_source
from dlm.config.schema import DiffusionConfig, ModelConfig
from dlm.data.chat import ChatTemplate, Turn, read_config, special_tokens_of
from dlm.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, special_token_id
from dlm.errors import UserError, UserNote, reported_os_errors
from dlm.fileio import share_as_created, swap_directory_into_place, temporary_path

HF_FORMAT = "dlm-hf-v1"
# The schedules modeling_dlm.py's sampler implements (its SCHEDULES; a test keeps them equal).
HF_SCHEDULES = ("linear", "cosine")
AUTO_MAP = {
    "AutoConfig": "configuration_dlm.DlmDiffusionConfig",
    "AutoModel": "modeling_dlm.DlmDiffusionModel",
    "AutoModelForMaskedLM": "modeling_dlm.DlmDiffusionForMaskedLM",
}


# ------------------------------------------------------------------------------------ writing


# Model variant properties the bundled modeling file does not implement, with the value it has.
# (`grouped_query`: fewer key / value heads than query heads.)
HF_VARIANT_DEFAULTS: dict[str, object] = {
    "grouped_query": False,
    "attention_head_dim": None,
    "qkv_bias": False,
    "qk_norm": False,
    "tie_embeddings": True,
    "rope_scaling": None,
    "attention": "bidirectional",
    "shift_logits": False,
}


def check_hf_exportable(model: ModelConfig, diffusion: DiffusionConfig) -> None:
    """Refuse what the bundled modeling file cannot reproduce."""

    values = {**model.model_dump(), "grouped_query": model.kv_heads != model.n_heads}
    differing = [f"{name} = {values[name]}" for name, default in HF_VARIANT_DEFAULTS.items() if values[name] != default]
    if differing:
        raise UserError(
            f"the Hugging Face modeling file implements dlm's own variant only; this model has {', '.join(differing)}",
            fix="export it in dlm's own format (omit --format hf)",
        )
    if diffusion.schedule not in HF_SCHEDULES:
        raise UserError(
            f"the {diffusion.schedule!r} noise schedule has no sampler in the Hugging Face modeling file "
            f"(it has {', '.join(HF_SCHEDULES)})",
            fix="export it in dlm's own format (omit --format hf)",
        )


def hf_config(info: SourceInfo, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json: the transformers fields, and dlm's own settings under "dlm" for the way back."""

    model = info.model
    return {
        "architectures": ["DlmDiffusionForMaskedLM"],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.padded_vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "intermediate_size": model.ffn_size,
        "max_position_embeddings": model.max_seq_len,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.norm_eps,
        "initializer_range": model.init_std,
        "mask_token_id": model.mask_token_id,
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["pad"],
        "schedule": info.diffusion.schedule,
        "block_size": model.block_size,
        "mask_logit": model.mask_logit,  # modeling_dlm.py applies SUBS to its logits when it is "subs"
        "document_separator_id": model.document_separator_id,  # document-aware attention when set
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "dlm": {
            "format": HF_FORMAT,
            "dlm_version": __version__,
            "model": model.model_dump(mode="json"),
            "diffusion": info.diffusion.model_dump(mode="json"),
            "weights": info.weights,
            "step": info.step,
            "tokens_seen": info.tokens_seen,
            "training": info.training,
            "distillation": info.distillation,  # a distilled student's sampling steps travel with it
        },
    }


def tokenizer_files(max_seq_len: int, chat_template: str | None = None) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json declaring dlm's special tokens, and the
    tokenizer's chat_template when it has one (transformers' apply_chat_template and `dlm sample
    --chat` read it there)."""

    special = {
        "eos_token": SPECIAL_TOKENS["eos"],
        "mask_token": SPECIAL_TOKENS["mask"],
        "pad_token": SPECIAL_TOKENS["pad"],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        **({} if chat_template is None else {"chat_template": chat_template}),
    }
    return dict(zip(HF_TOKENIZER_FILES, (config, special), strict=True))


def hf_card(name: str) -> str:
    return "\n".join(
        [
            f"# {name}",
            "",
            "A masked discrete diffusion language model trained with dlm, in the Hugging Face transformers format.",
            "",
            "```python",
            "from transformers import AutoModelForMaskedLM, AutoTokenizer",
            "",
            # transformers 5 loads the stored bfloat16, which a CPU without it emulates (docs/index.md, CPU notes).
            "# On a CPU without native bfloat16 (no AVX512-BF16 or AMX), add dtype=torch.float32, which is",
            "# faster there (torch_dtype= in older transformers).",
            f'model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)',
            # The config's auto_map names dlm's code: without the flag transformers asks before using it.
            f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
            'prompt = tokenizer("ROMEO:", return_tensors="pt").input_ids',
            "ids = model.generate(prompt, max_new_tokens=32, steps=32, seed=0)",
            "print(tokenizer.decode(ids[0]))",
            "```",
            "",
        ]
    )


def _write(
    directory: Path,
    name: str,
    stored: dict[str, Tensor],
    config: dict[str, Any],
    tokenizer: Path,
    chat_template: str | None,
) -> None:
    directory.mkdir()
    save_file(stored, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "dlm_format": HF_FORMAT})
    share_as_created(directory / WEIGHTS_NAME)
    shutil.copyfile(tokenizer, directory / TOKENIZER_NAME)
    for code in CODE_FILES:
        shutil.copyfile(Path(__file__).with_name("hf") / code, directory / code)
    for file_name, content in tokenizer_files(config["max_position_embeddings"], chat_template).items():
        (directory / file_name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    (directory / "README.md").write_text(hf_card(name), encoding="utf-8")
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _check_template_renders_alike(source: Path, template: str, files: dict[str, dict[str, Any]]) -> None:
    """Warn when the template renders otherwise under the export's special tokens than under the
    source config's (e.g. a `bos_token` dlm's vocabulary lacks: declaring it would make transformers
    add a token the model has no embedding for, so the export declares only dlm's own)."""

    probe = [Turn("user", "hi")]
    before = ChatTemplate(template, source, special_tokens_of(read_config(source))).prompt(probe)
    exported = special_tokens_of(files[HF_TOKENIZER_FILES[0]])
    try:
        after: str | None = ChatTemplate(template, source, exported).prompt(probe)
    except UserError:  # e.g. a name the export's config lacks
        after = None
    if after != before:
        warnings.warn(
            f"the chat_template of {source} renders otherwise with the export's special tokens (dlm's "
            f"<|endoftext|>, <|mask|>, <|pad|>) than with its own: {before!r} becomes {after!r}",
            UserNote,
            stacklevel=3,
        )


def export_hf(
    source: str | Path, output: str | Path, dtype: str = "bfloat16", use_ema: bool = True, overwrite: bool = False
) -> Path:
    """Write a Hugging Face directory from a checkpoint, a run dir, a dlm export or an HF export."""

    output = Path(output)
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}", fix=f"use one of {', '.join(EXPORT_DTYPES)}")
    # A dlm export or an HF one may be replaced.
    check_export_output(output, overwrite, lambda path: is_hf_export(path) or is_dlm_export(path), "an export")
    info, weights = read_model_source(source, use_ema)
    check_weight_shapes(info.model, {name: tensor.shape for name, tensor in weights.items()}, info.path)
    check_hf_exportable(info.model, info.diffusion)
    tokenizer = checked_tokenizer(info)
    settings_path, chat_template = export_tokenizer_config(info)
    if settings_path is not None and chat_template is not None:
        _check_template_renders_alike(settings_path, chat_template, tokenizer_files(1, chat_template))

    loaded = load_tokenizer(tokenizer)
    special_ids = {name: special_token_id(loaded, name) for name in SPECIAL_TOKENS}
    stored = {name: t.detach().to("cpu", EXPORT_DTYPES[dtype]).contiguous() for name, t in to_hf_names(weights).items()}
    config = hf_config(info, dtype, special_ids)
    building = temporary_path(output)
    with reported_os_errors("the export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        try:
            _write(building, output.name, stored, config, tokenizer, chat_template)
            swap_directory_into_place(building, output)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return output
