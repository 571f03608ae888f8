"""``sguard state convert``: a state written by the PREVIOUS sguard (layout_version 1, the tree
of `V1_COMMIT` run in a subprocess) converted into the key-group layout, then continued by this
sguard's runtime, against a run of this sguard from scratch that never converted.

The old runs checkpoint every 3 batches and log their input past the last checkpoint;
partition 0 also checkpoints its final state, so the old partitions are at different
batches: the conversion brings partition 1 to the last batch with the old code (one
watermark per partition), so the window outputs the old query delivered stay exact.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from ioservice import list_checkpoints, open_root, read_manifest
from sguard.convert import ConvertError, convert, default_key_groups
from sguard.rescale import KILL_ENV, MARKER_FILE
from sguard.spark import CheckpointConfig, RunningAggregate, WindowAggregate
from sguard.keygroups import key_group_of, owner_of
from sguard.spark import inputlog
from sguard.spark.api import schema_to_json
from sguard.spark.columns import KG_COLUMN
from sguard.spark.groupstate import split_by_partition
from sguard.spark.keys import key_spec
from sguard.spark.placement import root_key
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.spark.state import read_local_state
from sguard.statelayout import (CONVERT_COMMAND, LAYOUT_FILE, LayoutError, OperatorLayout,
                                read_layout, write_layout)

# the source checkout (its git history holds V1_COMMIT): $SGUARD_REPO when the suite runs on a
# copy of tests/ against the installed wheel (scripts/test.sh), else this file's checkout
REPO = Path(os.environ.get("SGUARD_REPO") or Path(__file__).resolve().parents[2])
P = 2
OLD_BATCHES = 8   # run by the previous sguard
BATCHES = 12      # in all
EVERY = 3
SCENARIOS = {"running-int": ("running", "int"), "running-str": ("running", "str"),
             "window-int": ("window", "int"), "window-str": ("window", "str")}


def _data(kind: str, seed: int) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(BATCHES):
        n = 300
        k = rng.integers(0, 80, n, dtype=np.int64)
        key: Any = k if kind == "int" else pa.array([f"key-{x}" for x in k.tolist()])
        # timestamps never late under any watermark of lateness 150 (rows of batch b are
        # >= 100 b - 20, the largest time before is < 100 b): every row counts in a window
        out.append(pa.table({"k": key, "v": rng.integers(-50, 50, n, dtype=np.int64),
                             "ts": b * 100 + rng.integers(-20, 100, n, dtype=np.int64)}))
    return out


V1_COMMIT = "668ca26c75ee67dbe871c528b58d38368d368cb4"
"""The last commit that wrote layout_version 1 (the sguard before key groups)."""


def _python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def old_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The version-1 states, as the sguard of `V1_COMMIT` built them: the committed
    ``data/v1_states.tar.gz`` (``tests/sguard/data/make_v1_states.py`` makes it), or built
    here from the git history with ``SGUARD_V1_FROM_SOURCE=1`` (~30 s: the old sguard
    compiles its kernels)."""
    from tests.sguard.data import make_v1_states
    base = tmp_path_factory.mktemp("convert-old")
    if os.environ.get("SGUARD_V1_FROM_SOURCE") == "1":
        return make_v1_states.build(base, REPO)
    return make_v1_states.unpack(base)


Reference = tuple[dict[tuple[int, int], pa.Table], pa.Table]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``ref(name)``: `_reference` of scenario `name` with the default K, run once per
    session (every test that continues a converted state compares with it)."""
    done: dict[str, Reference] = {}

    def ref(name: str) -> Reference:
        if name not in done:
            tables = _data(SCENARIOS[name][1], 100 + list(SCENARIOS).index(name))
            done[name] = _reference(tmp_path_factory.mktemp(f"ref-{name}"), name, tables,
                                    default_key_groups(P))
        return done[name]
    return ref


def _copy(old: Path, tmp: Path) -> Path:
    """A private copy of a built old state."""
    d = tmp / "case"
    shutil.copytree(old, d)
    return d


def _old_batches(d: Path) -> dict[int, int]:
    root = open_root(str(d / "state"))
    out = {}
    for p in range(P):
        cks = [c for c in list_checkpoints(root, f"op.g0.p{p:04d}") if c.has_manifest]
        out[p] = int(read_manifest(root, cks[-1].name).user_meta["batch_id"])
    return out


def _op(name: str) -> Any:
    return (RunningAggregate(value="v") if SCENARIOS[name][0] == "running"
            else WindowAggregate(time="ts", window=50, value="v", lateness=150))


def _config(uri: str, local: str, layout: OperatorLayout, op: Any, schema: pa.Schema
            ) -> RuntimeConfig:
    return RuntimeConfig(state_uri=uri, state_key=root_key(open_root(uri)), layout=layout,
                         operator=op, key="k", input_schema=schema,
                         output_schema=op.output_schema(schema, "k"), local_dir=local,
                         capacity_bytes=1 << 28, metrics=False,
                         checkpoint=CheckpointConfig(every_n_batches=EVERY))


def _run(cfg: RuntimeConfig, tables: list[pa.Table], first: int
         ) -> tuple[dict[tuple[int, int], pa.Table], pa.Table]:
    """Batches ``first..`` of `tables` through the runtime; outputs and the final state."""
    rt = _runtime(cfg)
    outs = {}
    lay = cfg.layout
    for b in range(first, len(tables)):
        parts = split_by_partition(tables[b], "k", lay.num_partitions, lay.key_groups)
        for p, t in enumerate(parts):
            outs[(b, p)] = run_partition_batch(cfg, p, b, t)
    for p in range(lay.num_partitions):
        part = rt.partition(p)
        if part.ckpt is not None:
            part.ckpt.wait()
    for part in rt.parts.values():
        part.slot.release()
    rt.parts.clear()
    st, batches = read_local_state(cfg.state_uri, local_dir=cfg.local_dir)
    assert set(batches.values()) == {len(tables) - 1}, batches
    return outs, st


def _reference(tmp: Path, name: str, tables: list[pa.Table], key_groups: int
               ) -> tuple[dict[tuple[int, int], pa.Table], pa.Table]:
    """This sguard from scratch, never converted, with the same P and K (through the
    `references` fixture: each scenario's is run once)."""
    op = _op(name)
    schema = tables[0].schema
    uri = str(tmp / "ref" / "state")
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=P, key="k", key_groups=key_groups,
                         extra={"arrow_schema": schema_to_json(schema),
                                "keys": key_spec(schema, "k").describe()})
    write_layout(open_root(uri), lay)
    return _run(_config(uri, str(tmp / "ref" / "local"), lay, op, schema), tables, 0)


def _continue(d: Path, name: str, tables: list[pa.Table]
              ) -> tuple[dict[tuple[int, int], pa.Table], pa.Table]:
    """The converted state, continued by this sguard from the first batch the old run did
    not run (its partitions restore the converted checkpoints and replay the old log)."""
    uri = str(d / "state")
    lay = read_layout(open_root(uri))
    assert lay is not None
    return _run(_config(uri, str(d / "local-new"), lay, _op(name), tables[0].schema), tables,
                OLD_BATCHES)


def _old_outputs(d: Path) -> list[pa.Table]:
    return [ipc.open_file(str(d / f"out-b{b}-p{p}.arrow")).read_all()
            for b in range(OLD_BATCHES) for p in range(P)]


def _layout_version(d: Path) -> int:
    return int(json.loads((d / "state" / LAYOUT_FILE).read_bytes())["layout_version"])


def _tree(d: Path, gen: int) -> dict[str, int]:
    """Files (and sizes) of generation `gen`'s checkpoints."""
    base = d / "state" / "checkpoint"
    return {str(p.relative_to(base)): p.stat().st_size for p in base.rglob("*")
            if p.is_file() and f".g{gen}.p" in str(p.relative_to(base)).split("/")[0]}


def _window_rows(t: pa.Table) -> list[tuple[Any, ...]]:
    cols = ["window_start", "k", "count", "sum_v", "min_v", "max_v"]
    return sorted(zip(*[t.column(c).to_pylist() for c in cols]))


def _window_oracle(tables: list[pa.Table]) -> list[tuple[Any, ...]]:
    """Every (window, key)'s aggregate over all rows, in plain Python."""
    acc: dict[tuple[Any, Any], list[int]] = {}
    for t in tables:
        for k, v, ts in zip(*[t.column(c).to_pylist() for c in ("k", "v", "ts")]):
            a = acc.setdefault((ts // 50 * 50, k), [0, 0, v, v])
            a[0] += 1
            a[1] += v
            a[2] = min(a[2], v)
            a[3] = max(a[3], v)
    return sorted((w, k, *a) for (w, k), a in acc.items())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_converted_state_continues_like_a_run_that_never_converted(
        old_states: dict[str, Path], references: Any, tmp_path: Path, name: str) -> None:
    d = _copy(old_states[name], tmp_path)
    tables = _data(SCENARIOS[name][1], 100 + list(SCENARIOS).index(name))
    old_at = _old_batches(d)
    assert old_at[0] == OLD_BATCHES - 1 and 0 <= old_at[1] < OLD_BATCHES - 1, old_at
    before = _tree(d, 0)
    # refused by this sguard's runtime and readers, naming the command
    with pytest.raises(LayoutError, match=CONVERT_COMMAND):
        read_layout(open_root(str(d / "state")))
    with pytest.raises(LayoutError, match=CONVERT_COMMAND):
        read_local_state(str(d / "state"), local_dir=str(d / "local-x"))

    res = convert(str(d / "state"))
    K = default_key_groups(P)
    assert (res.changed, res.generation, res.num_partitions, res.key_groups) == (True, 1, P, K)
    assert res.rows > 0
    lay = read_layout(open_root(str(d / "state")))
    assert lay is not None and (lay.generation, lay.key_groups, lay.num_partitions) == (1, K, P)
    assert not (d / "state" / MARKER_FILE).exists()
    assert _tree(d, 0) == before  # the old generation is never touched
    root = open_root(str(d / "state"))
    for q in range(P):
        man = read_manifest(root, [c for c in list_checkpoints(root, lay.haunit(q))][-1].name)
        um = man.user_meta
        assert um["key_groups"] == list(lay.key_group_range(q)) and um["psid_shift"] == 16
        # the partition behind was brought to the last batch every partition logged, with
        # the old code (one watermark per partition), so no key group needs a replay
        assert um["batch_id"] == OLD_BATCHES - 1 and "kg_batches" not in um
    # rows logged before key groups get theirs computed, as Spark computes it
    b = old_at[1] + 1
    got = [inputlog.read_input(root, b, 1, q, P, "k", key_groups=K) for q in range(P)]
    for q, t in enumerate(got):
        kg = t.column(KG_COLUMN).to_numpy()
        assert (kg == key_group_of(t.select(["k"]), K)).all()
        assert (owner_of(kg, P, K) == q).all()
    assert sum(t.num_rows for t in got) == tables[b].num_rows
    assert not convert(str(d / "state")).changed  # a second run: nothing to do

    out, state = _continue(d, name, tables)
    ref_out, ref_state = references(name)
    if SCENARIOS[name][0] == "running":
        assert state.num_rows > 0 and state.equals(ref_state)
        for bp, t in ref_out.items():
            if bp[0] >= OLD_BATCHES:
                assert out[bp].equals(t), bp
        # and the old run emitted the same rows batch by batch (partitioned otherwise)
        olds = _old_outputs(d)
        for b in range(OLD_BATCHES):
            mine = pa.concat_tables(olds[b * P:(b + 1) * P]).to_pylist()
            theirs = pa.concat_tables([ref_out[(b, p)] for p in range(P)]).to_pylist()
            assert sorted(mine, key=repr) == sorted(theirs, key=repr), b
    else:
        # no row is ever late: every (window, key) is emitted once, or still open, with its
        # whole aggregate, as in the plain-Python oracle and the run that never converted
        emitted = pa.concat_tables(_old_outputs(d) + [out[bp] for bp in sorted(out)])
        got = sorted(_window_rows(emitted) + _window_rows(state))
        keys = [(r[0], r[1]) for r in got]
        assert len(keys) == len(set(keys))
        assert got == _window_oracle(tables)
        ref = pa.concat_tables([ref_out[bp] for bp in sorted(ref_out)])
        assert sorted(_window_rows(ref) + _window_rows(ref_state)) == got
        # the new run's watermark is per key group, the converted one's starts from the old
        # partition's: no later, so every window the reference closed is closed here too
        closed = {(r[0], r[1]) for r in _window_rows(emitted)}
        assert {(r[0], r[1]) for r in _window_rows(ref)} <= closed


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_python(), "-m", "sguard", "state", "convert", *args],
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                          capture_output=True, text=True, timeout=600)


def test_a_killed_convert_leaves_the_old_state_and_a_rerun_completes(
        old_states: dict[str, Path], references: Any, tmp_path: Path) -> None:
    name = "running-int"
    d = _copy(old_states[name], tmp_path)
    uri = str(d / "state")
    before = _tree(d, 0)
    for point in ("marked", "source_converted", "target_written"):
        r = _cli(uri, env={KILL_ENV: point})
        assert r.returncode == -9, (point, r.stderr[-2000:])
        assert _layout_version(d) == 1, point  # the old state is in force
        assert (d / "state" / MARKER_FILE).exists()
        with pytest.raises(LayoutError, match=CONVERT_COMMAND):
            read_layout(open_root(uri))
        assert _tree(d, 0) == before, point
    assert _tree(d, 1)  # the interrupted run wrote part of generation 1
    r = _cli(uri, env={KILL_ENV: "committed"})  # dies after the commit, before the cleanup
    assert r.returncode == -9
    assert _layout_version(d) == 2 and (d / "state" / MARKER_FILE).exists()
    r = _cli(uri)
    assert r.returncode == 0, r.stderr
    assert "nothing to do" in r.stdout and not (d / "state" / MARKER_FILE).exists()
    assert _tree(d, 0) == before
    tables = _data("int", 100 + list(SCENARIOS).index(name))
    _, state = _continue(d, name, tables)
    _, ref_state = references(name)
    assert state.num_rows > 0 and state.equals(ref_state)


def _cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``sguard state convert`` through the CLI's `main` in this process: (exit status,
    stderr). The same parser and messages as `_cli`, without a process start-up each."""
    from sguard.cli import main
    capsys.readouterr()
    try:
        code = main(["state", "convert", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_bad_arguments_and_foreign_leftovers_are_refused_before_any_write(
        old_states: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _copy(old_states["running-int"], tmp_path)
    uri = str(d / "state")
    files = sorted(str(p) for p in (d / "state").rglob("*"))
    for args, msg in ((["--key-groups", "129"], "multiple of the state's 2 partition"),
                      (["--key-groups", "1"], "multiple of the state's 2 partition"),
                      (["--key-groups", "40000"], "at most 32768"),
                      (["--key-groups", "x"], "--key-groups")):
        code, err = _cli_here(capsys, uri, *args)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, (args, err)
    r = _cli(uri, "--key-groups", "129")  # and in a real process: one line, exit 2
    assert r.returncode == 2 and "multiple of the state's 2 partition" in r.stderr \
        and len(r.stderr.strip().splitlines()) == 1, r.stderr
    code, err = _cli_here(capsys, str(tmp_path / "nothing-here"))
    assert code == 2 and "does not exist" in err
    assert sorted(str(p) for p in (d / "state").rglob("*")) == files
    # HA units of the next generation that no conversion made: refused, never deleted
    root = open_root(uri)
    cks = [c for c in list_checkpoints(root, "op.g0.p0000") if c.has_manifest]
    foreign = d / "state" / cks[-1].directory.replace(".g0.", ".g1.", 1)
    shutil.copytree(d / "state" / cks[-1].directory, foreign)
    with pytest.raises(ConvertError, match="no conversion made them"):
        convert(uri)
    assert _layout_version(d) == 1 and not (d / "state" / MARKER_FILE).exists()
    # K = 4 (a multiple of P): converts
    assert foreign.exists()
    shutil.rmtree(foreign)
    res = convert(uri, 4)
    assert res.key_groups == 4 and _layout_version(d) == 2
    code, err = _cli_here(capsys, uri, "--key-groups", "8")
    assert code == 2 and "cannot change" in err


def test_state_show_names_the_command(old_states: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``sguard state show`` (the CLI's `main`, in this process) on a version-1 state."""
    from sguard.cli import main
    d = _copy(old_states["running-str"], tmp_path)
    capsys.readouterr()
    assert main(["state", "show", str(d / "state")]) == 2
    err = capsys.readouterr().err
    assert CONVERT_COMMAND in err, err
