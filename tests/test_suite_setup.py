"""The suite itself: a fresh `pip install -e ".[dev]"` (no `gpu` extra) runs it green."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bitsandbytes_tests_skip_when_it_is_not_installed(tmp_path: Path) -> None:
    # A module of that name first on the path that fails as a missing package does, whether or
    # not this environment has the real one.
    hidden = tmp_path / "without-bitsandbytes"
    hidden.mkdir()
    (hidden / "bitsandbytes.py").write_text(
        'raise ModuleNotFoundError("No module named \'bitsandbytes\'", name="bitsandbytes")\n'
    )
    paths = [str(hidden), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "bitsandbytes",
            "--basetemp",
            str(tmp_path / "basetemp"),
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert skipped and int(skipped.group(1)) >= 3, summary
    assert "passed" not in summary and "failed" not in summary and "error" not in summary, summary
    assert "bitsandbytes is not installed" in result.stdout
