"""Memory of loading and fine-tuning large models: synthetic bfloat16 model directories, written locally
(nothing is downloaded), then loaded or trained in a fresh process with the peak measured.

- `write DIR --shape llada-8b`: a Hugging Face LLaDA directory, shards of ~2 GiB (--device cuda draws
  the random values faster).
- `load DIR`: `dlm.load` in bfloat16, its peak GPU memory and RSS against the weights' own bytes (the
  loader builds the model on the meta device and takes each weight as its parameter, so the target is
  <= 1.15x on a GPU).
- `lora`: two LoRA rank-16 optimizer steps of configs/llada-8b-lora.toml, the measured peak beside
  `dlm bench --estimate`'s figure for the same config.
Each part is its own process (a peak is the process's), so each writes its own result file
(load-memory-PART.json), or with --out appends its record to the GPU check's JSON lines for
`gpu-report`. The weights are random (normal, std 0.02): memory and time do not depend on their values.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import typer

from benchmarks import harness
from benchmarks.gpu.common import Records, with_commit
from dlm.bench.measure import timed

ROOT = harness.ROOT
# LLaDA-8B's published shape, and smaller ones of the same layout for trying the script on a CPU.
SHAPES: dict[str, dict[str, int]] = {
    "llada-8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464},
    "llada-1b": {"d_model": 2048, "n_layers": 16, "n_heads": 16, "mlp_hidden_size": 5632, "vocab_size": 32000},
    "llada-250m": {"d_model": 1024, "n_layers": 12, "n_heads": 16, "mlp_hidden_size": 2816, "vocab_size": 32000},
    "llada-tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 176, "vocab_size": 512},
}
Shape = Literal["llada-8b", "llada-1b", "llada-250m", "llada-tiny"]  # SHAPES' names
Part = Annotated[
    Literal["write", "load", "lora"],
    typer.Argument(help="write: a synthetic directory; load: it, with dlm.load; lora: two LoRA steps."),
]
SHARD_BYTES = 2 << 30
MASK_ID_OFFSET = 2  # the mask token sits two ids below the vocabulary's end, like LLaDA's 126336 of 126464


def tensor_shapes(shape: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d, ffn, vocab = shape["d_model"], shape["mlp_hidden_size"], shape["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.transformer.wte.weight": (vocab, d)}
    for n in range(shape["n_layers"]):
        p = f"model.transformer.blocks.{n}."
        shapes.update(
            {
                p + "attn_norm.weight": (d,),
                p + "ff_norm.weight": (d,),
                p + "q_proj.weight": (d, d),
                p + "k_proj.weight": (d, d),
                p + "v_proj.weight": (d, d),
                p + "attn_out.weight": (d, d),
                p + "ff_proj.weight": (ffn, d),
                p + "up_proj.weight": (ffn, d),
                p + "ff_out.weight": (d, ffn),
            }
        )
    shapes.update({"model.transformer.ln_f.weight": (d,), "model.transformer.ff_out.weight": (vocab, d)})
    return shapes


def write_tokenizer(directory: Path, vocab: int, mask_id: int) -> None:
    """A word-level tokenizer with exactly `vocab` ids, the end-of-text and mask tokens among them."""

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = [f"w{index}" for index in range(vocab)]
    words[0], words[mask_id] = "<|endoftext|>", "<|mdm_mask|>"
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(words[0], special=True), AddedToken(words[mask_id], special=True)])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def write(directory: Path, shape_name: str, device: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    directory.mkdir(parents=True, exist_ok=False)
    started, generator = time.perf_counter(), torch.Generator(device).manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, size in tensor_shapes(shape).items():
        values = torch.empty(size, device=device, dtype=torch.bfloat16)
        values.normal_(0.0, 0.02, generator=generator) if len(size) > 1 else values.fill_(1.0)
        shard[name] = values.cpu()
        total += values.numel() * 2
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    vocab, mask_id = shape["vocab_size"], shape["vocab_size"] - MASK_ID_OFFSET
    config = {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "d_model": shape["d_model"],
        "n_heads": shape["n_heads"],
        "n_kv_heads": shape["n_heads"],
        "n_layers": shape["n_layers"],
        "mlp_hidden_size": shape["mlp_hidden_size"],
        "vocab_size": vocab,
        "embedding_size": vocab,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 4096,
        "weight_tying": False,
        "include_bias": False,
        "block_type": "llama",
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "rope": True,
        "alibi": False,
        "mask_token_id": mask_id,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_tokenizer(directory, vocab, mask_id)
    return {
        "part": "write",
        "shape": shape_name,
        "weight_bytes": total,
        "shards": len(set(weight_map.values())),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _peak_rss_bytes() -> int:
    from dlm.fileio import GIB
    from dlm.runtime.memory import peak_rss_gib

    return int((peak_rss_gib() or 0.0) * GIB)


def load(directory: Path, device: str) -> dict[str, Any]:
    import dlm
    import dlm.artifacts.loading  # the loader's own imports belong to the baseline
    from dlm.model.transformer import DiffusionTransformer

    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context too: host memory the weights do not cause
    baseline_rss = _peak_rss_bytes()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    loaded: list[DiffusionTransformer] = []
    timing = timed(lambda: loaded.append(dlm.load(directory, device=device, dtype=torch.bfloat16)[0]))
    model = loaded[0]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record: dict[str, Any] = {
        "part": "load",
        "device": device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes,
        "seconds": round(timing.wall_s, 1),
        "peak_rss_over_baseline": _peak_rss_bytes() - baseline_rss,
    }
    record["rss_ratio"] = round(record["peak_rss_over_baseline"] / weight_bytes, 3)
    if device.startswith("cuda"):
        record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        record["gpu_ratio"] = round(record["peak_gpu_bytes"] / weight_bytes, 3)
    tokens = torch.randint(3, model.config.vocab_size - MASK_ID_OFFSET, (1, 64), device=device)
    with torch.inference_mode():
        logits = model(tokens)
    record["logits_finite"] = bool(torch.isfinite(logits.float()).all())
    return record


def lora(device: str, seq_len: int, extra: list[str]) -> dict[str, Any]:
    """Two real optimizer steps of configs/llada-8b-lora.toml (random base: the memory is the same); on
    a CPU (`extra` shrinking the model) only the step's working is checked, not its memory."""

    from dlm.config.schema import load_config
    from dlm.train.distributed import DistributedContext
    from dlm.train.memory import estimate_training_memory
    from dlm.train.step import LogWindow, TrainingStep

    overrides = [
        f"model.max_seq_len={seq_len}",
        "training.gradient_accumulation_steps=2",
        "training.init_from=synthetic",
        f"training.device={device}",
        "training.compile=false",  # eager: compiling an 8B model would cost more than the part's budget
        *extra,
    ]
    experiment = load_config(ROOT / "configs" / "llada-8b-lora.toml", overrides)
    estimate = estimate_training_memory(experiment, "bfloat16")
    # Built on the device itself: a training run draws its weights on the CPU (the same on any device),
    # which for 8B random weights that init_from would replace costs minutes; the memory is the same.
    with torch.device(device):
        step = TrainingStep(experiment, torch.device(device), "bfloat16", DistributedContext())
    step.model.train()
    clean = torch.randint(3, experiment.model.vocab_size - MASK_ID_OFFSET, (1, seq_len), device=device)
    cuda = step.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    window = LogWindow(step.device)

    def two_steps() -> None:
        for _ in range(2):  # the second step holds the AdamW moments from the first
            step.optimizer_step(iter([clean, clean]), window)
        float(window.loss)  # waits for the device

    timing = timed(two_steps)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "part": "lora",
        "device": device,
        "seq_len": seq_len,
        "rank": experiment.training.lora.rank,
        "loss": round(float(window.loss) / max(window.steps, 1), 4),
        "peak_gpu_bytes": peak,
        "estimate_bytes": estimate.total,
        "ratio_to_estimate": None if peak is None else round(peak / estimate.total, 3),
        "seconds_per_step": round(timing.wall_s / 2, 2),
    }


def load_memory(
    part: Part,
    directory: Annotated[Path | None, typer.Argument(help="The synthetic model directory (write, load).")] = None,
    shape: Annotated[Shape, typer.Option(help="write: the model's shape.")] = "llada-8b",
    device: Annotated[str | None, typer.Option(help="Default: cuda for lora, cpu otherwise.")] = None,
    seq_len: Annotated[int, typer.Option(min=1, help="lora: the sequence length.")] = 2048,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="lora: a config override (repeatable; trying it on a CPU).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Append the record to these JSON lines instead of writing a result file.")
    ] = None,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Peak memory of writing, loading (`dlm.load`) and LoRA-training a synthetic LLaDA-shaped model."""

    device = device or ("cuda" if part == "lora" else "cpu")
    overrides = list(set_ or [])
    parameters: dict[str, Any] = {"device": device}
    if part == "lora":
        parameters |= {"seq_len": seq_len, "overrides": overrides}
    else:
        parameters |= {"directory": str(directory)} | ({"shape": shape} if part == "write" else {})
    run = harness.start(f"load-memory-{part}", **parameters)
    run.stamp = with_commit(run.stamp)
    if part == "lora":
        record = lora(device, seq_len, overrides)
    elif directory is None:
        raise typer.BadParameter(f"{part} needs the DIRECTORY", param_hint="DIRECTORY")
    else:
        record = write(directory, shape, device) if part == "write" else load(directory, device)
    if out is not None:
        Records(out, part, run.stamp).add(record)
        return
    path = run.save({key: value for key, value in record.items() if key != "part"}, results=results)
    typer.echo(f"{json.dumps(record)}\nwrote {path}")
