"""Names that a library function accepts and the CLI offers: one `Literal` each, read by both.

The functions that implement these choices import torch; this module does not, so that the CLI
lists the names (`typing.get_args`) without loading torch for `dlm --help` or `dlm pack`. Adding a
name is one edit here plus its implementation in the module named beside it; the CLI follows.
"""

from __future__ import annotations

from typing import Literal

# `dlm.sampling.remasking`: which predictions a denoising step keeps (the built-in names; more can be registered there).
Remasking = Literal["random", "dilated", "confidence", "margin"]
# `dlm.sampling.reverse.reveal_count`: how a block's fixed-count steps share its positions (the noise schedule's
# floor(n m(t)) differences, or LLaDA's even split).
RevealSplit = Literal["schedule", "even"]
# `dlm.sampling.fast`: which keys and values a whole-sequence model reuses within a block (`_FastReverse`).
CacheMode = Literal["none", "prefix", "dual"]
# `dlm.artifacts.export`: the dtype of the exported weights (`EXPORT_DTYPES` maps each to a torch dtype).
ExportDtype = Literal["bfloat16", "float32"]
# `dlm export --format`: dlm's own directory (`dlm.artifacts.export`) or Hugging Face transformers'
# (`dlm.artifacts.hf_export`).
ExportFormat = Literal["dlm", "hf"]
# `dlm.diffusion.objective.elbo_nll`: how a Monte Carlo sample of the ELBO masks a sequence (`ESTIMATORS` there).
ElboEstimator = Literal["bernoulli", "exact-count"]
# `dlm.runtime.device.COMPUTE_DTYPES`: the dtype a loaded model computes in (`dlm serve`, `dlm sample`,
# `dlm bench --generate`; auto: as stored, or as `dlm.runtime.device.inference_dtype` upcasts it).
ComputeDtype = Literal["auto", "float32", "float64", "bfloat16"]
