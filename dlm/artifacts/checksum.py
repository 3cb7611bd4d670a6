"""A sha256 over a checkpoint's payload: every tensor's bytes and every other value, in order.

The digest is computed on the objects, not on the file, so it can be stored inside the very file
it vouches for: `torch.save` + `torch.load(weights_only=True)` give back the same dicts (same key
order), lists / tuples, tensors (same dtype, shape and bytes) and scalars, hence the same digest.
A flipped or zeroed byte in a tensor, or in the pickled metadata, changes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

# The key under which a saved payload carries its own digest; it is left out of the digest.
CHECKSUM_KEY = "payload_sha256"


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"T{flat.dtype}{tuple(value.shape)}|".encode())
        # Bytes as stored, whatever the dtype (numpy has no bfloat16).
        digest.update(flat.view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        digest.update(f"D{len(value)}|".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):  # torch.load may turn one into the other
        digest.update(f"L{len(value)}|".encode())
        for item in value:
            _feed(digest, item)
    else:  # str, int, float (repr round-trips exactly), bool, None, torch.dtype ...
        digest.update(f"{type(value).__name__}:{value!r}|".encode())


def payload_sha256(payload: Mapping[str, Any]) -> str:
    """The hex sha256 of `payload` without its own `CHECKSUM_KEY` entry."""

    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in payload.items() if key != CHECKSUM_KEY})
    return digest.hexdigest()


def with_checksum(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `payload` that carries its digest (a stale one is replaced)."""

    stamped = {key: value for key, value in payload.items() if key != CHECKSUM_KEY}
    stamped[CHECKSUM_KEY] = payload_sha256(stamped)
    return stamped


def weights_sha256(weights: Mapping[str, torch.Tensor]) -> str:
    """The hex sha256 of a set of named tensors, whatever their order: what names the base model of a
    LoRA run (its checkpoints and adapter exports hold the adapters alone)."""

    digest = hashlib.sha256()
    _feed(digest, {name: weights[name] for name in sorted(weights)})
    return digest.hexdigest()
