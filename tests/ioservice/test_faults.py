"""Fault injection: failed, torn and slow writes; damaged checkpoints at recovery."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from ioservice import (CheckpointManager, CheckpointNotFoundError, CheckpointPolicy,
                       CheckpointWriteError, DamagedCheckpointWarning, list_checkpoints,
                       open_root, restore)

from tests.ioservice.ckpt_helpers import (faulty_root, mutate, new_pm, open_structures, state_of)


def _assert_absent(root, name: str) -> None:
    """No trace of checkpoint `name`: no manifest, no partial files."""
    assert name not in {c.name for c in list_checkpoints(root)}


def _restores(root, haunit: str, want: dict[str, str], name: str) -> None:
    pm = new_pm()
    assert restore(pm, root, haunit).name == name
    assert state_of(open_structures(pm)) == want


@pytest.mark.parametrize("fault", [
    {"fail_on_nth_write": 3},
    {"fail_on_nth_write": 1, "fail_path_glob": "*manifest*"},
    {"truncate_after": 5000},
], ids=["nth-page-write", "manifest-write", "torn-file"])
def test_failed_write_cancels_checkpoint_cleanly(tmp_path: Path, fault: dict) -> None:
    """A failed write: no manifest or files left, pages writable, operator unblocked,
    previous checkpoint restores, the next checkpoint writes the lost changes."""
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    for step in range(4):
        mutate(s, step)
    failures: list[tuple[int, BaseException]] = []
    policy = CheckpointPolicy(full_every=10)
    with CheckpointManager(pm, root, "f", policy=policy, n_workers=2,
                           on_failed=lambda seq, e: failures.append((seq, e))) as mgr:
        mgr.checkpoint().result()
        first = state_of(s)
        mutate(s, 4)
        faulty.write_gate = threading.Event()  # storage stands still until the gate opens
        faulty.reset_counters()
        for k, v in fault.items():
            setattr(faulty, k, v)
        pending = mgr.checkpoint()
        mutate(s, 5)  # the operator keeps running during the (failing) write...
        assert not pending.done()  # ...which has not got anywhere yet: nothing waited for it
        live = state_of(s)
        faulty.write_gate.set()
        with pytest.raises(CheckpointWriteError, match="f-2") as err:
            pending.result(timeout_s=600)
        assert pending.state.name == "FAILED"
        assert failures and failures[0][0] == 2 and failures[0][1] is err.value
        assert pm.stats()["pinned_frames"] == 0 and pm.stats()["active_snapshots"] == 0
        _assert_absent(root, "f-2")
        assert state_of(s) == live  # live state untouched by the cancel
        _restores(root, "f", first, "f-1")
        # heal: the next checkpoint is incremental on f-1 and carries all changes since
        faulty.fail_on_nth_write = None
        faulty.truncate_after = None
        faulty.write_gate = None
        man = mgr.checkpoint().result()
        assert man.name == "f-3" and man.base == "f-1"
    _restores(open_root(str(tmp_path)), "f", live, "f-3")


def test_latency_never_blocks_the_operator(tmp_path: Path) -> None:
    """With storage that does not move at all, checkpoint() returns and mutations run on: the
    operator never waits for a write (checked by ordering, not by a clock)."""
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    for step in range(4):
        mutate(s, step)
    frozen = state_of(s)
    with CheckpointManager(pm, root, "slow", n_workers=2) as mgr:  # probes the root: writes
        gate = faulty.write_gate = threading.Event()
        faulty.reset_counters()
        pending = mgr.checkpoint()  # returns although no byte can be written
        for step in range(4, 8):
            mutate(s, step)  # copy-on-write under the frozen pages, storage still blocked
        assert not pending.done()
        assert faulty.stats().get("written_bytes", 0) == 0
        live = state_of(s)
        gate.set()
        man = pending.result(timeout_s=600)
    assert faulty.stats()["write"] >= 2
    assert state_of(s) == live
    _restores(open_root(str(tmp_path)), "slow", frozen, man.name)  # the freeze point, exactly


def _two_checkpoints(tmp_path: Path, full_every: int = 10):
    pm = new_pm()
    s = open_structures(pm)
    for step in range(4):
        mutate(s, step)
    root = open_root(str(tmp_path))
    states = []
    with CheckpointManager(pm, root, "d", policy=CheckpointPolicy(full_every=full_every)) as mgr:
        for step in (4, 5):
            mutate(s, step)
            mgr.checkpoint().result()
            states.append(state_of(s))
    return root, states


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("full_every", [1, 10], ids=["full", "incremental"])
def test_flipped_byte_is_caught_and_previous_checkpoint_used(tmp_path: Path, full_every: int) -> None:
    """A flipped byte fails the page checksum; recovery warns naming d-2 and uses d-1."""
    root, states = _two_checkpoints(tmp_path, full_every)
    victim = sorted((tmp_path / "checkpoint" / "d-2").glob("*.pages"))[0]
    _flip(victim, victim.stat().st_size // 2 + 100)
    pm = new_pm()
    with pytest.warns(DamagedCheckpointWarning, match=r"checkpoint d-2 .*checksum"):
        man = restore(pm, root, "d")
    assert man.name == "d-1"
    assert state_of(open_structures(pm)) == states[0]
    assert pm.stats()["pinned_frames"] == 0


@pytest.mark.parametrize("damage", ["garbage-manifest", "missing-file", "truncated-file",
                                    "header-swap"])
def test_damaged_latest_checkpoint_falls_back(tmp_path: Path, damage: str) -> None:
    """Unparseable manifests, missing or short files and wrong page headers are skipped."""
    root, states = _two_checkpoints(tmp_path, full_every=1)
    d2 = tmp_path / "checkpoint" / "d-2"
    victim = sorted(d2.glob("*.pages"))[0]
    if damage == "garbage-manifest":
        (d2 / "manifest.json").write_bytes(b'{"format_version": 1, "haunit": ')
    elif damage == "missing-file":
        victim.unlink()
    elif damage == "truncated-file":
        victim.write_bytes(victim.read_bytes()[:-4096])
    else:  # two pages swapped: each checksum moves with its page, the order is wrong
        data = bytearray(victim.read_bytes())
        a, b = bytes(data[:4096]), bytes(data[4096:8192])
        data[:4096], data[4096:8192] = b, a
        victim.write_bytes(bytes(data))
    pm = new_pm()
    with pytest.warns(DamagedCheckpointWarning, match="d-2"):
        assert restore(pm, root, "d").name == "d-1"
    assert state_of(open_structures(pm)) == states[0]


def test_every_checkpoint_damaged_raises_and_names_them(tmp_path: Path) -> None:
    """When nothing restores, CheckpointNotFoundError lists the damaged checkpoints."""
    root, _ = _two_checkpoints(tmp_path, full_every=1)
    for d in ("d-1", "d-2"):
        victim = sorted((tmp_path / "checkpoint" / d).glob("*.pages"))[0]
        _flip(victim, 10)
    with pytest.warns(DamagedCheckpointWarning):
        with pytest.raises(CheckpointNotFoundError, match="d-2, d-1"):
            restore(new_pm(), root, "d")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        restore(new_pm(), root, "other")


def test_damaged_base_of_incremental_chain_falls_back_past_it(tmp_path: Path) -> None:
    """Damage in a page that d-2 references inside d-1 makes both unusable; a clear error."""
    root, states = _two_checkpoints(tmp_path, full_every=10)
    man = restore(new_pm(), root, "d")
    assert man.base == "d-1"
    ref = [i for i, f in enumerate(man.files) if f.checkpoint == "d-1"][0]
    off = int(man.pages.offset[np.flatnonzero(man.pages.file == ref)[0]])
    _flip(tmp_path / man.files[ref].path, off + 200)
    with pytest.warns(DamagedCheckpointWarning) as rec:
        with pytest.raises(CheckpointNotFoundError):
            restore(new_pm(), root, "d")
    msgs = [str(w.message) for w in rec]
    assert "checkpoint d-2 " in msgs[0] and "checkpoint d-1 " in msgs[1]
