"""The LoRA figures of docs/benchmarks.md: the chat copy task, and the memory estimate against a measurement.

1. The task of `tests/test_finetune_task.py` (repeat four colour words): one pre-trained model, then per
   seed a full fine-tune (every weight, the test's 300 steps) and a LoRA fine-tune (rank 8 on qkv and
   out, alpha 32, `--lora-steps`), each with its exact replies to the 30 held-out prompts, its trained
   parameters and its CPU seconds (`time.process_time`).
2. The memory estimate of a LoRA training step (`dlm.train.memory`) against a small model measured on
   the CPU: weights, gradients and AdamW moments as allocated, and the bytes autograd keeps for the
   backward pass (saved-tensor hooks), for float32, a bfloat16 base and a float32 base under bfloat16.
3. The estimate of `configs/llada-8b-lora.toml` (an 8B model of LLaDA-8B's shape, meta device only) on a
   24 GiB GPU, beside the same model with a float32 base and with every weight trained.

    python scripts/lora_figures.py --seeds 4 5 --lora-steps 800
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.config.schema import ExperimentConfig, load_config
from dlm.data.chat_pack import pack_chat
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import train_tokenizer
from dlm.fileio import GIB
from dlm.train.distributed import DistributedContext
from dlm.train.memory import estimate_training_memory, plan_memory
from dlm.train.step import LogWindow, TrainingStep

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_finetune_task as task  # the task as the tests define it  # noqa: E402


def copy_task(seeds: list[int], lora_steps: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        _, held_out = task.write_task(root)
        train_tokenizer([root / "tokenizer.txt"], task.VOCAB_SIZE, root / "tokenizer.json")
        pack_corpus([root / "plain.jsonl"], root / "tokenizer.json", task.SEQ_LEN, root / "plain", val_fraction=0.05)
        pack_chat([root / "chat.jsonl"], root / "tokenizer.json", task.SEQ_LEN, root / "sft")
        base = task.run(root, "base", root / "plain" / "train.bin", root / "plain" / "val.bin", 100)
        base_parameters = sum(t.numel() for t in load_checkpoint(base)["model"].values())
        print("| seed | fine-tune | steps | trained parameters | exact replies | CPU s |\n|---|---|---|---|---|---|")
        for seed in seeds:
            for name, steps, extra in (("full", 300, ()), ("LoRA", lora_steps, task.LORA)):
                started = time.process_time()
                sft = root / "sft" / "train.bin"
                tuned = task.run(
                    root,
                    f"{name}-{seed}",
                    sft,
                    sft,
                    steps,
                    f"training.init_from={base}",
                    f"training.seed={seed}",
                    *extra,
                )
                seconds = time.process_time() - started
                trained = sum(t.numel() for t in load_checkpoint(tuned)["model"].values())
                share = f"{trained:,} ({trained / base_parameters:.1%})"
                hits = task.exact_replies(tuned, held_out)
                print(f"| {seed} | {name} | {steps} | {share} | {hits}/30 | {seconds:.0f} |", flush=True)


def measured_step(experiment: ExperimentConfig, precision: str) -> dict[str, int]:
    """What one training step of `experiment` allocates on the CPU, by kind."""

    step = TrainingStep(experiment, torch.device("cpu"), precision, DistributedContext())
    step.model.train()
    model = experiment.model
    clean = torch.randint(3, model.vocab_size, (experiment.training.batch_size, model.max_seq_len))
    parameters = {p.untyped_storage().data_ptr() for p in step.model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    weights = sum(p.numel() * p.element_size() for p in step.model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step.optimizer_step(iter([clean]), LogWindow(step.device))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in step.model.parameters() if p.grad is not None)
    state = step.optimizer.state.values()
    moments = sum(v.numel() * v.element_size() for s in state for k, v in s.items() if k != "step")
    return {"weights": weights, "gradients": grads, "optimizer": moments, "kept for backward": sum(kept.values())}


def memory_check() -> None:
    small = [
        "model.d_model=256",
        "model.n_heads=4",
        "model.max_seq_len=128",
        "model.vocab_size=4096",
        "training.batch_size=4",
        "training.lora.rank=8",
        "training.init_from=base",
    ]
    print("\n| precision | base | kind | measured bytes | estimated bytes |\n|---|---|---|---|---|")
    for precision, base in (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")):
        overrides = [*small, f"training.precision={precision}", f"training.lora.base_dtype={base}"]
        experiment = load_config(ROOT / "configs" / "tiny.toml", overrides)
        estimate = estimate_training_memory(experiment, precision)
        estimated = {
            "weights": estimate.weights,
            "gradients": estimate.gradients,
            "optimizer": estimate.optimizer_state,
            "kept for backward": estimate.activations + estimate.weight_copies,
        }
        for kind, measured in measured_step(experiment, precision).items():
            print(f"| {precision} | {base} | {kind} | {measured:,} | {estimated[kind]:,} |")


def llada_8b() -> None:
    lora = load_config(ROOT / "configs" / "llada-8b-lora.toml")
    variants = {
        "LoRA, bfloat16 base": [],
        "LoRA, float32 base": ["training.lora.base_dtype=float32"],
        "every weight (AdamW)": ["training.lora.rank=0"],
    }
    print("\n| 8B run | trained | weights | gradients + AdamW | activations + copies | total | fits 24 GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, overrides in variants.items():
        experiment = load_config(ROOT / "configs" / "llada-8b-lora.toml", overrides) if overrides else lora
        plan = plan_memory(experiment, 24)
        e = plan.estimate
        trained = e.trainable if e.trainable is not None else e.parameters
        print(
            f"| {name} | {trained / 1e6:,.1f}M | {e.weights / GIB:.1f} GiB | "
            f"{(e.gradients + e.optimizer_state) / GIB:.1f} GiB | {(e.activations + e.weight_copies) / GIB:.1f} GiB "
            f"| {e.total / GIB:.1f} GiB | {'yes' if plan.fits else 'no'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[4, 5])
    parser.add_argument("--lora-steps", type=int, default=task.LORA_STEPS)
    parser.add_argument("--skip-task", action="store_true", help="Only the memory figures.")
    args = parser.parse_args()
    if not args.skip_task:
        copy_task(args.seeds, args.lora_steps)
    memory_check()
    llada_8b()


if __name__ == "__main__":
    main()
