"""`dlm rl`'s likelihood estimators against each other, and RL against more SFT on the same minutes.

rl-estimators: one model and one batch of its rollouts, every estimator at the same forward passes
per estimate. What RL's gradient inherits from an estimator is its noise, so the figure is the
per-sequence variance of the completion log-likelihood estimate over repeated draws (averaged over
the rows), as a ratio to diffu-GRPO's one-step estimate; the mean says how far each sits from the
others (the one-step estimate is biased, the ELBO a lower bound).

rl-learning: does RL beat simply training longer? From one SFT model, each seed spends --minutes on
RL (`dlm rl`, configs/addition-rl.toml) on one core while the same minutes go to more SFT
(`dlm train --init-from`, configs/addition-sft.toml) on the other, side by side so both meet the same
machine. Every model, the start included, is then judged on the held-out prompts (`dlm eval
--prompts`, pass@1); the spread over seeds says whether the gap is more than the seed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks import harness
from dlm.bench.measure import Timing, spread, timed, timed_process


def _draw_estimates(
    spec: Any,
    rollouts: Any,
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    forbidden: torch.Tensor,
    mask_token_id: int,
    samples: int,
    repeats: int,
) -> tuple[torch.Tensor, Timing]:
    """`repeats` independent estimates of every rollout's completion log-likelihood ([repeats, rows]), timed.

    Row r draws from its own generator seeded r, so every estimator sees the same stream of seeds."""

    from dlm.diffusion.policy_likelihood import score_draws

    batch = rollouts.tokens.shape[0]
    generators = [torch.Generator().manual_seed(row) for row in range(batch)]
    estimates: list[torch.Tensor] = []

    def draw_all() -> None:
        with torch.no_grad():
            for _ in range(repeats):
                draws = spec.draw(
                    rollouts.tokens,
                    rollouts.prompt,
                    rollouts.completion,
                    mask_token_id,
                    generators,
                    samples=samples,
                    prompt_mask_probability=0.15,
                )
                estimates.append(score_draws(logits_of, rollouts.tokens, draws, forbidden).per_sequence(batch))

    timing = timed(draw_all)
    return torch.stack(estimates), timing


def rl_estimators(
    model: Annotated[Path, typer.Option(help="The model whose rollouts are scored (an SFT run or export).")] = Path(
        "runs/addition-sft"
    ),
    prompts: Annotated[Path, typer.Option(help="Prompts JSONL (`dlm task ... --output` writes them).")] = Path(
        "data/addition/heldout.jsonl"
    ),
    rows: Annotated[int, typer.Option(help="Prompts, each sampled --group times.")] = 8,
    group: Annotated[int, typer.Option(help="Rollouts per prompt.")] = 8,
    passes: Annotated[int, typer.Option(help="Forward passes per estimate, for every estimator.")] = 2,
    repeats: Annotated[int, typer.Option(help="Independent draws of each estimate.")] = 32,
    steps: Annotated[int, typer.Option(help="Sampling steps of the rollouts.")] = 8,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Per-sequence variance and mean of each likelihood estimator at equal forward passes, one batch of rollouts."""

    from dlm.artifacts.loading import load_model_with_info
    from dlm.data.tokenizer import never_sampled_ids
    from dlm.diffusion.policy_likelihood import estimator_names, get_estimator
    from dlm.model.denoiser import block_size
    from dlm.rl.prompts import completion_length, read_prompts
    from dlm.rl.rollouts import sample_rollouts

    run = harness.start(
        "rl-estimators",
        model=str(model),
        prompts=str(prompts),
        rows=rows,
        group=group,
        passes=passes,
        repeats=repeats,
        steps=steps,
    )
    torch.set_num_threads(1)
    loaded = load_model_with_info(model, device="cpu")
    network, config = loaded.model, loaded.model.config
    prompt_set = read_prompts(prompts, loaded.tokenizer, loaded.info.tokenizer_path, rows)
    length = completion_length(prompt_set, config.max_seq_len, None, slides=bool(block_size(config)))
    rollouts = sample_rollouts(
        network,
        loaded.tokenizer,
        prompt_set,
        list(range(len(prompt_set))),
        group_size=group,
        length=length,
        seeds=list(range(len(prompt_set))),
        options={"steps": steps, "top_p": None},
    )
    forbidden = torch.tensor(sorted({config.mask_token_id, *never_sampled_ids(loaded.tokenizer, config.vocab_size)}))
    batch = rollouts.tokens.shape[0]
    keywords = {"pad": rollouts.pad} if bool(rollouts.pad.any()) else {}

    def logits_of(noisy: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        return network(noisy, output_positions=scored, **keywords)

    estimators: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, list[float]]] = {}
    for name in estimator_names():
        spec = get_estimator(name)
        if spec.needs_token_blocks and block_size(config) != 1:
            continue  # exact only where every token is its own block
        samples = max(1, passes // spec.passes_per_sample)
        stacked, timing = _draw_estimates(spec, rollouts, logits_of, forbidden, config.mask_token_id, samples, repeats)
        key = name.replace("-", "_")
        estimators[key] = {
            "passes": samples * spec.passes_per_sample,
            "mean_log_likelihood": float(stacked.mean()),
            "per_sequence_variance": float(stacked.var(dim=0).mean()),
            "cpu_s_per_estimate": timing.cpu_s / repeats,
        }
        raw[key] = {"row_mean": stacked.mean(dim=0).tolist(), "row_variance": stacked.var(dim=0).tolist()}
        harness.progress(f"{name}: variance {estimators[key]['per_sequence_variance']:.4g}")
    baseline = estimators["one_step"]["per_sequence_variance"]
    for entry in estimators.values():
        entry["variance_vs_one_step"] = entry["per_sequence_variance"] / baseline if baseline else None
    figures = {"rows": batch, "completion_tokens": length, "estimators": estimators}
    path = run.save(figures, raw, results=results)
    for key, entry in estimators.items():
        ratio = entry["variance_vs_one_step"]
        typer.echo(
            f"{key:>9} ({entry['passes']} passes): mean {entry['mean_log_likelihood']:.2f} nats, "
            f"variance {entry['per_sequence_variance']:.4g}" + (f" ({ratio:.3f} x one-step)" if ratio else "")
        )
    typer.echo(f"wrote {path}")


def _dlm(*args: object, core: int | None = None) -> subprocess.Popen[str]:
    """A `dlm` command started in the background, pinned to one core when `core` is given."""

    command = [sys.executable, "-m", "dlm", *map(str, args)]
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_all(processes: list[subprocess.Popen[str]]) -> None:
    """Wait for every process (none is left running when another fails), then raise on the first that failed."""

    errors = [process.communicate()[1] for process in processes]
    for process, err in zip(processes, errors, strict=True):
        if process.returncode:
            raise RuntimeError(f"{process.args!r} failed ({process.returncode}):\n{err}")


def _accuracy(model: Path, heldout: Path, samples: int, limit: int, temperature: float) -> dict[str, float]:
    """Held-out pass@1 of a model and its standard error over prompts (`dlm eval --prompts`, 8 sampler steps)."""

    args = ["eval", model, "--prompts", heldout, "--samples", samples, "--limit", limit, "--device", "cpu"]
    args += ["--steps", 8, "--temperature", temperature, "--json"]
    _, out = timed_process([sys.executable, "-m", "dlm", *map(str, args)])
    report = json.loads(out)
    return {"pass_at_1": report["pass_at"]["1"], "stderr": report["stderr"]["1"]}


def _over_seeds(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    deviation = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "stderr_over_seeds": deviation / math.sqrt(len(values)), **spread(values)}


def _arm_command(
    arm: str,
    paths: tuple[Path, Path, Path, Path],
    seed: int,
    temperature: float,
    overrides: tuple[list[str], list[str]],
) -> list[object]:
    """The `dlm rl` (arm `rl:ESTIMATOR`) or `dlm train` (arm `sft`) arguments of one run, before --minutes."""

    sft, task, packed, output = paths
    directory = output / f"{arm.replace(':', '-')}-{seed}"
    if arm == "sft":
        more: list[object] = ["train", "--config", harness.ROOT / "configs" / "addition-sft.toml", "--init-from", sft]
        more += ["--set", f"training.train_data={packed / 'train.bin'}"]
        more += ["--set", f"training.val_data={packed / 'val.bin'}"]
        more += ["--set", f"training.tokenizer={packed / 'tokenizer.json'}"]
        more += ["--set", f"training.output_dir={directory}", "--set", f"training.seed={seed}"]
        return more + [item for value in overrides[1] for item in ("--set", value)]
    estimator = arm.removeprefix("rl:")
    rl: list[object] = ["rl", "--config", harness.ROOT / "configs" / "addition-rl.toml", "--init-from", sft]
    rl += ["--set", f"rl.prompts={task / 'prompts.jsonl'}", "--set", "rl.heldout=none"]
    rl += ["--set", f"training.output_dir={directory}", "--set", f"training.seed={seed}"]
    rl += ["--set", f"rl.temperature={temperature}", "--set", f"rl.estimator={estimator}"]
    return rl + [item for value in overrides[0] for item in ("--set", value)]


def _parse_arms(arms: str) -> list[str]:
    chosen = [arm.strip() for arm in arms.split(",") if arm.strip()]
    from dlm.diffusion.policy_likelihood import estimator_names

    estimators = set(estimator_names())
    for arm in chosen:
        if arm != "sft" and not (arm.startswith("rl:") and arm.removeprefix("rl:") in estimators):
            raise typer.BadParameter(
                f"{arm!r}: an arm is sft or rl:ESTIMATOR ({', '.join(sorted(estimators))})", param_hint="--arms"
            )
    return chosen


def _seconds_per_step(run: Path) -> dict[str, float] | None:
    """An RL run's median rollout and update seconds per step (its `rollout` events); None for SFT."""

    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    rollouts = [event for event in events if event.get("event") == "rollout"]
    if not rollouts:
        return None
    steps = max(event["step"] for event in rollouts)
    return {
        "steps": steps,
        "rollout_s": spread([event["rollout_seconds"] for event in rollouts])["median"],
        "update_s": spread([event["update_seconds"] for event in rollouts])["median"],
    }


def rl_learning(
    sft: Annotated[Path, typer.Option(help="The SFT run (or export) every arm starts from.")] = Path(
        "runs/addition-sft"
    ),
    task: Annotated[Path, typer.Option(help="`dlm task addition --output` directory.")] = Path("data/addition"),
    packed: Annotated[Path, typer.Option(help="The SFT data (`dlm pack --chat --output`).")] = Path(
        "data/addition/packed"
    ),
    output: Annotated[Path, typer.Option(help="Where the arms' runs go.")] = Path("runs/rl-learning"),
    arms: Annotated[str, typer.Option(help="Comma-separated: rl:ESTIMATOR (a `dlm rl` run) or sft (more SFT).")] = (
        "rl:coupled,sft"
    ),
    minutes: Annotated[float, typer.Option(help="Training minutes of each arm.")] = 10.0,
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated: every arm runs once per seed.")] = "0,1,2",
    samples: Annotated[int, typer.Option(help="Evaluation samples per held-out prompt.")] = 4,
    limit: Annotated[int, typer.Option(help="Held-out prompts evaluated.")] = 400,
    temperature: Annotated[float, typer.Option(help="Of the rollouts and of every evaluation.")] = 1.0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="A `dlm rl --set` item (repeatable).")] = None,
    sft_set: Annotated[
        list[str] | None, typer.Option("--sft-set", help="A `dlm train --set` item of the more-SFT arm (repeatable).")
    ] = None,
    name: Annotated[str, typer.Option(help="The result file's name.")] = "rl-learning",
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Held-out pass@1 after --minutes of each arm (`dlm rl` per estimator, or more SFT), two at a time, over seeds.

    Runs go two at a time, each pinned to one core, so every arm trains on one core beside another.
    """

    overrides, sft_overrides = list(set_ or []), list(sft_set or [])
    chosen, seed_list = _parse_arms(arms), [int(seed) for seed in seeds.split(",")]
    run = harness.start(
        name,
        sft=str(sft),
        task=str(task),
        packed=str(packed),
        arms=chosen,
        minutes=minutes,
        seeds=seed_list,
        samples=samples,
        limit=limit,
        temperature=temperature,
        overrides=overrides,
        sft_overrides=sft_overrides,
    )
    heldout = task / "heldout.jsonl"
    start = _accuracy(sft, heldout, samples, limit, temperature)
    jobs = [(arm, seed) for seed in seed_list for arm in chosen]
    by_seed: dict[str, dict[str, dict[str, Any]]] = {}
    for pair in range(0, len(jobs), 2):
        started = []
        for core, (arm, seed) in enumerate(jobs[pair : pair + 2]):
            command = _arm_command(arm, (sft, task, packed, output), seed, temperature, (overrides, sft_overrides))
            started.append(_dlm(*command, "--minutes", minutes, "--overwrite", "--json", core=core))
        _wait_all(started)
        for arm, seed in jobs[pair : pair + 2]:
            directory = output / f"{arm.replace(':', '-')}-{seed}"
            entry: dict[str, Any] = _accuracy(directory, heldout, samples, limit, temperature)
            entry["per_step"] = _seconds_per_step(directory)
            by_seed.setdefault(f"seed_{seed}", {})[arm.replace(":", "_").replace("-", "_")] = entry
            harness.progress(f"seed {seed}, {arm}: {json.dumps(entry)}")
    keys = [arm.replace(":", "_").replace("-", "_") for arm in chosen]
    summary = {key: _over_seeds([row[key]["pass_at_1"] for row in by_seed.values()]) for key in keys}
    figures = {"start": start, "minutes_per_arm": minutes, "by_seed": by_seed, "arms": summary}
    path = run.save(figures, {"by_seed": by_seed}, results=results)
    typer.echo(f"start: pass@1 {start['pass_at_1']:.3f} ± {start['stderr']:.3f}")
    for key, over in summary.items():
        typer.echo(f"{key}: pass@1 {over['mean']:.3f} ± {over['stderr_over_seeds']:.3f} over seeds")
    typer.echo(f"wrote {path}")
