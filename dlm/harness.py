"""lm-evaluation-harness: a dlm model as its `dlm` model type (the `lm-eval` extra).

    pip install 'dlm[lm-eval]'
    python -m dlm.harness --model dlm --model_args pretrained=exported-model/,mc_samples=32 \\
        --tasks lambada_openai --device cpu

lm-eval 0.4 finds models only in its own registry and looks for no plugins, so `dlm` is
registered when this module is imported: `python -m dlm.harness ARGS` is lm-eval's own command
line (`lm_eval ARGS`) with `dlm` known; from Python, `import dlm.harness` before
`lm_eval.simple_evaluate(model="dlm", ...)`, or pass it a `DlmLM`.

`model_args`: `pretrained` (an exported directory, a checkpoint or a run directory, as `dlm.load`
reads), `mc_samples` (Monte Carlo samples per log-likelihood, default 32), `estimator`
(`exact-count` or `bernoulli`), `seed`, `precision`, `ema` (a checkpoint's EMA weights, default
true), and for generation and the greedy check of `loglikelihood` `steps` (default: one per
generated token), `remasking` (default `confidence`), `block_length` and `reveal_split`
(`schedule`, or `even` for LLaDA's split). `batch_size` counts the
requests scored in one forward pass and `device` is cpu, cuda, mps or auto (a CUDA device,
lm-eval's default, falls back to auto on a machine without one). The numbers are
`dlm.evaluation.scoring.Scorer`'s.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from dlm.errors import UserError
from dlm.extras import Requirement, require

LM_EVAL = Requirement("lm_eval", "lm-eval", "evaluating with lm-evaluation-harness")

try:
    require(LM_EVAL)
except UserError as missing:
    if __name__ == "__main__":  # `python -m dlm.harness`: one line for a person, no traceback
        print(f"error: {missing}", file=sys.stderr)
        raise SystemExit(UserError.exit_code) from None
    raise

import torch  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import normalize_gen_kwargs  # noqa: E402

from dlm.artifacts import loading  # noqa: E402
from dlm.data.tokenizer import special_tokens  # noqa: E402
from dlm.evaluation.scoring import Scorer  # noqa: E402
from dlm.runtime.device import resolve_device, resolve_precision  # noqa: E402

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_log = logging.getLogger(__name__)


def _device(requested: str | None) -> torch.device:
    """lm-eval's command line asks for cuda:0 unless told otherwise: without CUDA, as its own
    models do, take the best device there is (`auto`) instead of refusing."""

    if requested and requested.startswith("cuda") and not torch.cuda.is_available():
        _log.warning("device %s: no CUDA device is available, using auto", requested)
        requested = "auto"
    return resolve_device(requested or "auto", "device")


def _flag(name: str, value: Any) -> bool:
    """lm-eval passes model_args as parsed scalars (True) or, from Python, as anything."""

    text = str(value).lower()
    if text not in _TRUE + _FALSE:
        raise UserError(f"model_args {name}={value!r} is not true or false", fix=f"pass {name}=true or {name}=false")
    return text in _TRUE


def _batch_size(value: Any) -> int:
    """lm-eval's --batch_size: a number; `auto` (which would search for one) counts 16."""

    text = str(value)
    if text.startswith("auto"):
        return 16
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"batch_size {value!r} is not a positive number", fix="pass --batch_size 16")
    return int(text)


class DlmLM(TemplateLM):
    """lm-eval's model interface over `dlm.evaluation.scoring.Scorer`; model_args in the module docstring."""

    def __init__(
        self,
        pretrained: str | None = None,
        device: str | None = "auto",
        batch_size: int | str = 16,
        mc_samples: int = 32,
        estimator: str = "exact-count",
        seed: int = 0,
        precision: str = "auto",
        ema: bool | str = True,
        steps: int | None = None,
        remasking: str = "confidence",
        block_length: int | None = None,
        reveal_split: str = "schedule",
        max_batch_size: int | None = None,  # lm-eval passes it; the batch size never searches
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown or pretrained is None:
            what = f"unknown model_args {', '.join(sorted(unknown))}" if unknown else "model_args lacks pretrained"
            raise UserError(
                what,
                fix="pass pretrained=DIR and any of mc_samples, estimator, seed, precision, ema, "
                "steps, remasking, block_length, reveal_split",
            )
        resolved = _device(device)
        # float32 weights: `precision` alone decides the compute dtype (autocast), as in `dlm eval`.
        # Through the module, so that a test can stand in a model for the loader.
        loaded = loading.load_model_with_info(pretrained, resolved, dtype=torch.float32, use_ema=_flag("ema", ema))
        self.info, self._device = loaded.info, resolved
        self.scorer = Scorer(
            loaded.model,
            loaded.tokenizer,
            mc_samples=int(mc_samples),
            estimator=estimator,
            seed=int(seed),
            batch_size=_batch_size(batch_size),
            precision=resolve_precision(precision, resolved),
            mask_eps=loaded.info.diffusion.mask_eps,
            steps=None if steps is None else int(steps),
            remasking=remasking,
            block_length=None if block_length is None else int(block_length),
            reveal_split=reveal_split,  # type: ignore[arg-type]  # SamplingOptions refuses other values
        )

    @property
    def eot_token_id(self) -> int:
        return self.scorer.eos_id

    @property
    def max_length(self) -> int:
        return int(self.scorer.config.max_seq_len)

    @property
    def tokenizer_name(self) -> str:
        return str(self.info.tokenizer_path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids: list[int] = self.scorer.tokenizer.encode(string, add_special_tokens=False).ids
        return ids

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any) -> list[Any]:
        scores = self.scorer.loglikelihood([(context, continuation) for _, context, continuation in requests])
        results = []
        for (key, _, _), score in zip(requests, scores, strict=True):
            result = (score.logprob, score.is_greedy)
            self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [request.args[0] for request in requests]
        values = self.scorer.rolling([self.tok_encode(text) for text in texts])
        for text, value in zip(texts, values, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return values

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = special_tokens(self.scorer.tokenizer)["eos"]
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, 256)
            until = [stop for stop in kwargs.get("until", []) if stop] + [eos]
            text = self.scorer.generate(
                self.tok_encode(context),
                max_tokens=int(kwargs["max_gen_toks"]),
                until=until,
                temperature=float(kwargs.get("temperature", 0.0)),
                top_p=kwargs.get("top_p"),
                top_k=kwargs.get("top_k"),
            )
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs


if __name__ != "__main__":  # run as a script, `main` registers the class of the module imported by name
    register_model("dlm")(DlmLM)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with `dlm` registered; a `UserError` is one `error:` line, exit 2."""

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(UserError.exit_code) from None


if __name__ == "__main__":
    from dlm.harness import main as registered_main

    registered_main()
