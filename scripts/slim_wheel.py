"""Drop members from a wheel, in place, keeping its RECORD consistent.

usage: python scripts/slim_wheel.py WHEEL REGEX

The bitsandbytes wheel carries one native library per CUDA / ROCm / XPU version (about 43 MB); the
GPU machine needs one of them, and everything carried there counts against a 64 MiB transfer limit.
Members whose path matches REGEX (re.search) are removed, and so are their RECORD lines; pip does
not need the other versions' libraries to install or import the package.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, pattern: str) -> list[str]:
    """Rewrite `wheel` without the members matching `pattern`; return the dropped names."""

    drop = re.compile(pattern)
    temporary = wheel.with_suffix(".slim.tmp")
    dropped: list[str] = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if drop.search(item.filename):
                dropped.append(item.filename)
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode("utf-8").splitlines(keepends=True)
                data = "".join(line for line in lines if not drop.search(line.split(",", 1)[0])).encode("utf-8")
            target.writestr(item, data)
    temporary.replace(wheel)
    return dropped


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    wheel, pattern = Path(argv[0]), argv[1]
    before = wheel.stat().st_size
    dropped = slim(wheel, pattern)
    after = wheel.stat().st_size
    print(f"{wheel.name}: dropped {len(dropped)} members, {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
