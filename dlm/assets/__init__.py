"""The bundled corpus: 42 Shakespeare works from Project Gutenberg, gzip-compressed, public domain.

39 works form the training split; Hamlet, Macbeth and Twelfth Night are held out whole as the
validation split, so validation text is never a neighbouring paragraph of a training play.
Every reader in dlm accepts `.gz` transparently, so these paths go straight to `dlm pack`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

SPLITS = ("train", "val")


def shakespeare_files(split: Literal["train", "val", "all"] = "all") -> list[Path]:
    """Sorted paths of the bundled `*_gut.txt.gz` files of one split (or both)."""

    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    # The package is installed as plain files (never zipped), so the traversable is a real path.
    root = Path(str(resources.files(__name__) / "shakespeare"))
    chosen = SPLITS if split == "all" else (split,)
    return sorted(path for name in chosen for path in (root / name).glob("*_gut.txt.gz"))
