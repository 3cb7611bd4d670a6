"""LoRA against training every weight on the chat copy task, and LoRA's memory estimate against a measurement.

1. The task of tests/test_finetune_task.py (reply with the prompt's four colour words): one model
   pre-trained on its plain text, then per seed a full fine-tune (every weight, the test's 300 steps)
   and a LoRA fine-tune (rank 8 on qkv and out, alpha 32, --lora-steps) from it, each judged by its
   exact replies to the 30 held-out prompts, with its trained parameters and CPU seconds: whether a
   few percent of the parameters learn what all of them do, and at what cost in steps.
2. The memory estimate of a LoRA training step (`dlm.train.memory`) against a small model measured on
   the CPU: weights, gradients and AdamW moments as allocated, and the bytes autograd keeps for the
   backward pass (saved-tensor hooks), for float32, a bfloat16 base and a float32 base under bfloat16.
   The estimate is what decides whether a run fits a GPU, so it is checked where it can be measured.
3. That estimate for configs/llada-8b-lora.toml (an 8B model of LLaDA-8B's shape, meta device only) on
   a 24 GiB GPU, beside the same model with a float32 base and with every weight trained.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import torch
import typer

from benchmarks import harness
from dlm.bench.measure import Timing, saved_for_backward, timed

# What a measured step's parts are called in the result file, and the estimate's fields behind each.
_KINDS = ("weights", "gradients", "optimizer", "kept_for_backward")


def finetune_task() -> ModuleType:
    """The copy task as tests/test_finetune_task.py defines it (it imports its neighbours as top-level modules)."""

    tests = str(harness.ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("test_finetune_task")


def _fine_tune(task: ModuleType, root: Path, name: str, steps: int, settings: tuple[str, ...]) -> tuple[Path, Timing]:
    """One fine-tune of the task's base on its chat data, and its CPU and wall seconds."""

    sft = root / "sft" / "train.bin"
    tuned: list[Path] = []
    timing = timed(lambda: tuned.append(task.run(root, name, sft, sft, steps, *settings)))
    return tuned[0], timing


def copy_task(seeds: list[int], lora_steps: int) -> dict[str, Any]:
    """Exact held-out replies, trained parameters and CPU seconds of a full and a LoRA fine-tune per seed."""

    from dlm.artifacts.checkpoint import load_checkpoint
    from dlm.data.chat_pack import pack_chat
    from dlm.data.pack import pack_corpus
    from dlm.data.tokenizer import train_tokenizer

    task = finetune_task()
    by_seed: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dlm-bench-lora-") as directory:
        root = Path(directory)
        _, held_out = task.write_task(root)
        train_tokenizer([root / "tokenizer.txt"], task.VOCAB_SIZE, root / "tokenizer.json")
        pack_corpus([root / "plain.jsonl"], root / "tokenizer.json", task.SEQ_LEN, root / "plain", val_fraction=0.05)
        pack_chat([root / "chat.jsonl"], root / "tokenizer.json", task.SEQ_LEN, root / "sft")
        base = task.run(root, "base", root / "plain" / "train.bin", root / "plain" / "val.bin", 100)
        base_parameters = sum(t.numel() for t in load_checkpoint(base)["model"].values())
        for seed in seeds:
            for name, steps, extra in (("full", 300, ()), ("lora", lora_steps, task.LORA)):
                settings = (f"training.init_from={base}", f"training.seed={seed}", *extra)
                tuned, timing = _fine_tune(task, root, f"{name}-{seed}", steps, settings)
                trained = sum(t.numel() for t in load_checkpoint(tuned)["model"].values())
                by_seed.setdefault(f"seed_{seed}", {})[name] = {
                    "steps": steps,
                    "trained_parameters": trained,
                    "trained_share": trained / base_parameters,
                    "exact_replies": task.exact_replies(tuned, held_out),
                    "cpu_s": timing.cpu_s,
                    "wall_s": timing.wall_s,
                }
                harness.progress(f"seed {seed}, {name}: {by_seed[f'seed_{seed}'][name]}")
    return {"held_out": len(held_out), "base_parameters": base_parameters, "by_seed": by_seed}


def measured_step(experiment: Any, precision: str) -> dict[str, int]:
    """What one training step of `experiment` allocates on the CPU, by kind."""

    from dlm.train.distributed import DistributedContext
    from dlm.train.step import LogWindow, TrainingStep

    step = TrainingStep(experiment, torch.device("cpu"), precision, DistributedContext())
    step.model.train()
    model = experiment.model
    clean = torch.randint(3, model.vocab_size, (experiment.training.batch_size, model.max_seq_len))
    weights = sum(p.numel() * p.element_size() for p in step.model.parameters())
    kept = saved_for_backward(step.model, lambda: step.optimizer_step(iter([clean]), LogWindow(step.device)))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in step.model.parameters() if p.grad is not None)
    state = step.optimizer.state.values()
    moments = sum(v.numel() * v.element_size() for s in state for k, v in s.items() if k != "step")
    return dict(zip(_KINDS, (weights, grads, moments, kept), strict=True))


def memory_check() -> dict[str, Any]:
    """Measured and estimated bytes of a small LoRA model's training step, by precision and base dtype."""

    from dlm.config.schema import load_config
    from dlm.train.memory import estimate_training_memory

    small = [
        "model.d_model=256",
        "model.n_heads=4",
        "model.max_seq_len=128",
        "model.vocab_size=4096",
        "training.batch_size=4",
        "training.lora.rank=8",
        "training.init_from=base",
    ]
    checked: dict[str, Any] = {}
    for precision, base in (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")):
        overrides = [*small, f"training.precision={precision}", f"training.lora.base_dtype={base}"]
        experiment = load_config(harness.ROOT / "configs" / "tiny.toml", overrides)
        e = estimate_training_memory(experiment, precision)
        estimated = (e.weights, e.gradients, e.optimizer_state, e.activations + e.weight_copies)
        measured = measured_step(experiment, precision)
        checked[f"{precision}_{base}_base"] = {
            kind: {
                "measured": measured[kind],
                "estimated": value,
                "measured_over_estimated": measured[kind] / value if value else None,
            }
            for kind, value in zip(_KINDS, estimated, strict=True)
        }
    return checked


def llada_8b(device_gib: float = 24) -> dict[str, Any]:
    """The estimate of configs/llada-8b-lora.toml and two variants of it on a `device_gib` GPU (GiB)."""

    from dlm.config.schema import load_config
    from dlm.fileio import GIB
    from dlm.train.memory import plan_memory

    variants = {
        "lora_bfloat16_base": [],
        "lora_float32_base": ["training.lora.base_dtype=float32"],
        "every_weight": ["training.lora.rank=0"],
    }
    planned: dict[str, Any] = {}
    for name, overrides in variants.items():
        plan = plan_memory(load_config(harness.ROOT / "configs" / "llada-8b-lora.toml", overrides), device_gib)
        e = plan.estimate
        planned[name] = {
            "trained_parameters": e.trainable if e.trainable is not None else e.parameters,
            "weights_gib": e.weights / GIB,
            "gradients_and_adamw_gib": (e.gradients + e.optimizer_state) / GIB,
            "activations_and_copies_gib": (e.activations + e.weight_copies) / GIB,
            "total_gib": e.total / GIB,
            "fits": plan.fits,
        }
    return {"device_gib": device_gib, "variants": planned}


def _summary(figures: dict[str, Any]) -> list[str]:
    lines = []
    task = figures.get("copy_task")
    if task is not None:
        for seed, arms in task["by_seed"].items():
            for name, arm in arms.items():
                lines.append(
                    f"{seed} {name}: {arm['exact_replies']}/{task['held_out']} exact after {arm['steps']} steps, "
                    f"{arm['trained_share']:.1%} of the parameters trained, {arm['cpu_s']:.0f} CPU s"
                )
    for setting, kinds in figures["memory"].items():
        ratios = ", ".join(f"{kind} {v['estimated'] / v['measured']:.2f}" for kind, v in kinds.items() if v["measured"])
        lines.append(f"{setting}: estimated / measured {ratios}")
    for name, plan in figures["llada_8b"]["variants"].items():
        lines.append(
            f"8B {name}: {plan['total_gib']:.1f} GiB, fits {figures['llada_8b']['device_gib']:g} GiB: {plan['fits']}"
        )
    return lines


def lora(
    seeds: Annotated[str, typer.Option(help="Seeds of the copy task's fine-tunes, comma-separated.")] = "4,5",
    lora_steps: Annotated[int, typer.Option(help="Steps of each LoRA fine-tune (the test's LORA_STEPS).")] = 800,
    skip_task: Annotated[bool, typer.Option(help="Only the memory figures (seconds instead of minutes).")] = False,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """LoRA against a full fine-tune on the chat copy task; LoRA's memory estimate against a measurement, and at 8B."""

    seed_list = [int(seed) for seed in seeds.split(",")]
    run = harness.start("lora", seeds=seed_list, lora_steps=lora_steps, skip_task=skip_task)
    figures: dict[str, Any] = {} if skip_task else {"copy_task": copy_task(seed_list, lora_steps)}
    figures["memory"] = memory_check()
    figures["llada_8b"] = llada_8b()
    path = run.save(figures, results=results)
    for line in _summary(figures):
        typer.echo(line)
    typer.echo(f"wrote {path}")
