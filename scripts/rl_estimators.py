"""The likelihood estimators of `dlm rl` side by side on one model and one batch of its rollouts.

For each estimator at the same forward passes per estimate, the per-sequence variance of the
completion log-likelihood estimate (over repeated draws, averaged over the rows) and its mean:

    python scripts/rl_estimators.py MODEL --prompts PROMPTS.jsonl [--passes 2] [--repeats 32]
"""

from __future__ import annotations

import argparse
import json

import torch

from dlm.artifacts.loading import load_model_with_info
from dlm.data.tokenizer import never_sampled_ids
from dlm.diffusion.policy_likelihood import estimator_names, get_estimator, score_draws
from dlm.model.denoiser import block_size
from dlm.rl.prompts import completion_length, read_prompts
from dlm.rl.rollouts import sample_rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--rows", type=int, default=8, help="prompts, each sampled --group times")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2, help="forward passes per estimate, for every estimator")
    parser.add_argument("--repeats", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model_with_info(args.model)
    model, config = loaded.model, loaded.model.config
    prompts = read_prompts(args.prompts, loaded.tokenizer, loaded.info.tokenizer_path, args.rows)
    length = completion_length(prompts, config.max_seq_len, None, slides=bool(block_size(config)))
    rollouts = sample_rollouts(
        model,
        loaded.tokenizer,
        prompts,
        list(range(len(prompts))),
        group_size=args.group,
        length=length,
        seeds=list(range(len(prompts))),
        options={"steps": args.steps, "top_p": None},
    )
    forbidden = torch.tensor(sorted({config.mask_token_id, *never_sampled_ids(loaded.tokenizer, config.vocab_size)}))
    rows = rollouts.tokens.shape[0]
    keywords = {"pad": rollouts.pad} if bool(rollouts.pad.any()) else {}

    def logits_of(noisy: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        return model(noisy, output_positions=scored, **keywords)

    results = {}
    for name in estimator_names():
        spec = get_estimator(name)
        if spec.needs_token_blocks and block_size(config) != 1:
            continue
        samples = max(1, args.passes // spec.passes_per_sample)
        generators = [torch.Generator().manual_seed(row) for row in range(rows)]
        estimates = []
        with torch.no_grad():
            for _ in range(args.repeats):
                draws = spec.draw(
                    rollouts.tokens,
                    rollouts.prompt,
                    rollouts.completion,
                    config.mask_token_id,
                    generators,
                    samples=samples,
                    prompt_mask_probability=0.15,
                )
                estimates.append(score_draws(logits_of, rollouts.tokens, draws, forbidden).per_sequence(rows))
        stacked = torch.stack(estimates)  # [repeats, rows]
        results[name] = {
            "passes": samples * spec.passes_per_sample,
            "mean_log_likelihood": float(stacked.mean()),
            "per_sequence_variance": float(stacked.var(dim=0).mean()),
        }
    baseline = results["one-step"]["per_sequence_variance"]
    for entry in results.values():
        entry["variance_vs_one_step"] = entry["per_sequence_variance"] / baseline if baseline else None
    print(json.dumps({"model": args.model, "rows": rows, "completion_tokens": length, "estimators": results}, indent=2))


if __name__ == "__main__":
    main()
