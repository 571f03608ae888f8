"""Build ``v1_states.tar.gz``: the version-1 states `tests/sguard/test_convert.py` converts,
written by the PREVIOUS sguard (``test_convert.V1_COMMIT``, layout_version 1, the tree of
that commit run in a subprocess by ``tests/sguard/_old_state_builder.py``).

The archive is committed so that the suite does not compile the old sguard's numba kernels
on every run (~30 s of a core); it is re-made only if a scenario changes:

    .venv/bin/python -m tests.sguard.data.make_v1_states      # from the checkout's root

Each scenario's directory holds ``data/b<b>.arrow`` (every batch of its input, those the new
sguard continues with too), ``state/`` (the old query's durable state: checkpoints every
`EVERY` batches, the input log past them) and ``out-b<b>-p<p>.arrow`` (what the old query
delivered). The old query's live local state is left out: no test reads it.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pyarrow.ipc as ipc

ARCHIVE = Path(__file__).with_name("v1_states.tar.gz")
BUILDER = Path(__file__).resolve().parents[1] / "_old_state_builder.py"


def build(base: Path, repo: Path) -> dict[str, Path]:
    """Build every scenario of test_convert under `base` with the sguard of V1_COMMIT from
    the git history of `repo`; ``{scenario: its directory}``."""
    from tests.sguard.test_convert import EVERY, OLD_BATCHES, P, SCENARIOS, V1_COMMIT, _data
    src = base / "oldsrc"
    src.mkdir()
    arch = subprocess.run(["git", "-C", str(repo), "archive", V1_COMMIT, "sguard", "mmm",
                           "ioservice", "peace"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=arch.stdout, check=True)
    specs = []
    out: dict[str, Path] = {}
    for i, (name, (op, kind)) in enumerate(SCENARIOS.items()):
        d = base / name
        (d / "data").mkdir(parents=True)
        for b, t in enumerate(_data(kind, 100 + i)):
            with ipc.new_file(str(d / "data" / f"b{b}.arrow"), t.schema) as w:
                w.write_table(t)
        specs.append({"dir": str(d), "data": str(d / "data"), "op": op,
                      "batches": OLD_BATCHES, "every": EVERY, "P": P})
        out[name] = d
    env = {**os.environ, "PYTHONPATH": str(src)}
    res = subprocess.run([sys.executable, str(BUILDER), json.dumps(specs)], env=env,
                         cwd=str(base), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-3000:] + res.stderr[-5000:])
    return out


def pack(dirs: dict[str, Path], archive: Path) -> None:
    """The scenarios' directories (without their live local state) as a reproducible
    tar.gz: sorted, owner 0, mtime 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, d in sorted(dirs.items()):
            for p in sorted([d, *d.rglob("*")]):
                rel = p.relative_to(d.parent)
                if rel.parts[1:2] == ("local-old",):
                    continue
                info = tar.gettarinfo(str(p), str(rel))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if p.is_file():
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    import gzip
    with open(archive, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(buf.getvalue())


def unpack(dest: Path, archive: Path = ARCHIVE) -> dict[str, Path]:
    """Extract the committed states under `dest`; ``{scenario: its directory}``."""
    from tests.sguard.test_convert import SCENARIOS
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return {name: dest / name for name in SCENARIOS}


if __name__ == "__main__":
    repo = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory() as tmp:
        pack(build(Path(tmp), repo), ARCHIVE)
    print(f"{ARCHIVE}: {ARCHIVE.stat().st_size} bytes")
