"""Cross-field rules of the experiment config, each declared once.

A `Rule` names the field it is reported on, the statement `docs/configuration.md` prints, the check
and the fix; `dlm.config`'s validators raise the first broken rule as a `FieldProblem`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from dlm.runtime.support import FLOAT16_CPU_FIX, fused_attention_problem, precision_problem


class FieldProblem(ValueError):
    """A cross-field rule broken by one field, with the fix a user should apply."""

    def __init__(self, field: str, message: str, fix: str):
        self.field, self.problem, self.fix = field, message, fix
        super().__init__(f"{field}: {message}; fix: {fix}")


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, declared once: it validates its section and writes its line of the reference."""

    field: str  # the field a broken rule is reported on
    statement: str  # what must hold, as docs/configuration.md says it
    problem: Callable[[Any], str | None]  # what is wrong with a section that breaks the rule, else None
    fix: str


def check_rules(section: BaseModel, rules: tuple[Rule, ...]) -> None:
    """Raise the first broken rule, naming its field and its fix."""

    for rule in rules:
        problem = rule.problem(section)
        if problem is not None:
            raise FieldProblem(rule.field, problem, rule.fix)


MODEL_RULES = (
    Rule(
        "n_heads",
        "`model.d_model` is divisible by `model.n_heads` (unless `model.attention_head_dim` is set)",
        lambda m: (
            f"d_model ({m.d_model}) is not divisible by n_heads ({m.n_heads})"
            if m.d_model % m.n_heads and m.attention_head_dim is None
            else None
        ),
        "choose n_heads that divides d_model",
    ),
    Rule(
        "n_kv_heads",
        "`model.n_kv_heads`, when set, divides `model.n_heads` (grouped-query attention)",
        lambda m: (
            f"n_heads ({m.n_heads}) is not a multiple of n_kv_heads ({m.n_kv_heads})"
            if m.n_kv_heads and m.n_heads % m.n_kv_heads
            else None
        ),
        "choose n_kv_heads that divides n_heads",
    ),
    Rule(
        "n_heads",
        "`model.d_model / model.n_heads`, the head dimension, is even (rotary embeddings)",
        lambda m: (
            f"head dimension d_model / n_heads = {m.head_dim} is odd; rotary embeddings need it even"
            if m.head_dim % 2
            else None
        ),
        "choose n_heads so that d_model / n_heads is even (64 or 128 is fastest on GPUs)",
    ),
    Rule(
        "block_size",
        "`model.block_size`, when nonzero, divides `model.max_seq_len`",
        lambda m: (
            f"max_seq_len ({m.max_seq_len}) is not a multiple of block_size ({m.block_size})"
            if m.block_size and m.max_seq_len % m.block_size
            else None
        ),
        "choose a block_size that divides max_seq_len, or 0 for the whole sequence",
    ),
    Rule(
        "attention",
        '`model.attention = "causal"` needs `model.block_size` 0 (an imported model) or 1 (autoregressive); '
        "`model.shift_logits` needs `model.block_size = 0`",
        lambda m: (
            f"attention {m.attention!r} / shift_logits {m.shift_logits} with block_size {m.block_size}"
            if (m.block_size > 1 and m.attention == "causal") or (m.block_size and m.shift_logits)
            else None
        ),
        'set block_size = 1 for an autoregressive model, or attention = "bidirectional" and shift_logits = false '
        "for a block model",
    ),
    Rule(
        "mask_logit",
        '`model.mask_logit = "subs"` needs a diffusion model, not an autoregressive one (causal, block_size 1)',
        lambda m: "subs with an autoregressive model" if m.is_autoregressive and m.mask_logit == "subs" else None,
        'set mask_logit = "plain": an autoregressive position never sees the token it predicts',
    ),
    Rule(
        "mask_token_id",
        "`model.mask_token_id` < `model.vocab_size`",
        lambda m: (
            f"{m.mask_token_id} is not below vocab_size ({m.vocab_size})" if m.mask_token_id >= m.vocab_size else None
        ),
        "use the id printed by `dlm tokenizer train`",
    ),
    Rule(
        "document_separator_id",
        "`model.document_separator_id`, when set, is below `model.vocab_size` and is not `model.mask_token_id`",
        lambda m: (
            None
            if m.document_separator_id is None
            or (m.document_separator_id < m.vocab_size and m.document_separator_id != m.mask_token_id)
            else f"{m.document_separator_id} is not a token that ends documents"
        ),
        "use the end-of-document id (0 for dlm's tokenizers; `dlm validate` prints the tokenizer's), or leave it unset",
    ),
)

TRAINING_RULES = (
    Rule(
        "warmup_steps",
        "`training.warmup_steps` < `training.max_steps`",
        lambda t: f"{t.warmup_steps} is not below max_steps ({t.max_steps})" if t.warmup_steps >= t.max_steps else None,
        "shorten the warmup or train longer",
    ),
    Rule(
        "min_learning_rate",
        "`training.min_learning_rate` <= `training.learning_rate`",
        lambda t: (
            f"{t.min_learning_rate} is above learning_rate ({t.learning_rate})"
            if t.min_learning_rate > t.learning_rate
            else None
        ),
        "set min_learning_rate <= learning_rate",
    ),
    Rule(
        "precision",
        '`training.precision = "float16"` is refused on the CPU',
        lambda t: precision_problem(t.precision, t.device),
        FLOAT16_CPU_FIX,
    ),
    Rule(
        "require_fused_attention",
        "`training.require_fused_attention` needs a CUDA device (or `auto`)",
        lambda t: fused_attention_problem(t.device) if t.require_fused_attention else None,
        "set require_fused_attention = false or train on a CUDA device",
    ),
    Rule(
        "clip_mask_min",
        "`training.clip_mask_min` < `training.clip_mask_max`",
        lambda t: (
            f"{t.clip_mask_min} is not below clip_mask_max ({t.clip_mask_max})"
            if t.clip_mask_min >= t.clip_mask_max
            else None
        ),
        "use e.g. clip_mask_min = 0.3, clip_mask_max = 0.8",
    ),
    Rule(
        "masking",
        '`training.masking = "exact-count"` draws counts over the whole range: no clipped range',
        lambda t: (
            "exact-count masking with clip_mask_min / clip_mask_max other than 0 and 1"
            if t.masking == "exact-count" and (t.clip_mask_min, t.clip_mask_max) != (0.0, 1.0)
            else None
        ),
        'set masking = "bernoulli" to clip the range, or clip_mask_min = 0 and clip_mask_max = 1',
    ),
    Rule(
        "async_checkpoint",
        '`training.async_checkpoint = true` needs `training.checkpoint_format` "dcp" or "auto"',
        lambda t: (
            "asynchronous saves are written by torch.distributed.checkpoint, not as a single file"
            if t.async_checkpoint and t.checkpoint_format == "single"
            else None
        ),
        'set checkpoint_format = "dcp" (or "auto"), or async_checkpoint = false',
    ),
    Rule(
        "lora",
        "`[training.lora]` adapters train on a trained model: they need `training.init_from`",
        lambda t: "rank > 0 without training.init_from" if t.lora.enabled and t.init_from is None else None,
        "set training.init_from to the model to adapt (an export, a checkpoint or a run directory), "
        "or training.lora.rank = 0 to train every weight",
    ),
    Rule(
        "lora",
        '`training.lora.base_dtype = "bfloat16"` needs `training.precision = "bfloat16"`',
        lambda t: (
            f"base_dtype bfloat16 with precision {t.precision}"
            if t.lora.enabled and t.lora.base_dtype == "bfloat16" and t.precision != "bfloat16"
            else None
        ),
        'set training.precision = "bfloat16", or training.lora.base_dtype = "float32"',
    ),
    Rule(
        "lora",
        '`[training.lora]` runs under `training.parallelism = "ddp"` (FSDP would shard frozen and trained '
        "weights alike)",
        lambda t: "adapters with parallelism fsdp" if t.lora.enabled and t.parallelism == "fsdp" else None,
        'set training.parallelism = "ddp" (the frozen weights need no optimizer state to shard)',
    ),
    Rule(
        "lora",
        "`[training.lora]` checkpoints are single files (the adapters and the base's checksum)",
        lambda t: (
            "adapters with sharded or asynchronous checkpoints"
            if t.lora.enabled and (t.checkpoint_format == "dcp" or t.async_checkpoint)
            else None
        ),
        'set training.checkpoint_format = "single" (or "auto") and async_checkpoint = false',
    ),
)

# Rules across sections; `field` is then the section a broken rule is reported on.
EXPERIMENT_RULES = (
    Rule(
        "training",
        "`training.attention_anneal_steps` needs a bidirectional whole-sequence model "
        '(`model.attention = "bidirectional"`, `model.block_size = 0`), the attention it anneals to',
        lambda e: (
            f"attention_anneal_steps {e.training.attention_anneal_steps} with attention {e.model.attention!r}, "
            f"block_size {e.model.block_size}"
            if e.training.attention_anneal_steps and (e.model.attention != "bidirectional" or e.model.block_size)
            else None
        ),
        'set [model] attention = "bidirectional" and block_size = 0, or attention_anneal_steps = 0',
    ),
    Rule(
        "training",
        '`training.clip_mask_min` / `clip_mask_max` other than 0 and 1 need `diffusion.schedule = "linear"`, '
        "the one schedule whose time is the mask probability",
        lambda e: (
            "clip_mask_min / clip_mask_max need the linear schedule"
            if (e.training.clip_mask_min, e.training.clip_mask_max) != (0.0, 1.0) and e.diffusion.schedule != "linear"
            else None
        ),
        'set [diffusion] schedule = "linear", or the clipped range to 0 and 1',
    ),
    Rule(
        "distill",
        "a `[distill]` run starts its student from trained weights (`training.init_from`: `dlm distill` sets "
        "the teacher), runs `training.max_steps` = `distill.rounds` x `distill.steps_per_round`, and distils a "
        "diffusion model with all its weights "
        "(not an autoregressive model, which already writes one token per pass, nor LoRA adapters)",
        lambda e: _distill_problem(e),
        "let `dlm distill` write the config, or set training.init_from to the teacher and max_steps to rounds x "
        "steps_per_round",
    ),
    Rule(
        "rl",
        "an `[rl]` run starts from trained weights (`training.init_from`: a dlm export, checkpoint, run or "
        "imported model) and is not also a `[distill]` run",
        lambda e: _rl_problem(e),
        "set training.init_from to the model to improve (dlm rl --init-from MODEL), and remove [distill]",
    ),
)


def _rl_problem(experiment: Any) -> str | None:
    if experiment.rl is None:
        return None
    if experiment.distill is not None:
        return "a run either distils ([distill]) or trains with rewards ([rl]), not both"
    if experiment.training.init_from is None:
        return "an [rl] run improves a trained model: training.init_from is not set"
    return None


def _distill_problem(experiment: Any) -> str | None:
    distill, training = experiment.distill, experiment.training
    if distill is None:
        return None
    if training.init_from is None:
        return "training.init_from is not set: the student would start from random weights"
    if training.max_steps != distill.rounds * distill.steps_per_round:
        return (
            f"training.max_steps {training.max_steps} is not rounds x steps_per_round "
            f"({distill.rounds} x {distill.steps_per_round})"
        )
    if experiment.model.is_autoregressive:
        return "the model is autoregressive (block_size 1, causal attention)"
    if training.lora.enabled:
        return "a LoRA run (training.lora.rank > 0)"
    return None
