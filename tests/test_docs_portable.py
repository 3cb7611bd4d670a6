"""The README and docs/ show commands a reader can run from the repository root: no path that
exists only on the machine a figure was measured on (a virtual environment's bin folder, a scratch
or home folder). System paths every Linux has (/usr/bin/time, /proc/stat, /dev/null) are fine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A machine's own folders, at the start of a path (not inside a relative one like runs/tmp/).
FOLDERS = "tmp|work|home|root|Users|mnt|scratch|data|opt|srv"
MACHINE_PATH = re.compile(rf"(?<![\w.~/-])(?:/(?:{FOLDERS})/|[\w.-]*venv/bin)\S*")


def test_the_docs_name_no_path_of_the_machine_they_were_written_on() -> None:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.name}:{number}: {match}" for match in MACHINE_PATH.findall(line)]
    assert not found, "\n".join(found)


def test_the_pattern_finds_what_it_is_for() -> None:
    assert MACHINE_PATH.findall("B=/tmp/packbench; V=/work/venv/bin; $V/dlm") == ["/tmp/packbench;", "/work/venv/bin;"]
    assert MACHINE_PATH.findall("P=.venv/bin/python") == [".venv/bin/python"]
    assert MACHINE_PATH.findall("/usr/bin/time -f %M runs/tmp/x dlm/data/y /proc/stat") == []
