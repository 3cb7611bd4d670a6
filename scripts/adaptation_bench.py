"""Adapting an autoregressive model to diffusion against training the same shape from scratch, at
equal total CPU time, in held-out bits/byte.

usage: python scripts/adaptation_bench.py [--ar-seconds S] [--adapt-seconds S] [--out DIR] [--d-model D]
       [--n-layers N] [--mc-samples K] [--eval-batches B] [--json]

1. A byte-level BPE tokenizer and the bundled plays packed at --seq-len (validation: the held-out works).
2. A `LlamaForCausalLM` (transformers' own class, grouped-query attention, tied head) trained with a
   plain next-token loop for --ar-seconds of process CPU time, saved with `save_pretrained`
   (safetensors): an artifact that no dlm code wrote.
3. `dlm train --init-from` that directory: the shape and tokenizer come from it, the attention is made
   bidirectional, and it trains as a masked diffusion model for --adapt-seconds of CPU time.
4. The same shape trained from scratch as a diffusion model for --ar-seconds + --adapt-seconds of CPU
   time (the same config, batches and noise seed as step 3).

The diffusion steps of 3 and 4 cost the same (same shape, batch and length), so their step counts
come from one calibration of the CPU seconds per step; every phase's process CPU time is reported
(`time.process_time`, immune to other work on a shared machine). Both models are scored by `dlm eval`
on the same held-out sequences with the same Monte Carlo noise (ELBO bits/byte, an upper bound);
the autoregressive model's exact next-token bits/byte on them is shown for reference. One thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

# One thread, set before torch starts its pool: idle OpenMP threads spinning on a shared machine
# would be counted as this process's CPU time.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ar-seconds", type=float, default=240.0, help="CPU seconds of autoregressive training")
    parser.add_argument("--adapt-seconds", type=float, default=120.0, help="CPU seconds of diffusion adaptation")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "adaptation-bench")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-kv-heads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--mc-samples", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args(argv)


def prepare_data(args: argparse.Namespace) -> Path:
    from dlm.assets import shakespeare_files
    from dlm.data.pack import pack_corpus
    from dlm.data.tokenizer import train_tokenizer

    data = args.out / "data"
    if not (data / "val.bin").is_file():
        train_tokenizer(shakespeare_files("train"), args.vocab_size, args.out / "tokenizer.json")
        pack_corpus(
            shakespeare_files("train"),
            args.out / "tokenizer.json",
            args.seq_len,
            data,
            val_inputs=shakespeare_files("val"),
            overwrite=True,
        )
    return data


def cosine_lr(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_autoregressive(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """A LlamaForCausalLM trained for --ar-seconds CPU seconds and saved with save_pretrained."""

    from transformers import LlamaConfig, LlamaForCausalLM

    from dlm.data.dataset import load_packed_dataset

    directory = args.out / "ar-llama"
    record = directory / "ar.json"
    if record.is_file():
        return dict(json.loads(record.read_text(encoding="utf-8")))
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.d_model,
        intermediate_size=ffn_size(args),
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    blocks = torch.from_numpy(load_packed_dataset(data, args.seq_len).tokens.astype("int64")).view(-1, args.seq_len)
    generator = torch.Generator().manual_seed(args.seed)
    # Steps are planned from the first steps' cost, so that the schedule decays over the budget.
    start, step, planned = time.process_time(), 0, 10**9
    while time.process_time() - start < args.ar_seconds:
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, planned, args.learning_rate)
        batch = blocks[torch.randint(len(blocks), (args.batch_size,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step == 20:
            planned = int(args.ar_seconds / ((time.process_time() - start) / step))
    seconds = time.process_time() - start
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer.json").write_bytes((args.out / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8")
    result = {"steps": step, "cpu_seconds": seconds, "final_loss": float(loss.detach())}
    record.write_text(json.dumps(result), encoding="utf-8")
    return result


def ffn_size(args: argparse.Namespace) -> int:
    return -(-(8 * args.d_model // 3) // 64) * 64  # dlm's default width, so both runs have one shape


def diffusion_experiment(args: argparse.Namespace, data: Path, run: Path, steps: int, init_from: Path | None) -> Any:
    from dlm.config.schema import ExperimentConfig
    from dlm.train.init_from import adopt_source_model

    model = {
        "vocab_size": args.vocab_size,
        "mask_token_id": 1,
        "max_seq_len": args.seq_len,
        "d_model": args.d_model,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "norm_eps": 1e-6,
        "pad_vocab_multiple": 1,
    }
    training = {
        "tokenizer": args.out / "tokenizer.json",
        "train_data": data / "train.bin",
        "val_data": None,
        "output_dir": run,
        "device": "cpu",
        "precision": "float32",
        "compile": False,
        "seed": args.seed,
        "learning_rate": args.learning_rate,
        "min_learning_rate": args.learning_rate / 10,
        "warmup_steps": min(50, steps - 1),
        "max_steps": steps,
        "batch_size": args.batch_size,
        "log_interval": 50,
        "save_interval": steps,
        "eval_interval": steps,
        "init_from": init_from,
    }
    experiment = ExperimentConfig.model_validate({"model": model, "training": training})
    return adopt_source_model(experiment) if init_from is not None else experiment


def train_diffusion(
    args: argparse.Namespace, data: Path, name: str, steps: int, init_from: Path | None
) -> dict[str, Any]:
    from dlm.train.loop import train

    run = args.out / name
    record = run / "bench.json"
    if record.is_file():
        return dict(json.loads(record.read_text(encoding="utf-8")))
    start, wall = time.process_time(), time.perf_counter()
    result = train(diffusion_experiment(args, data, run, steps, init_from), overwrite=True)
    seconds = time.process_time() - start
    summary = {
        "steps": result.step,
        "cpu_seconds": seconds,
        "wall_seconds": time.perf_counter() - wall,
        "status": result.status,
    }
    record.write_text(json.dumps(summary), encoding="utf-8")
    return summary


def seconds_per_diffusion_step(args: argparse.Namespace, data: Path) -> float:
    """The CPU seconds of one diffusion step of this shape (20 steps, after 5 to warm up)."""

    from dlm.train.loop import train

    warm = diffusion_experiment(args, data, args.out / "calibration", 5, None)
    train(warm, overwrite=True)
    timed = diffusion_experiment(args, data, args.out / "calibration", 25, None)
    start = time.process_time()
    train(timed, overwrite=True)
    return (time.process_time() - start) / 25


def score(source: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    from dlm.evaluation.evaluate import evaluate_source

    report = evaluate_source(
        source,
        data / "val.bin",
        batches=args.eval_batches,
        mc_samples=args.mc_samples,
        batch_size=8,
        precision="float32",
    )
    return {
        "bits_per_byte": report.bits_per_byte,
        "stderr": report.bits_per_byte_stderr,
        "nll": report.nll,
        "sequences": report.sequences,
    }


@torch.no_grad()
def autoregressive_bits_per_byte(args: argparse.Namespace, data: Path, sequences: int) -> float:
    """The AR model's exact next-token bits/byte on the first `sequences` held-out sequences."""

    from transformers import LlamaForCausalLM

    from dlm.data.dataset import load_packed_dataset
    from dlm.data.tokenizer import load_tokenizer, token_byte_lengths

    model = LlamaForCausalLM.from_pretrained(args.out / "ar-llama").float().eval()
    blocks = torch.from_numpy(load_packed_dataset(data / "val.bin").tokens.astype("int64")).view(-1, args.seq_len)
    blocks = blocks[:sequences]
    lengths = torch.from_numpy(token_byte_lengths(load_tokenizer(args.out / "tokenizer.json")))
    nats, scored_bytes = 0.0, 0
    for batch in blocks.split(8):
        logits = model(input_ids=batch).logits[:, :-1]
        targets = batch[:, 1:]
        nats += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
        )
        scored_bytes += int(lengths[targets].sum())
    return nats / scored_bytes / math.log(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args)
    ar = train_autoregressive(args, data)
    per_step = seconds_per_diffusion_step(args, data)
    adapt_steps = max(2, round(args.adapt_seconds / per_step))
    scratch_steps = max(2, round((ar["cpu_seconds"] + args.adapt_seconds) / per_step))
    adapted = train_diffusion(args, data, "adapted", adapt_steps, args.out / "ar-llama")
    scratch = train_diffusion(args, data, "scratch", scratch_steps, None)
    results = {
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds_per_diffusion_step": per_step,
        "autoregressive": ar,
        "adapted": adapted,
        "scratch": scratch,
        "adapted_eval": score(args.out / "adapted", data, args),
        "scratch_eval": score(args.out / "scratch", data, args),
    }
    sequences = int(results["adapted_eval"]["sequences"])
    results["autoregressive_bits_per_byte"] = autoregressive_bits_per_byte(args, data, sequences)
    (args.out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    adapted_cpu = ar["cpu_seconds"] + adapted["cpu_seconds"]
    print("| model | CPU seconds | steps | held-out bits/byte (ELBO bound) |")
    print("|---|---|---|---|")
    print(
        f"| from scratch (diffusion) | {scratch['cpu_seconds']:.0f} | {scratch['steps']} "
        f"| {results['scratch_eval']['bits_per_byte']:.4f} ± {results['scratch_eval']['stderr']:.4f} |"
    )
    print(
        f"| adapted (AR, then diffusion) | {adapted_cpu:.0f} | {ar['steps']} + {adapted['steps']} "
        f"| {results['adapted_eval']['bits_per_byte']:.4f} ± {results['adapted_eval']['stderr']:.4f} |"
    )
    print(
        f"| the AR model itself (exact next-token) | {ar['cpu_seconds']:.0f} | {ar['steps']} "
        f"| {results['autoregressive_bits_per_byte']:.4f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
