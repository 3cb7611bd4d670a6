"""dlm: masked discrete diffusion language models, from raw text to a trained, exported model.

The library is importable without the CLI. Heavy modules (torch) load lazily so that
`dlm --help` stays fast:

    import dlm
    model, tokenizer = dlm.load("exported-model/")
    print(dlm.sample(model, tokenizer, prompt="ROMEO:", length=64).texts[0])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when a function is called
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    from dlm.model.denoiser import Denoiser
    from dlm.model.transformer import DiffusionTransformer
    from dlm.sampling.options import SampleResult

__version__ = "0.17.0"
__all__ = ["__version__", "load", "sample"]


def load(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[DiffusionTransformer, Tokenizer]:
    """Load an exported model directory (or checkpoint): returns (model, tokenizer).

    `dtype` None keeps the stored dtype (bfloat16 weights stay bfloat16), except on a CPU without
    native bfloat16 (no AVX512-BF16 or AMX), or for float16 weights without AMX-FP16, where a model
    of up to 2^30 parameters computes in float32, which is faster there; pass `dtype=` to choose. The
    model records the noise schedule it was trained with, which `sample` then follows.
    """

    from dlm.artifacts.loading import load_model

    return load_model(path, device=device, dtype=dtype)


def sample(model: Denoiser, tokenizer: Tokenizer, **options: Any) -> SampleResult:
    """Generate text with the reverse diffusion process; see `dlm.sampling.generation.generate` for the options."""

    from dlm.sampling.generation import generate

    return generate(model, tokenizer, **options)
