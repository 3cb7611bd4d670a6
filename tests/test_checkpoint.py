"""Atomic saves, retention, latest.pt, kill -9 safety, safe loading, the run lock, disk checks."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from dlm.artifacts import checkpoint as ckpt
from dlm.artifacts.checkpoint import (
    INFERENCE_FORMAT,
    TRAINING_FORMAT,
    RunLock,
    UnverifiedCheckpointWarning,
    check_output_dir,
    load_checkpoint,
    save_inference_checkpoint,
    save_training_checkpoint,
)
from dlm.artifacts.checksum import CHECKSUM_KEY, payload_sha256
from dlm.errors import UserError
from dlm.fileio import temporaries

# fork copies the already-imported torch into the child, so each helper process starts at once.
FORK = multiprocessing.get_context("fork") if hasattr(os, "fork") else None
needs_fork = pytest.mark.skipif(FORK is None, reason="needs os.fork")


class TiedModel(nn.Module):
    """Stand-in with the real model's tying: the head *is* the token embedding Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(512, 64)
        self.proj = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.token_embedding.weight
        self.register_buffer("counts", torch.arange(4))


def _payload(step: int, size: int = 16) -> dict:
    return {"step": step, "weights": torch.full((size,), float(step))}


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in temporaries(directory))


def test_save_writes_numbered_file_latest_link_and_format(tmp_path: Path) -> None:
    path = save_training_checkpoint(tmp_path, _payload(7), step=7, keep_last=3)
    assert path == tmp_path / "step-00000007.pt"
    latest = tmp_path / "latest.pt"
    assert os.path.samefile(path, latest)  # a hard link, not a second copy
    loaded = load_checkpoint(tmp_path, expected_format=TRAINING_FORMAT)
    assert loaded["format"] == TRAINING_FORMAT and loaded["step"] == 7
    assert torch.equal(loaded["weights"], torch.full((16,), 7.0))
    assert _leftovers(tmp_path) == []


def test_latest_falls_back_to_a_copy_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError("hard links not supported")

    monkeypatch.setattr(ckpt.os, "link", no_links)
    path = save_training_checkpoint(tmp_path, _payload(1), step=1, keep_last=0)
    latest = tmp_path / "latest.pt"
    assert not os.path.samefile(path, latest)
    assert latest.read_bytes() == path.read_bytes()


def test_retention_keeps_last_k_and_zero_keeps_all(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        save_training_checkpoint(tmp_path / "k2", _payload(step), step=step, keep_last=2)
        save_training_checkpoint(tmp_path / "all", _payload(step), step=step, keep_last=0)
    assert [s for s, _ in ckpt.numbered_checkpoints(tmp_path / "k2")] == [30, 40]
    assert [s for s, _ in ckpt.numbered_checkpoints(tmp_path / "all")] == [10, 20, 30, 40]
    assert load_checkpoint(tmp_path / "k2")["step"] == 40
    # Resumed from an older step: the file just written survives even though it sorts lower.
    save_training_checkpoint(tmp_path / "k2", _payload(35), step=35, keep_last=1)
    assert [s for s, _ in ckpt.numbered_checkpoints(tmp_path / "k2")] == [35, 40]
    assert load_checkpoint(tmp_path / "k2")["step"] == 35


def test_failed_save_keeps_previous_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_training_checkpoint(tmp_path, _payload(1), step=1, keep_last=0)
    real_save = torch.save

    def crash_midway(obj: object, handle: object) -> None:
        real_save(obj, handle)
        handle.truncate(10)  # type: ignore[attr-defined]  # a torn write ...
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the failure

    monkeypatch.setattr(ckpt.torch, "save", crash_midway)
    # A user error (one `error:` line in the CLI) that says what failed and how to continue.
    with pytest.raises(UserError) as info:
        save_training_checkpoint(tmp_path, _payload(2), step=2, keep_last=0)
    assert str(info.value) == (
        f"{tmp_path}: could not write step-00000002.pt: No space left on device; it was not saved, and no "
        f"earlier file was touched (free some disk space (or raise the file size limit), then continue with: "
        f"dlm resume {tmp_path})"
    )
    assert load_checkpoint(tmp_path)["step"] == 1
    assert not (tmp_path / "step-00000002.pt").exists()
    assert _leftovers(tmp_path) == []


def test_stale_temporaries_are_removed_and_never_loaded(tmp_path: Path) -> None:
    save_training_checkpoint(tmp_path, _payload(1), step=1, keep_last=0)
    stale = tmp_path / ".step-00000002.pt.tmp-4194305"  # beyond any pid: its process is gone
    stale.write_bytes(b"half a checkpoint")
    assert load_checkpoint(tmp_path)["step"] == 1
    save_training_checkpoint(tmp_path, _payload(2), step=2, keep_last=0)
    assert not stale.exists()


def test_save_refuses_inconsistent_payload(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format"):
        save_training_checkpoint(tmp_path, {"format": INFERENCE_FORMAT}, step=1, keep_last=0)
    with pytest.raises(ValueError, match="disagrees"):
        save_training_checkpoint(tmp_path, _payload(3), step=4, keep_last=0)


# ~4 MiB per file, so each save takes long enough that most kills land inside one. Made here, in
# the parent: a forked child must not start torch's OpenMP pool, which does not survive fork()
# once the parent has used it (the child would hang in its first parallel kernel).
_BIG = torch.arange(1 << 20, dtype=torch.float32)


def _save_forever(directory: str) -> None:
    torch.set_num_threads(1)  # keep any kernel the save runs on this thread
    step = 0
    while True:
        step += 1
        payload = {"step": step, "stamp": torch.tensor([step]), "weights": _BIG}
        save_training_checkpoint(directory, payload, step=step, keep_last=2)


@needs_fork
def test_kill_9_at_random_moments_leaves_latest_loadable(tmp_path: Path) -> None:
    rng = random.Random(0)
    for _ in range(4):
        process = FORK.Process(target=_save_forever, args=(str(tmp_path),), daemon=True)
        process.start()
        deadline = time.monotonic() + 30
        while not (tmp_path / "latest.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        loaded = load_checkpoint(tmp_path, expected_format=TRAINING_FORMAT)
        assert loaded["step"] >= 1 and loaded["stamp"].tolist() == [loaded["step"]]
        assert torch.equal(loaded["weights"], _BIG)
    # The next save in a fresh run clears whatever the killed saves left behind.
    save_training_checkpoint(tmp_path, _payload(10_000), step=10_000, keep_last=2)
    assert _leftovers(tmp_path) == []


def test_inference_checkpoint_is_bf16_with_tied_storage_once(tmp_path: Path) -> None:
    model = TiedModel()
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["token_embedding.weight"].data_ptr()
    path = save_inference_checkpoint(tmp_path, state, {"step": 5, "config": {"d_model": 32}})
    assert path == tmp_path / "inference-latest.pt"
    loaded = load_checkpoint(path, expected_format=INFERENCE_FORMAT)
    weights = loaded["model"]
    assert loaded["step"] == 5 and loaded["config"] == {"d_model": 32}
    assert weights["proj.weight"].dtype == torch.bfloat16
    assert weights["counts"].dtype == torch.int64  # integer buffers keep their dtype
    assert weights["head.weight"].data_ptr() == weights["token_embedding.weight"].data_ptr()
    assert torch.equal(weights["proj.weight"], state["proj.weight"].to(torch.bfloat16))
    # Stored once: the file is about one embedding smaller than the sum over names.
    bytes_if_duplicated = sum(t.numel() * t.element_size() for t in weights.values())
    tied_bytes = weights["head.weight"].numel() * 2
    assert path.stat().st_size < bytes_if_duplicated - tied_bytes * 0.9
    with pytest.raises(ValueError, match="format"):
        save_inference_checkpoint(tmp_path, state, {"format": "x"})


class Exploit:
    """Unpickling this runs code; a safe loader must refuse it before that happens."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_load_refuses_pickled_objects_without_running_them(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    payload = {"format": TRAINING_FORMAT, "evil": Exploit(marker)}
    torch.save(payload, tmp_path / "custom.pt")
    (tmp_path / "custom-p2.pkl").write_bytes(pickle.dumps(payload, protocol=2))
    (tmp_path / "custom-p5.pkl").write_bytes(pickle.dumps(payload, protocol=5))
    for name, message in (
        ("custom.pt", "unsafe pickle"),
        ("custom-p2.pkl", "unsafe pickle"),
        # torch's weights-only reader stops even earlier, at protocol 5's framing opcode.
        ("custom-p5.pkl", "damaged"),
    ):
        with pytest.raises(UserError, match=f"not a dlm checkpoint: .*{message}") as info:
            load_checkpoint(tmp_path / name)
        assert str(tmp_path / name) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (os.urandom(4096), "not a torch checkpoint or it is damaged"),
        (b"hello, this is text\n", "not a torch checkpoint or it is damaged"),
        (b"", "not a torch checkpoint or it is damaged"),
    ],
)
def test_load_refuses_foreign_bytes(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "foreign.pt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_checkpoint(path)


def test_load_refuses_missing_or_foreign_format(tmp_path: Path) -> None:
    cases = {
        "no-format.pt": ({"step": 1}, "it has no format field"),
        "foreign.pt": ({"format": "mini-diffusion-lm-checkpoint-v1"}, "unknown format"),
        "tensor.pt": (torch.zeros(3), "it holds a Tensor, not a dict"),
    }
    for name, (obj, message) in cases.items():
        torch.save(obj, tmp_path / name)
        with pytest.raises(UserError, match=f"not a dlm checkpoint: {message}"):
            load_checkpoint(tmp_path / name)
    save_inference_checkpoint(tmp_path, {"w": torch.ones(2)}, {})
    with pytest.raises(UserError, match=r"is an? inference checkpoint"):
        load_checkpoint(tmp_path / "inference-latest.pt", expected_format=TRAINING_FORMAT)
    with pytest.raises(UserError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(UserError, match=r"no latest\.pt"):
        load_checkpoint(tmp_path)


def _hold_lock(directory: str, locked: object) -> None:
    with RunLock(directory):
        locked.set()  # type: ignore[attr-defined]
        time.sleep(60)  # held until the test kills this process


@needs_fork
def test_run_lock_across_processes(tmp_path: Path) -> None:
    # The holder only ever sets an Event (never waits on one): a process killed while waiting on
    # a multiprocessing Condition would leave the next notify_all() blocked forever.
    locked = FORK.Event()
    holder = FORK.Process(target=_hold_lock, args=(str(tmp_path), locked), daemon=True)
    holder.start()
    try:
        assert locked.wait(30)
        with pytest.raises(UserError, match=rf"another dlm run is using .* \(pid {holder.pid}\)"):
            RunLock(tmp_path).acquire()
        # The kernel drops the lock when its holder dies, however it dies.
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        with RunLock(tmp_path) as lock:
            assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
            assert lock.enforced
    finally:
        if holder.is_alive():
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(30)


def test_run_lock_in_one_process_and_release(tmp_path: Path) -> None:
    with RunLock(tmp_path / "run"), pytest.raises(UserError, match="another dlm run"):
        RunLock(tmp_path / "run").acquire()
    with RunLock(tmp_path / "run"):  # released on exit, so it can be taken again
        assert (tmp_path / "run" / ".lock").exists()


def test_check_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nested = tmp_path / "a" / "b"
    check_output_dir(nested, bytes_needed=1)
    assert nested.is_dir() and _leftovers(nested) == []
    with pytest.raises(UserError, match="free on its disk") as info:
        check_output_dir(nested, bytes_needed=1 << 62)
    assert str(nested) in str(info.value)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        check_output_dir(a_file, bytes_needed=1)


def test_a_disk_too_small_is_refused_before_the_directory_is_created(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="free on its disk") as info:
        check_output_dir(tmp_path / "runs" / "new", bytes_needed=1 << 62)
    assert str(tmp_path) in str(info.value)  # the disk it measured: where the directory would be
    assert list(tmp_path.iterdir()) == []


def test_check_output_dir_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated, because chmod does not stop root (these tests may run as root in containers).
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpt, "probe_writable", refuse)
    with pytest.raises(UserError, match="not writable: Permission denied") as info:
        check_output_dir(tmp_path, bytes_needed=1)
    assert str(tmp_path) in str(info.value)


class Blocked:
    """Unpickling this would call os.system: torch refuses its module as blocked."""

    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


class Opaque:
    """Any class of the caller's: not on torch's allowlist."""


def test_refusal_names_the_blocked_global_in_full(tmp_path: Path) -> None:
    blocked = f"{os.system.__module__}.system"  # posix.system on Linux and macOS
    cases = {
        "blocked.pt": (Blocked(), blocked),  # "unsupported GLOBAL posix.system whose module posix is blocked"
        "custom.pt": (Opaque(), f"{Opaque.__module__}.Opaque"),  # "GLOBAL ... was not an allowed global"
    }
    for name, (payload, named) in cases.items():
        (tmp_path / name).write_bytes(pickle.dumps({"format": TRAINING_FORMAT, "x": payload}, protocol=2))
        with pytest.raises(UserError) as info:
            load_checkpoint(tmp_path / name)
        assert str(info.value) == (
            f"{tmp_path / name}: not a dlm checkpoint: it contains Python objects ({named}) that only unsafe "
            "pickle loading could rebuild; dlm never loads checkpoints that way"
        )


def _zero_bytes_inside_a_tensor(path: Path) -> None:
    """Zero 4 bytes in the middle of the largest tensor record of a torch zip file."""

    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        record = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset)
        name_length, extra_length = struct.unpack("<HH", handle.read(30)[26:30])
        handle.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        handle.write(bytes(4))


def test_checksum_survives_the_round_trip_of_every_payload_type(tmp_path: Path) -> None:
    payload = {
        "step": 3,
        "lr": 0.1 + 0.2,
        "name": "x",
        "none": None,
        "flag": True,
        "betas": (0.9, 0.95),
        "groups": [{"params": [0, 1]}],
        "state": {0: {"exp_avg": torch.randn(5)}},
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "view": torch.arange(10.0)[2:8:2],
        "scalar": torch.tensor(7),
        "empty": torch.zeros(0),
    }
    save_training_checkpoint(tmp_path, payload, step=3, keep_last=0)
    loaded = load_checkpoint(tmp_path / "latest.pt")
    assert loaded[CHECKSUM_KEY] == payload_sha256(loaded) == payload_sha256({**payload, "format": TRAINING_FORMAT})
    loaded["lr"] = 0.3  # metadata counts as much as tensors
    assert payload_sha256(loaded) != loaded[CHECKSUM_KEY]


def test_a_damaged_checkpoint_names_the_next_older_one(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save_training_checkpoint(tmp_path, _payload(step, size=4096), step=step, keep_last=0)
    _zero_bytes_inside_a_tensor(tmp_path / "latest.pt")  # and so step-00000030.pt, its hard link
    with pytest.raises(UserError) as info:
        load_checkpoint(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'latest.pt'}: the checkpoint is damaged: its contents do not match the sha256 saved in it "
        f"(use the next-older checkpoint {tmp_path / 'step-00000020.pt'}: dlm resume {tmp_path} --checkpoint "
        "step-00000020.pt)"
    )
    _zero_bytes_inside_a_tensor(tmp_path / "step-00000010.pt")
    with pytest.raises(UserError, match=r"no older checkpoint is left in .*dlm train --overwrite\)$"):
        load_checkpoint(tmp_path / "step-00000010.pt")
    assert load_checkpoint(tmp_path / "step-00000020.pt")["step"] == 20


def test_a_damaged_inference_checkpoint_points_to_latest(tmp_path: Path) -> None:
    save_inference_checkpoint(tmp_path, {"w": torch.randn(4096)}, {"step": 5})
    _zero_bytes_inside_a_tensor(tmp_path / "inference-latest.pt")
    with pytest.raises(UserError, match=r"damaged.*\(use the run's training checkpoint .*latest\.pt instead\)$"):
        load_checkpoint(tmp_path / "inference-latest.pt")


def test_a_checkpoint_saved_without_checksum_loads_with_a_warning(tmp_path: Path) -> None:
    torch.save({"format": TRAINING_FORMAT, "step": 1, "w": torch.ones(2)}, tmp_path / "old.pt")
    with pytest.warns(UnverifiedCheckpointWarning, match=r"old\.pt: saved without a checksum"):
        assert load_checkpoint(tmp_path / "old.pt")["step"] == 1
