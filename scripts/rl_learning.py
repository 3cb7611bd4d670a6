"""Does `dlm rl` beat more SFT on the same budget? The bundled addition task, several seeds.

From one SFT run, each seed spends `--minutes` on one CPU core on RL (`dlm rl`, configs/addition-rl.toml)
and, at the same time on the other core, the same minutes on more SFT (`dlm train --init-from`,
configs/addition-sft.toml). Every model, the start included, is then evaluated on the held-out prompts
(`dlm eval --prompts`, pass@1 over --samples samples per prompt). Prints one JSON document:

    python scripts/rl_learning.py --sft runs/addition-sft --task data/addition --packed data/addition/packed \\
        --output runs/rl-learning --minutes 10 --seeds 0 1 2 [--set rl.estimator=coupled ...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dlm(*args: object, core: int | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "dlm", *map(str, args)]
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"{' '.join(map(str, process.args))} failed ({process.returncode}):\n{err}")
    return out


def _accuracy(model: Path, heldout: Path, samples: int, limit: int, temperature: float) -> dict[str, float]:
    args = ("eval", model, "--prompts", heldout, "--samples", samples, "--limit", limit, "--device", "cpu", "--json")
    report = json.loads(_wait(_dlm(*args, "--steps", 8, "--temperature", temperature)))
    return {"pass@1": report["pass_at"]["1"], "stderr": report["stderr"]["1"]}


def _mean(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "stderr_over_seeds": spread / math.sqrt(len(values))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", type=Path, required=True, help="the SFT run (or export) both arms start from")
    parser.add_argument("--task", type=Path, required=True, help="`dlm task addition --output` directory")
    parser.add_argument("--packed", type=Path, required=True, help="the SFT data (`dlm pack --chat --output`)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=1.0, help="of the rollouts and of every evaluation")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="--set items for dlm rl")
    args = parser.parse_args()
    heldout = args.task / "heldout.jsonl"
    start = _accuracy(args.sft, heldout, args.samples, args.limit, args.temperature)
    rows = []
    for seed in args.seeds:
        rl_run, sft_run = args.output / f"rl-{seed}", args.output / f"sft-{seed}"
        rl_args = ["rl", "--config", ROOT / "configs" / "addition-rl.toml", "--init-from", args.sft]
        rl_args += ["--set", f"rl.prompts={args.task / 'prompts.jsonl'}", "--set", "rl.heldout=none"]
        rl_args += ["--set", f"training.output_dir={rl_run}", "--set", f"training.seed={seed}"]
        rl_args += ["--set", f"rl.temperature={args.temperature}"]
        for item in args.overrides:
            rl_args += ["--set", item]
        sft_args = ["train", "--config", ROOT / "configs" / "addition-sft.toml", "--init-from", args.sft]
        sft_args += ["--set", f"training.train_data={args.packed / 'train.bin'}"]
        sft_args += ["--set", f"training.val_data={args.packed / 'val.bin'}"]
        sft_args += ["--set", f"training.tokenizer={args.packed / 'tokenizer.json'}"]
        sft_args += ["--set", f"training.output_dir={sft_run}", "--set", f"training.seed={seed}"]
        both = [
            _dlm(*rl_args, "--minutes", args.minutes, "--overwrite", "--json", core=0),
            _dlm(*sft_args, "--minutes", args.minutes, "--overwrite", "--json", core=1),
        ]
        for process in both:
            _wait(process)
        rows.append(
            {
                "seed": seed,
                "rl": _accuracy(rl_run, heldout, args.samples, args.limit, args.temperature),
                "more_sft": _accuracy(sft_run, heldout, args.samples, args.limit, args.temperature),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    summary = {
        "start": start,
        "minutes_per_arm": args.minutes,
        "rl_overrides": args.overrides,
        "temperature": args.temperature,
        "seeds": rows,
        "rl": _mean([row["rl"]["pass@1"] for row in rows]),
        "more_sft": _mean([row["more_sft"]["pass@1"] for row in rows]),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
