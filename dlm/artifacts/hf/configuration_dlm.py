"""Configuration of a dlm masked diffusion model for Hugging Face transformers.

Shipped inside every `dlm export --format hf` directory next to `modeling_dlm.py`, so it imports
only transformers: the directory must load where dlm is not installed. The names follow the usual
transformers conventions (hidden_size, num_hidden_layers, ...); `dlm.artifacts.hf_export` maps them from
dlm's `[model]` settings.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

# Noise schedules the bundled sampler reproduces: the names of dlm's `[diffusion] schedule`.
SCHEDULES = ("linear", "cosine")


class DlmDiffusionConfig(PretrainedConfig):
    """Shapes of the transformer, its block size, its special tokens and its noise schedule."""

    model_type = "dlm_diffusion"

    def __init__(
        self,
        vocab_size: int = 8192,
        padded_vocab_size: int | None = None,
        hidden_size: int = 384,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 6,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 256,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        mask_token_id: int = 1,
        eos_token_id: int = 0,
        pad_token_id: int = 2,
        schedule: str = "linear",
        block_size: int = 0,
        document_separator_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        # The embedding's rows rounded up for fast matmuls; the extra rows are never predicted.
        self.padded_vocab_size = padded_vocab_size or vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.mask_token_id = mask_token_id
        self.schedule = schedule
        # Block diffusion: blocks of this many positions attend causally across blocks; 0 (or the
        # whole sequence) is plain bidirectional masked diffusion.
        self.block_size = block_size
        # Document-aware attention: a position attends only to keys of its own document, the
        # documents of a row being closed by this token (None: the whole row is one document).
        self.document_separator_id = document_separator_id
        # The output head is the embedding itself (there is no separate lm_head weight).
        kwargs["tie_word_embeddings"] = True
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
