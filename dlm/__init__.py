"""dlm: masked discrete diffusion language models, from raw text to a trained, exported model.

The library is importable without the CLI. Heavy modules (torch) load lazily so that
`dlm --help` stays fast:

    import dlm
    model, tokenizer = dlm.load("exported-model/")
    print(dlm.sample(model, tokenizer, prompt="ROMEO:", length=64).texts[0])
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load", "sample"]


def load(path: Any, device: Any = "cpu") -> Any:
    """Load an exported model directory (or checkpoint): returns (model, tokenizer).

    The model records the noise schedule it was trained with, which `sample` then follows.
    """

    from dlm.loading import load_model

    return load_model(path, device=device)


def sample(model: Any, tokenizer: Any, **options: Any) -> Any:
    """Generate text with the reverse diffusion process; see `dlm.sampling.generate`."""

    from dlm.sampling import generate

    return generate(model, tokenizer, **options)
