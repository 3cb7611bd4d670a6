"""dlm.fileio: a file is replaced whole or not at all, through one temporary-name scheme whose
leftovers of a killed process are removed and those of a live one kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm import fileio
from dlm.errors import UserError
from dlm.fileio import (
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    check_free_space,
    remove_stale_temporaries,
    temporaries,
    temporary_path,
)


def dead_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def test_the_temporary_is_a_hidden_sibling_named_after_the_file_and_the_process(tmp_path: Path) -> None:
    assert temporary_path(tmp_path / "config.json") == tmp_path / f".config.json.tmp-{os.getpid()}"


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    assert atomic_write_json(path, {"nll": 1.5, "text": "é"}) == path
    assert path.read_text() == '{\n  "nll": 1.5,\n  "text": "\\u00e9"\n}\n'
    atomic_write_json(path, ["é"], ensure_ascii=False)
    assert json.loads(path.read_text(encoding="utf-8")) == ["é"]
    atomic_write_text(path, "new", durable=True)
    assert path.read_text() == "new" and temporaries(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("old")
    with pytest.raises(OSError, match="disk full"), atomic_path(path) as temporary:
        temporary.write_text("half")
        raise OSError(28, "disk full")
    assert path.read_text() == "old" and not temporary.exists() and temporaries(tmp_path) == []
    # A directory built under the temporary name goes too (an export is one).
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "model") as building:
        building.mkdir()
        (building / "weights").write_text("x")
        raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json"]


def test_only_the_temporaries_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = dead_pid()
    stale = [tmp_path / f".{name}.tmp-{dead}" for name in ("train.bin", "config.json")]
    live = tmp_path / f".train.bin.tmp-{os.getpid()}"
    other = tmp_path / f".notes.txt.tmp-{dead}"
    not_ours = [tmp_path / ".val.bin.tmp-x", tmp_path / "train.bin.tmp-1"]
    for path in (*stale, live, other, *not_ours):
        path.write_text("x")
    assert sorted(temporaries(tmp_path)) == sorted([*stale, live, other])
    assert remove_stale_temporaries(tmp_path, ["train.bin", "config.json"]) == sorted(stale)
    assert live.exists() and other.exists() and all(path.exists() for path in not_ours)
    assert remove_stale_temporaries(tmp_path) == [other]  # any name
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_free_space_and_writability_are_checked_before_a_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_free_space(tmp_path, 1, "a checkpoint", "free some space")
    fileio.probe_writable(tmp_path)
    assert temporaries(tmp_path) == []
    with pytest.raises(UserError, match=r"free on its disk, a checkpoint needs about 1\.0 TiB") as info:
        check_free_space(tmp_path, 1 << 40, "a checkpoint", "free some space")
    assert info.value.fix == "free some space"
    # A nearly full disk in units a person reads, not 0.00 GiB.
    usage = fileio.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: usage._replace(free=3 << 20))
    with pytest.raises(UserError, match=r"only 3\.0 MiB free on its disk, a checkpoint needs about 5\.0 MiB"):
        check_free_space(tmp_path, 5 << 20, "a checkpoint", "free some space")
    monkeypatch.undo()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        fileio.check_writable_directory(a_file / "out")
    monkeypatch.setattr(fileio.os, "access", lambda *args: False)
    with pytest.raises(UserError, match="not writable"):
        fileio.check_writable_directory(tmp_path / "new" / "dir")
