"""Crashes: kill -9 the writing process mid-checkpoint; kill SeaweedFS volume servers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ioservice import (CheckpointManager, CheckpointWriteError, list_checkpoints, open_root,
                       read_manifest, restore)
from ioservice.testing import SeaweedCluster

from tests.ioservice.ckpt_helpers import (REPO, child_env, mutate, new_pm, open_structures,
                                          state_of, step_of)

KILL_TRIALS = int(os.environ.get("SGUARD_KILL_TRIALS", "20"))


def test_kill_dash_9_during_checkpoints_recovers_latest_bit_exact(tmp_path: Path) -> None:
    """20+ times: a child checkpoints in a loop (restoring first), is SIGKILLed at a random
    moment; recovery returns the newest committed checkpoint with exactly its state."""
    uri = f"file://{tmp_path / 'root'}"
    rnd = random.Random(1234)
    model_pm = new_pm()
    model = open_structures(model_pm)
    model_step = -1  # the model holds the state after mutations 0..model_step
    recovered_steps = []
    killed_mid_write = 0
    for trial in range(KILL_TRIALS):
        # odd trials: the child kills itself inside a write (a page write cut in the middle, by
        # construction, whatever the machine's load); even trials: a SIGKILL at a random moment
        env = {"SGUARD_TEST_LATENCY_S": "0.003"}
        if trial % 2:
            env["SGUARD_TEST_DIE_ON_WRITE"] = str(rnd.randint(1, 40))
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.ioservice.ckpt_helpers", "loop", uri, "k"],
            cwd=REPO, env=child_env(env), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        # the kill is timed from the child's first commit of this run, not from its start-up,
        # so a loaded machine (slow imports) changes only how long the trial takes
        line = child.stdout.readline()
        if line.strip() != "committed":
            child.kill()
            pytest.fail(f"trial {trial}: child exited early: {child.stderr.read()[-3000:]!r}")
        if trial % 2:
            child.wait(600)
            assert child.returncode == -signal.SIGKILL, (trial, child.returncode)
        else:
            time.sleep(rnd.uniform(0.0, 0.8))  # it checkpoints back to back meanwhile
            child.send_signal(signal.SIGKILL)
            child.wait(600)
        child.stdout.close()
        child.stderr.close()
        root = open_root(uri)
        committed = [c for c in list_checkpoints(root, "k") if c.has_manifest]
        if not committed:
            continue  # killed before its first commit
        killed_mid_write += any(not c.has_manifest and c.seq > committed[-1].seq
                                for c in list_checkpoints(root, "k"))
        pm = new_pm()
        man = restore(pm, root, "k")
        assert man.name == committed[-1].name, f"trial {trial}: not the latest complete one"
        step = int(man.user_meta["step"])
        got = open_structures(pm)
        assert step_of(got) == step
        assert step >= model_step, "recovery went backwards"
        while model_step < step:
            model_step += 1
            mutate(model, model_step)
        assert state_of(got) == state_of(model), f"trial {trial}: {man.name} (step {step})"
        assert pm.stats()["pinned_frames"] == 0
        recovered_steps.append(step)
    print(f"{KILL_TRIALS} kills: {killed_mid_write} interrupted a page write; "
          f"recovered steps {recovered_steps}")
    assert len(recovered_steps) == KILL_TRIALS  # every trial is killed after a first commit
    assert len(set(recovered_steps)) == KILL_TRIALS, "each run commits past what it restored"
    assert killed_mid_write >= KILL_TRIALS // 2, "the odd trials die inside a page write"


# ------------------------------------------------------------------------ SeaweedFS

def _s3_root(cluster: SeaweedCluster, uri: str, timeout_s: float = 3.0):
    return open_root(uri, s3_endpoint=cluster.s3_endpoint, s3_access_key=cluster.access_key,
                     s3_secret_key=cluster.secret_key, timeout_s=timeout_s, max_attempts=2)


@pytest.mark.seaweedfs
def test_kill_volume_server_after_checkpoint_still_loads(seaweed: SeaweedCluster,
                                                          seaweed_uri: str) -> None:
    """With replication 010, a checkpoint loads after any one volume server dies."""
    root = _s3_root(seaweed, seaweed_uri)
    pm = new_pm()
    s = open_structures(pm)
    for step in range(5):
        mutate(s, step)
    with CheckpointManager(pm, root, "vk") as mgr:
        mgr.checkpoint().result(timeout_s=600)
    want = state_of(s)
    for victim in (2, 0):  # the only rack2 server, then one of rack1
        seaweed.kill_volume(victim)
        try:
            pm2 = new_pm()
            assert restore(pm2, _s3_root(seaweed, seaweed_uri), "vk").name == "vk-1"
            assert state_of(open_structures(pm2)) == want
        finally:
            seaweed.restart_volume(victim)


@pytest.mark.seaweedfs
def test_kill_volume_server_during_checkpoint_completes_or_is_absent(
        seaweed: SeaweedCluster, seaweed_uri: str) -> None:
    """A volume server dies mid-write: the checkpoint commits and restores, or fails
    within a bounded time leaving no manifest, and the previous one still restores."""
    root = _s3_root(seaweed, seaweed_uri, timeout_s=2.0)
    pm = new_pm()
    s = open_structures(pm)
    for step in range(5):
        mutate(s, step, n=3000)
    with CheckpointManager(pm, root, "vd", n_workers=2) as mgr:
        mgr.checkpoint().result(timeout_s=600)
        first = state_of(s)
        mutate(s, 5, n=3000)
        second = state_of(s)
        pending = mgr.checkpoint(full=True)
        killer = threading.Timer(0.01, seaweed.kill_volume, args=(2,))
        killer.start()
        try:
            t0 = time.monotonic()
            outcome = pending.exception(timeout_s=600)
            waited = time.monotonic() - t0
            killer.join()
        finally:
            killer.join()
            seaweed.restart_volume(2)
    assert waited < 600  # bounded: it neither hangs nor retries forever (a hang guard)
    print(f"volume killed mid-checkpoint: {'failed' if outcome else 'committed'} after {waited:.1f} s")
    assert pm.stats()["pinned_frames"] == 0
    names = {c.name for c in list_checkpoints(root, "vd") if c.has_manifest}
    pm2 = new_pm()
    man = restore(pm2, _s3_root(seaweed, seaweed_uri), "vd")
    if outcome is None:
        assert names == {"vd-1", "vd-2"} and man.name == "vd-2"
        assert state_of(open_structures(pm2)) == second
    else:
        assert isinstance(outcome, CheckpointWriteError) and "vd-2" in str(outcome)
        assert names == {"vd-1"} and man.name == "vd-1"
        assert state_of(open_structures(pm2)) == first
