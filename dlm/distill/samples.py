"""The teacher's own samples as distillation data (`dlm distill --teacher-samples N`).

A student sees masked text at every step of its training; distilled on the teacher's samples it sees
text like what it will sample from, rather than the corpus. The teacher writes N unconditional
samples of its context length in its default steps (batches of BATCH rows, batch i seeded `seed + i`,
so the same call writes the same samples), they are written as JSON lines and packed with the
teacher's tokenizer (`dlm.data.pack.pack_corpus`, VAL_FRACTION of them held out for validation, and
at least about VAL_SAMPLES) into `RUN/teacher-samples/`. A complete directory there, of the same
teacher, count, seed and compute dtype, is reused: a second call (or a resume after a stop) does not
sample again. The dtype is part of it because the teacher computes in the one this CPU computes best
(`dlm.runtime.device.inference_dtype`): samples drawn in bfloat16 elsewhere are not the ones this
machine draws.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlm.artifacts.loading import load_model_with_info
from dlm.artifacts.run_dir import check_run_target, check_source_kept, metadata_sha256
from dlm.data.pack import pack_corpus
from dlm.errors import UserError
from dlm.fileio import atomic_path, atomic_write_json
from dlm.runtime.device import dtype_name
from dlm.sampling.generation import generate

SAMPLES_DIR = "teacher-samples"
SAMPLES_NAME, RECORD_NAME = "samples.jsonl", "samples.json"
BATCH = 64
VAL_FRACTION = 0.05
VAL_SAMPLES = 3  # and at least about this many samples' text: one sample may re-encode a little under a block
MIN_SAMPLES = 16
Progress = Callable[[int, int], None]  # (samples written, samples asked for)


def teacher_samples(
    teacher: str | Path,
    count: int,
    run_dir: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """The packed data directory of `count` samples of `teacher` under `run_dir`, written or reused. A run
    already in `run_dir` is refused first (unless `overwrite`: the run then starts over), not after
    minutes of sampling."""

    if count < MIN_SAMPLES:
        raise UserError(
            f"--teacher-samples must be at least {MIN_SAMPLES} (got {count}): a few of them are held out for "
            "validation",
            fix="for example --teacher-samples 2048",
        )
    check_run_target(Path(run_dir), None, overwrite)
    check_source_kept(Path(teacher), Path(run_dir))  # as the run will check it, before minutes of sampling
    output = Path(run_dir) / SAMPLES_DIR
    loaded = load_model_with_info(teacher)
    wanted = {
        "teacher": str(Path(teacher).resolve()),
        "count": count,
        "seed": seed,
        "teacher_step": loaded.info.step,
        "teacher_tokenizer_sha256": loaded.info.tokenizer_sha256,
        "compute_dtype": dtype_name(next(loaded.model.parameters()).dtype),
    }
    if _complete(output) == wanted:
        return output
    output.mkdir(parents=True, exist_ok=True)
    model, tokenizer, length = loaded.model, loaded.tokenizer, loaded.model.config.max_seq_len
    with atomic_path(output / SAMPLES_NAME) as temporary, temporary.open("w", encoding="utf-8") as handle:
        for index, start in enumerate(range(0, count, BATCH)):
            rows = min(BATCH, count - start)
            for text in generate(model, tokenizer, length=length, num_samples=rows, seed=seed + index).texts:
                handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            if progress is not None:
                progress(start + rows, count)
    summary = pack_corpus(
        [output / SAMPLES_NAME],
        loaded.info.tokenizer_path,
        length,
        output,
        val_fraction=max(VAL_FRACTION, VAL_SAMPLES / count),
        seed=seed,
        overwrite=True,
    )
    packed = json.loads((output / "train.json").read_text(encoding="utf-8"))
    atomic_write_json(
        output / RECORD_NAME,
        {**wanted, "train_sha256": metadata_sha256(packed), "train_blocks": summary.splits["train"].num_blocks},
    )
    return output


def _complete(output: Path) -> dict[str, Any] | None:
    """What a finished sampling in `output` was asked for (its record, written last), or None."""

    try:
        record = json.loads((output / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not (output / "train.bin").is_file():
        return None
    keys = ("teacher", "count", "seed", "teacher_step", "teacher_tokenizer_sha256", "compute_dtype")
    return {key: record.get(key) for key in keys}
