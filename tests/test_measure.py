"""The measuring primitives: interleaved rounds, CPU and wall time, the machine stamp."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dlm.bench import measure


def test_rounds_rotate_the_order_after_untimed_warmups() -> None:
    calls: list[str] = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = measure.interleaved(candidates, rounds=4, warmup=2)
    assert calls[:6] == list("abcabc")  # warm-up: each candidate, in order, untimed
    assert calls[6:] == list("abcbcacababc")  # each round starts one further on
    assert {name: len(runs) for name, runs in timings.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t.cpu_s >= 0 and t.wall_s >= 0 for runs in timings.values() for t in runs)
    with pytest.raises(ValueError, match="rounds"):
        measure.interleaved(candidates, rounds=0)


def test_a_self_timed_candidate_reports_its_own_timing() -> None:
    fixed = measure.Timing(cpu_s=1.5, wall_s=2.0)
    timings = measure.interleaved({"process": lambda: fixed}, rounds=2, warmup=0, timer=measure.self_timed)
    assert timings["process"] == [fixed, fixed]
    with pytest.raises(TypeError, match="returns a Timing"):
        measure.self_timed(lambda: 3.0)


def test_a_process_is_timed_with_its_cpu_seconds_and_output() -> None:
    busy = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\nprint('done')"
    timing, stdout = measure.timed_process([sys.executable, "-c", busy])
    assert stdout.strip() == "done"
    assert timing.cpu_s >= 0.2 and timing.wall_s >= 0.2
    with pytest.raises(subprocess.CalledProcessError) as failed:
        measure.timed_process([sys.executable, "-c", "import sys; sys.exit('no')"])
    assert "no" in failed.value.stderr


def test_ratios_and_spread() -> None:
    assert measure.round_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert measure.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    with pytest.raises(ValueError):
        measure.round_ratios([1.0], [1.0, 2.0])  # rounds pair by position: a missing one is an error


def test_the_stamp_names_the_machine_and_the_commit(tmp_path: Path) -> None:
    stamp = measure.machine_stamp(Path(__file__).resolve().parents[1])
    assert stamp.cores >= 1 and stamp.threads >= 1 and stamp.cpu and stamp.torch
    assert stamp.date.endswith("+00:00")
    assert set(stamp.cpu_flags) <= set(measure._CPU_FLAGS)
    assert stamp.summary().startswith(stamp.date[:10])
    assert measure.MachineStamp(**stamp.to_dict()) == stamp  # what a result file stores reads back
    assert measure.git_commit(tmp_path) is None  # not a checkout: no commit, no error
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("1")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "f"], check=True)
    commit = measure.git_commit(tmp_path)
    assert commit is not None and "+" not in commit
    (tmp_path / "f").write_text("2")
    assert measure.git_commit(tmp_path) == commit + "+dirty"
