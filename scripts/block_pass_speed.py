"""Forward + backward time of a block model's 2L training pass against the pass that computes every
position in every layer (the pass before the last layer was cut to the noisy copy), interleaved.

usage: python scripts/block_pass_speed.py [--config configs/shakespeare-ar.toml] [--batch 4] [--rounds 10]
                                          [--threads N] [--json]

Both passes run on the same synthetic batch and weights (float32, CPU, the config's model). Each is
warmed up twice, then they alternate (who goes first alternates too), so both see the same load from
other work. Printed: the median seconds of each, their ratio (how many more steps per second the
trimmed pass trains: the median over rounds of each round's ratio) and the difference of their losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "shakespeare-ar.toml")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="timed passes of each kind")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F
    from torch import Tensor

    from dlm.config.schema import load_config
    from dlm.diffusion.objective import corrupt_tokens, diffusion_cross_entropy
    from dlm.model.attention import AttentionMask, _bd3_bool
    from dlm.model.denoiser import masked_logits
    from dlm.model.transformer import DiffusionTransformer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, ["training.device=cpu"]).model
    if not config.is_block_model:
        raise SystemExit(f"{args.config} is not a block model ([model] block_size)")
    torch.manual_seed(0)
    model = DiffusionTransformer(config).train()
    length, size = config.max_seq_len, config.block_size
    clean = torch.randint(2, config.vocab_size, (args.batch, length), generator=torch.Generator().manual_seed(1))
    times = torch.rand(args.batch, -(-length // size), generator=torch.Generator().manual_seed(2))
    corruption = corrupt_tokens(
        clean, config.mask_token_id, times, 1e-3, torch.Generator().manual_seed(3), block_size=size
    )

    def every_position(noisy: Tensor, mask: Tensor, tokens: Tensor) -> Tensor:
        cos, sin = (table[:length].float().repeat(2, 1) for table in (model.rope_cos, model.rope_sin))
        attention = AttentionMask("sdpa-mask", _bd3_bool(length, size, noisy.device))
        x = model.token_embedding(torch.cat((noisy, tokens), 1))
        for block in model.blocks:
            x = block(x, cos, sin, attention)
        x = model.norm(x[:, :length])[mask]
        return F.linear(x, model.token_embedding.weight)[..., : config.vocab_size]

    passes = {"trimmed": lambda n, m, c: masked_logits(model, n, m, c), "every position": every_position}
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    losses: dict[str, float] = {}

    def run(name: str) -> float:
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logits = passes[name](corruption.noisy_tokens, corruption.mask, clean)
        loss = diffusion_cross_entropy(logits, clean, corruption).loss
        loss.backward()
        elapsed = time.perf_counter() - started
        losses[name] = float(loss.detach())
        return elapsed

    for name in passes:
        run(name), run(name)
    order = list(passes)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            seconds[name].append(run(name))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    # The median of each round's ratio: a round's two passes see nearly the same load.
    ratios = [full / trimmed for full, trimmed in zip(seconds["every position"], seconds["trimmed"], strict=True)]
    result = {
        "config": str(args.config),
        "block_size": size,
        "batch": args.batch,
        "seq_len": length,
        "threads": torch.get_num_threads(),
        "median_seconds": medians,
        "speedup": statistics.median(ratios),
        "loss_difference": abs(losses["trimmed"] - losses["every position"]),
        "rounds": [round(ratio, 3) for ratio in ratios],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in medians.items():
            print(f"{name:>15}: {value:.4f} s per forward + backward")
        print(
            f"speedup {result['speedup']:.3f}x (rounds: {result['rounds']}), "
            f"loss difference {result['loss_difference']:.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
