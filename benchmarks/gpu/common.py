"""What the GPU check's parts share: the sizes and cases measured, and the JSON-lines record file."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import harness
from dlm.bench.measure import MachineStamp, machine_stamp

ROOT = harness.ROOT
SIZES: dict[str, dict[str, Any]] = {
    "110M": {"baseline": (32768, 768, 12, 12, 1024), "batch": 32, "config": "configs/gpt2-small.toml"},
    "1.3B": {"baseline": (32768, 2048, 24, 16, 1024), "batch": 8, "config": "configs/1b.toml"},
}
# As the baseline: bf16, one micro-batch per optimizer step, on the GPU.
DLM_COMMON = ["training.precision=bfloat16", "training.gradient_accumulation_steps=1", "training.device=cuda"]
# configs/shakespeare.toml with max_steps that end its cosine schedule inside the budget at the loop's
# measured rate on an H200 (2352 steps in 60 s at batch 256, validations and checkpoints included),
# the earlier batch-64 recipe (its schedule fitted from the probed step time) and a batch of 512.
QUALITY_CONFIG, AR_CONFIG = "configs/shakespeare.toml", "configs/shakespeare-ar.toml"
QUALITY_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "config": (QUALITY_CONFIG, ["training.max_steps=2150"]),
    "ar": (AR_CONFIG, ["training.max_steps=2150"]),  # the judge of the generation part
    # The twin on flash attention first: on an H200 (torch 2.11) the default order, cuDNN first, saw it diverge.
    "ar-flash": (AR_CONFIG, ["training.max_steps=2150", "training.attention_kernel=flash"]),
    "batch64": (QUALITY_CONFIG, ["training.batch_size=64", "training.learning_rate=2e-3"]),
    "batch512": (QUALITY_CONFIG, ["training.batch_size=512", "training.learning_rate=4e-3", "training.max_steps=1250"]),
}
QUALITY_DEFAULT = ["config", "ar"]  # trained by default; their step times are probed


class Records:
    """Appends each measurement to a JSON-lines file at once (and echoes it for the log).

    With a machine stamp, the part's lines begin with it (case "machine"): the report's result file
    says where the figures were measured even when it is written elsewhere.
    """

    def __init__(self, path: Path, part: str, stamp: MachineStamp | None = None):
        self.path, self.part = path, part
        path.parent.mkdir(parents=True, exist_ok=True)
        if stamp is not None:
            self.add({"case": "machine", "machine": stamp.to_dict()})

    def add(self, record: dict[str, Any]) -> None:
        line = json.dumps({"part": self.part, **record}, default=str)
        print(line, flush=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def with_commit(stamp: MachineStamp) -> MachineStamp:
    """The stamp with the commit from $DLM_COMMIT where the working tree is a copy without git."""

    commit = os.environ.get("DLM_COMMIT")
    if stamp.commit is None and commit and commit != "unknown":
        return MachineStamp(**(stamp.to_dict() | {"commit": commit}))
    return stamp


def stamp() -> MachineStamp:
    """This machine now (a part's first record)."""

    return with_commit(machine_stamp(ROOT))


def error_text(exc: BaseException) -> str:
    return repr(exc)[:500]


def baseline_module(name: str) -> ModuleType:
    """A plain-PyTorch baseline script of benchmarks/baselines/, imported as it is (their imports are flat)."""

    if str(harness.BASELINES) not in sys.path:
        sys.path.insert(0, str(harness.BASELINES))
    return importlib.import_module(name)


def free_cuda() -> None:
    import torch

    from dlm.bench.setup import release_memory
    from dlm.runtime.kernels import configure_cuda_backends

    release_memory(torch.device("cuda"))
    # dlm --fused-attention switches the math kernel off process-wide; the baseline runs with torch's defaults.
    configure_cuda_backends(torch.device("cuda"), require_fused_attention=False)
