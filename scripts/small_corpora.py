"""Write the small English corpora of docs/benchmarks.md's "Sizing to a small corpus": one to tune
on, two to report on, kept apart.

Needs two Debian packages, installed by hand (both public domain text):
    apt-get install bible-kjv dict-jargon
    python scripts/small_corpora.py OUT_DIR

OUT_DIR/kjv-tune/train: the first ten books of the King James Bible, Genesis to 2 Samuel (1.26 MB);
OUT_DIR/kjv-tune/val: 1 Kings (127 kB). The thresholds and the recipe were chosen on these.
OUT_DIR/kjv-report: every book after 1 Kings, 2 Kings to Revelation (55 books, 2.75 MB), one file a
book; `dlm pack --val-fraction 0.05` holds some of them out.
OUT_DIR/jargon/jargon.jsonl: the Jargon File 4.4.7 (Debian's `dict-jargon`), one entry a line,
{"text": headword, pronunciation and definition} (2,307 entries, 1.4 MB); never looked at while tuning.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
JARGON = Path("/usr/share/dictd/jargon.dict.dz")
JARGON_INDEX = Path("/usr/share/dictd/jargon.index")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
TUNE_BOOKS = 10  # Genesis .. 2 Samuel
TUNE_VAL_BOOK = 10  # 1 Kings


def dict_number(text: str) -> int:
    """A dictd index offset or length: base 64 in its own alphabet."""

    value = 0
    for char in text:
        value = value * 64 + B64.index(char)
    return value


def jargon_entries() -> list[str]:
    data = gzip.decompress(JARGON.read_bytes())  # dictzip is gzip with random-access chunks
    entries = []
    for line in JARGON_INDEX.read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if headword.startswith("00-database"):
            continue
        start = dict_number(offset)
        text = data[start : start + dict_number(length)].decode("utf-8")
        # The definitions are indented by four spaces and the pronunciation by one: plain lines here.
        entries.append("\n".join(line.strip() for line in text.strip().splitlines()) + "\n")
    return entries


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if shutil.which("bible") is None or not JARGON.is_file():
        print("error: the text is missing: apt-get install bible-kjv dict-jargon", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    books = out / "kjv-books"
    subprocess.run([sys.executable, str(ROOT / "kjv_books.py"), str(books)], check=True)
    files = sorted(books.glob("*.txt"))
    for index, path in enumerate(files):
        if index < TUNE_BOOKS:
            target = out / "kjv-tune" / "train"
        elif index == TUNE_VAL_BOOK:
            target = out / "kjv-tune" / "val"
        else:
            target = out / "kjv-report"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / path.name)
    entries = jargon_entries()
    (out / "jargon").mkdir(parents=True, exist_ok=True)
    with open(out / "jargon" / "jargon.jsonl", "w", encoding="utf-8") as handle:
        for entry in entries:
            handle.write(json.dumps({"text": entry}, ensure_ascii=False) + "\n")
    for name in ("kjv-tune/train", "kjv-tune/val", "kjv-report"):
        size = sum(p.stat().st_size for p in (out / name).glob("*.txt"))
        print(f"{name}: {size:,} bytes")
    print(f"jargon: {len(entries):,} entries, {sum(len(e.encode()) for e in entries):,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
