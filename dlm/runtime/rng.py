"""Seeding and RNG state: every global generator seeded from one number, captured and put back.

The captured state holds only tensors, ints, floats and strings, so a checkpoint carries it through
`torch.load(weights_only=True)` and a resumed run draws the numbers the uninterrupted run would.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dlm.runtime.device import mps_available


def seed_everything(seed: int, device: torch.device) -> None:
    """Seed python, numpy, torch and the accelerator's generator."""

    random.seed(seed)
    # numpy's legacy global generator only takes 32-bit seeds; fold larger ones instead of failing.
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    if device.type == "mps" and hasattr(torch.mps, "manual_seed"):
        # The MPS runtime starts lazily and its initialisation can overwrite a seed set before the
        # first allocation, so materialise it first.
        torch.empty((), device="mps")
        torch.mps.synchronize()
        torch.mps.manual_seed(seed)


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Every global generator's state as tensors, ints, floats and strings only.

    The result survives `torch.save` + `torch.load(weights_only=True)`: python's tuple state and
    numpy's array state are unpacked into plain fields instead of being pickled as objects.
    """

    version, mt_words, gauss_next = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": torch.tensor(mt_words, dtype=torch.int64),
            "gauss_next": None if gauss_next is None else float(gauss_next),
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    if device.type == "mps" and hasattr(torch.mps, "get_rng_state"):
        state["mps"] = torch.mps.get_rng_state().cpu()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` recorded (accelerator states only where present)."""

    python = state["python"]
    words = tuple(int(w) for w in python["state"].tolist())
    random.setstate((int(python["version"]), words, python["gauss_next"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["name"],
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "mps" in state and mps_available() and hasattr(torch.mps, "set_rng_state"):
        torch.mps.set_rng_state(state["mps"].cpu())
