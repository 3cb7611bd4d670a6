"""Write the King James Bible as plain English text, one file per book: a few MB of English that is
not Shakespeare, for checking that `configs/cpu.toml` learns on other text (docs/benchmarks.md).

Needs Debian's `bible-kjv` package (its `bible` command and the text), installed by hand:
    apt-get install bible-kjv
    python scripts/kjv_books.py OUT_DIR        # 66 files, about 4.1 MB

Verse references ("Ge1:1") are dropped, so each file is the book's verses, one per line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

VERSE = re.compile(r"^(\S+?)(\d+):(\d+) (.*)$")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if shutil.which("bible") is None:
        print("error: the `bible` command is missing: apt-get install bible-kjv", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, check=True).stdout
    books: dict[str, list[str]] = {}
    for line in text.decode("utf-8", errors="replace").splitlines():
        match = VERSE.match(line)
        if match:
            books.setdefault(match.group(1), []).append(match.group(4))
    for index, (book, verses) in enumerate(books.items()):
        (out / f"{index:02d}-{book}.txt").write_text("\n".join(verses) + "\n", encoding="utf-8")
    print(f"{len(books)} books, {sum(p.stat().st_size for p in out.glob('*.txt')):,} bytes in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
