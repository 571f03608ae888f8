"""Issue 8 §4: seeded fuzzing of damaged checkpoints.

Five checkpoints of one HA unit (full and incremental, two page files each,
4 KiB pages) are written once. Each of `N_CASES` cases copies them to a fresh
root, applies seeded random damages to page files and manifests (bit flips,
truncation, deletion, random bytes, files swapped between checkpoints, JSON
edits) and restores into a fresh page manager.

The oracle knows, from the bytes alone, which checkpoints are intact: the
manifest is byte-identical to the one written, and every page it references
lies in a file that still has its recorded size, with the page's bytes
unchanged. The restore must return the newest intact checkpoint, bit-exact
(every page, the structures' contents and ``user_meta``), after one
`DamagedCheckpointWarning` per newer candidate; or raise
`CheckpointNotFoundError` when none is intact. Any other exception, a wrong
checkpoint, wrong bytes or a case running past its time limit fails.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, IOService, open_root, restore
from ioservice.errors import CheckpointNotFoundError, DamagedCheckpointWarning
from ioservice.format import Manifest
from mmm.structures.hashmap import HashMap
from mmm.structures.sequence import PagedList

N_CASES = 520
SEED = 20_081
PAGE_BYTES = 4096
HAUNIT = "fz"
VAL = np.dtype([("n", "<i8"), ("s", "<f8")])
REC = np.dtype([("t", "<i8"), ("x", "<f4")])
KINDS = ("bitflip", "truncate", "delete", "random_bytes", "swap", "json_edit")


def _pm() -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=8 << 20)


def _open(pm: mmm.PageManager) -> tuple[HashMap, PagedList]:
    return (HashMap.create(pm, "counts", key="<u8", value=VAL),
            PagedList.create(pm, "log", REC))


@dataclass
class Ckpt:
    name: str
    manifest: Manifest
    pages: dict[int, bytes]  # page_id -> the page's bytes as written
    counts: dict[int, tuple[int, float]]
    log: bytes
    user_meta: dict[str, Any]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Five checkpoints (full, +1, +2, full, +1) and every file's bytes."""
    return build(tmp_path_factory.mktemp("fuzz"))


def build(base: Path) -> dict[str, Any]:
    """Write the five checkpoints under `base`; return their files and records."""
    pm = _pm()
    hm, log = _open(pm)
    rng = np.random.default_rng(SEED)
    recorded = []
    policy = CheckpointPolicy(full_every=3, keep=None)
    with CheckpointManager(pm, str(base), HAUNIT, policy=policy, n_workers=2) as mgr:
        for step in range(5):
            keys = rng.integers(0, 4000 if step == 0 else 600, 1500).astype("<u8")
            hm.upsert(keys, {"x": rng.random(len(keys))}, {"n": "count", "s": ("sum", "x")})
            if step == 2:
                hm.delete(rng.integers(0, 4000, 300).astype("<u8"))
            recs = np.zeros(200, REC)
            recs["t"] = step
            recs["x"] = rng.random(200)
            log.extend(recs)
            man = mgr.checkpoint({"input_offset": 1000 * step, "step": step}).result()
            k, v = hm.items()
            recorded.append((man, {int(a): (int(b["n"]), float(b["s"])) for a, b in zip(k, v)},
                             log.to_numpy().tobytes()))
    files = {p.relative_to(base).as_posix(): p.read_bytes()
             for p in sorted(base.rglob("*")) if p.is_file()}
    ckpts = []
    for man, counts, log_bytes in recorded:
        pages = {}
        for i in range(man.n_pages):
            data = files[man.files[int(man.pages.file[i])].path]
            off = int(man.pages.offset[i])
            pages[int(man.pages.page_id[i])] = data[off:off + PAGE_BYTES]
        ckpts.append(Ckpt(man.name, man, pages, counts, log_bytes, dict(man.user_meta)))
    assert [c.manifest.full for c in ckpts] == [True, False, False, True, False]
    assert any(len(c.manifest.referenced_checkpoints) > 1 for c in ckpts)
    return {"files": files, "ckpts": ckpts}


# ----------------------------------------------------------------- damages


def _damage(files: dict[str, bytes | None], ckpts: list[Ckpt],
            rng: np.random.Generator) -> str:
    """Apply one random damage to `files` in place; return its kind."""
    weights = np.arange(1, len(ckpts) + 1, dtype=float)  # newer checkpoints more often
    c = ckpts[int(rng.choice(len(ckpts), p=weights / weights.sum()))]
    names = sorted(rel for rel in files if rel.split("/")[1] == c.name)
    if rng.random() < 0.5:
        rel = f"checkpoint/{c.name}/manifest.json"
    else:
        rel = names[int(rng.integers(len(names)))]
    kind = KINDS[int(rng.integers(len(KINDS)))]
    data = files.get(rel)
    if kind == "json_edit" and (not rel.endswith(".json") or data is None):
        kind = "bitflip"
    if data is None and kind != "swap":
        kind = "swap"  # the file is gone: swap something else in
    if kind == "bitflip" and data:
        buf = bytearray(data)
        i = int(rng.integers(len(buf)))
        buf[i] ^= 1 << int(rng.integers(8))
        files[rel] = bytes(buf)
    elif kind == "truncate" and data:
        files[rel] = data[:int(rng.integers(len(data)))]
    elif kind == "delete":
        files[rel] = None
    elif kind == "random_bytes" and data is not None:
        if rng.random() < 0.5 and data:
            i = int(rng.integers(len(data)))
            n = int(rng.integers(1, 257))
            files[rel] = data[:i] + rng.integers(0, 256, n, np.uint8).tobytes() + data[i + n:]
        else:
            files[rel] = rng.integers(0, 256, int(rng.integers(0, 2 * len(data) + 2)),
                                      np.uint8).tobytes()
    elif kind == "json_edit":
        assert data is not None
        files[rel] = _json_edit(data, rng)
    else:  # swap with a file of another checkpoint (same name when there is one)
        kind = "swap"
        others = [o for o in ckpts if o.name != c.name]
        o = others[int(rng.integers(len(others)))]
        other = f"checkpoint/{o.name}/{rel.rsplit('/', 1)[1]}"
        if other not in files or rng.random() < 0.2:
            pool = sorted(r for r in files if r.split("/")[1] == o.name)
            other = pool[int(rng.integers(len(pool)))]
        files[rel], files[other] = files.get(other), files.get(rel)
    return kind


def _json_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """Replace one random leaf of a JSON document with a random (bad) value."""
    try:
        doc = json.loads(data)
    except ValueError:
        buf = bytearray(data)
        if buf:
            buf[int(rng.integers(len(buf)))] ^= 0x40
        return bytes(buf)
    leaves: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for k, v in items:
            leaves.append((node, k))
            walk(v)

    walk(doc)
    if not leaves:
        return data + b" "
    numbers = [(n, k) for n, k in leaves if type(n[k]) in (int, float)]
    pick = numbers if numbers and rng.random() < 0.6 else leaves
    node, key = pick[int(rng.integers(len(pick)))]
    choices: list[Any] = [-1, -4096, -2**70, 2**64, 2**64 + 4096, 2**200, 0, 1.5, -0.0, 1e300,
                          "x", "", None, True, [], {}, [[[[[]]]]], "AAAA", "checkpoint/../x",
                          _DEEP]
    new = choices[int(rng.integers(len(choices)))]
    old = node[key]
    if type(new) is type(old) and new == old:
        new = "changed"
    node[key] = new
    text = json.dumps(doc, indent=1)
    deep = 50_000
    return text.replace(json.dumps(_DEEP), "[" * deep + "]" * deep).encode()


_DEEP = "__deeply nested__"


def _plan(case: int, pristine: dict[str, Any]) -> tuple[dict[str, bytes | None], list[str]]:
    """The damaged file set of `case` (None: deleted) and the kinds applied."""
    rng = np.random.default_rng([SEED, case])
    files: dict[str, bytes | None] = dict(pristine["files"])
    n = int(rng.integers(5, 13)) if rng.random() < 0.1 else 1 + int(rng.geometric(0.55)) - 1
    kinds = [_damage(files, pristine["ckpts"], rng) for _ in range(n)]
    return files, kinds


def _intact(c: Ckpt, files: dict[str, bytes | None], pristine: dict[str, Any]) -> bool:
    """Whether checkpoint `c` is restorable from `files`, by bytes alone (the oracle)."""
    if files.get(c.manifest.manifest_path) != pristine["files"][c.manifest.manifest_path]:
        return False
    m = c.manifest
    for f in m.files:
        data = files.get(f.path)
        if data is None or len(data) < f.size_bytes:
            return False
    for i in range(m.n_pages):
        data = files[m.files[int(m.pages.file[i])].path]
        assert data is not None
        off = int(m.pages.offset[i])
        if data[off:off + PAGE_BYTES] != c.pages[int(m.pages.page_id[i])]:
            return False
    return True


def _expected(files: dict[str, bytes | None], pristine: dict[str, Any]) -> Ckpt | None:
    for c in reversed(pristine["ckpts"]):
        if _intact(c, files, pristine):
            return c  # type: ignore[no-any-return]
    return None


# ------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def io() -> Any:
    with IOService(2) as service:
        yield service


@pytest.fixture(scope="module")
def live_pm() -> mmm.PageManager:
    """One page manager every case restores into: frames of earlier, larger
    states (and of abandoned candidates) are reused, as in a long-lived operator."""
    return _pm()


@pytest.mark.timeout(600)  # a hang guard (it counts the module fixture's set-up too)
@pytest.mark.parametrize("case", range(N_CASES))
def test_restore_after_random_damage(case: int, pristine: dict[str, Any], io: IOService,
                                     live_pm: mmm.PageManager, tmp_path: Path) -> None:
    files, kinds = _plan(case, pristine)
    for rel, data in files.items():
        if data is not None:
            p = tmp_path / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    want = _expected(files, pristine)
    ckpts: list[Ckpt] = pristine["ckpts"]
    newer = ckpts[ckpts.index(want) + 1:] if want is not None else ckpts
    tried = [c.name for c in newer if files.get(c.manifest.manifest_path) is not None]
    pm = live_pm if case % 2 else _pm()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if want is None:
            with pytest.raises(CheckpointNotFoundError):
                restore(pm, open_root(str(tmp_path)), HAUNIT, io=io)
            assert pm.names() == [] and pm.stats()["used_frames"] == 0
        else:
            man = restore(pm, open_root(str(tmp_path)), HAUNIT, io=io)
            assert man.name == want.name, f"damages {kinds}: restored {man.name}, want {want.name}"
            assert dict(man.user_meta) == want.user_meta
            assert pm.stats()["used_frames"] == len(want.pages)
            for pid, data in want.pages.items():
                assert pm.page(pid).tobytes() == data, f"page {pid:#x} differs"
            hm, log = _open(pm)
            k, v = hm.items()
            assert {int(a): (int(b["n"]), float(b["s"])) for a, b in zip(k, v)} == want.counts
            assert log.to_numpy().tobytes() == want.log
            # the restored state keeps working: new pages come from reused frames
            rng = np.random.default_rng(case)
            keys = rng.integers(0, 8000, 800).astype("<u8")
            hm.upsert(keys, {"x": np.ones(len(keys))}, {"n": "count", "s": ("sum", "x")})
            hm.delete(keys[:100])
            oracle = dict(want.counts)
            for key in keys.tolist():
                n, total = oracle.get(key, (0, 0.0))
                oracle[key] = (n + 1, total + 1.0)
            for key in keys[:100].tolist():
                oracle.pop(key, None)
            k, v = hm.items()
            assert len(np.unique(k)) == len(k) == len(oracle)
            got = {int(a): (int(b["n"]), float(b["s"])) for a, b in zip(k, v)}
            assert got.keys() == oracle.keys()
            assert all(got[x][0] == oracle[x][0] and abs(got[x][1] - oracle[x][1]) < 1e-6
                       for x in oracle)
    skipped = [str(x.message).split()[1] for x in w
               if issubclass(x.category, DamagedCheckpointWarning)]
    assert skipped == tried[::-1], f"damages {kinds}"


def test_fuzz_covers_every_damage_and_outcome(pristine: dict[str, Any]) -> None:
    """The seeded plan exercises every damage kind and every kind of outcome."""
    kinds: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    newest = pristine["ckpts"][-1].name
    for case in range(N_CASES):
        files, ks = _plan(case, pristine)
        kinds.update(ks)
        want = _expected(files, pristine)
        outcomes["none" if want is None else "newest" if want.name == newest else "older"] += 1
    assert sum(kinds.values()) >= 500
    assert all(kinds[k] >= 40 for k in KINDS), kinds
    assert outcomes["older"] >= 200 and outcomes["none"] >= 5 and outcomes["newest"] >= 20, \
        outcomes
