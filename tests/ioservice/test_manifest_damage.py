"""Issue 8 §4: a damaged manifest is always the project's own corruption error.

Every damage below (numbers out of range, deep nesting, wrong types,
truncation, random bytes, an altered field) must make `Manifest.from_json`
raise `ManifestError` (a `CheckpointDamagedError`), make `restore` fall back
to the previous checkpoint with a `DamagedCheckpointWarning`, and leave
``sguard checkpoints ls --all`` / ``verify`` answering without a traceback.

Field edits come in two variants: *unsealed* (the document checksum no longer
matches) and *sealed* (the checksum recomputed, as a buggy or hostile writer
would): the sealed ones prove the range and type checks themselves.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, open_root, restore
from ioservice.errors import (CheckpointDamagedError, CheckpointNotFoundError,
                              DamagedCheckpointWarning, InvalidNameError, InvalidURIError,
                              ManifestError)
from ioservice.format import (DOCUMENT_CHECKSUM_KEY, FORMAT_VERSION, Manifest, PageFile,
                              PageTable, document_checksum)
from mmm.structures.hashmap import HashMap
from sguard.cli import main
from tests.ioservice.ckpt_helpers import REPO, child_env

Doc = dict[str, Any]
VAL = np.dtype([("n", "<i8")])


def _pm() -> mmm.PageManager:
    return mmm.PageManager(page_bytes=4096, capacity_bytes=16 << 20)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two checkpoints of HA unit "m" (full, then incremental); their files' bytes."""
    base = tmp_path_factory.mktemp("damage")
    pm = _pm()
    hm = HashMap.create(pm, "counts", key="<u8", value=VAL)
    states = []
    with CheckpointManager(pm, str(base), "m", policy=CheckpointPolicy(keep=None),
                           n_workers=2) as mgr:
        for step in range(2):
            hm.upsert(np.arange(step * 1000, step * 1000 + 3000, dtype="<u8"),
                      combine={"n": "count"})
            mgr.checkpoint({"input_offset": 1000 * (step + 1)}).result()
            k, v = hm.items()
            states.append(dict(zip(k.tolist(), v["n"].tolist())))
    files = {p.relative_to(base).as_posix(): p.read_bytes()
             for p in sorted(base.rglob("*")) if p.is_file()}
    return {"files": files, "states": states}


def _root_with(tmp_path: Path, pristine: dict[str, Any], manifest: bytes | None) -> Path:
    """A copy of the pristine root whose newest manifest (m-2) is `manifest`."""
    for rel, data in pristine["files"].items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    if manifest is not None:
        (tmp_path / "checkpoint/m-2/manifest.json").write_bytes(manifest)
    return tmp_path


def _newest_doc(pristine: dict[str, Any]) -> Doc:
    doc: Doc = json.loads(pristine["files"]["checkpoint/m-2/manifest.json"])
    return doc


def _encode(doc: Doc, seal: bool) -> bytes:
    doc = copy.deepcopy(doc)
    if seal:
        doc[DOCUMENT_CHECKSUM_KEY] = document_checksum(doc)
    return json.dumps(doc).encode()


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def edit(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


def _drop(key: str) -> Callable[[Doc], None]:
    return lambda doc: doc.pop(key)


FIELD_EDITS: dict[str, Callable[[Doc], None]] = {
    "size_bytes negative": _set("files.0.size_bytes", -4096),
    "size_bytes huge": _set("files.0.size_bytes", 2**64 + 4096),
    "size_bytes 2**70": _set("files.0.size_bytes", 2**70),
    "size_bytes float": _set("files.0.size_bytes", 4096.0),
    "size_bytes bool": _set("files.0.size_bytes", True),
    "size_bytes unaligned": _set("files.0.size_bytes", 4097),
    "page_bytes zero": _set("page_bytes", 0),
    "page_bytes negative": _set("page_bytes", -4096),
    "page_bytes huge": _set("page_bytes", 2**64),
    "page_bytes not power of two": _set("page_bytes", 6144),
    "page_bytes string": _set("page_bytes", "4096"),
    "seq negative": _set("seq", -2),
    "seq huge": _set("seq", 2**80),
    "seq null": _set("seq", None),
    "snapshot_id negative": _set("snapshot_id", -1),
    "snapshot_id huge": _set("snapshot_id", 2**64),
    "depth negative": _set("depth", -1),
    "depth huge": _set("depth", 2**63),
    "created negative": _set("created_unix_s", -5.0),
    "created huge": _set("created_unix_s", 1e308),
    "created string": _set("created_unix_s", "yesterday"),
    "full as int": _set("full", 1),
    "full but base": _set("full", True),
    "base another unit": _set("base", "x-1"),
    "base newer": _set("base", "m-7"),
    "base int": _set("base", 1),
    "structures list": _set("structures", []),
    "structure psid negative": _set("structures", {"counts": -1}),
    "structure psid huge": _set("structures", {"counts": 2**70}),
    "structure psid string": _set("structures", {"counts": "1"}),
    "user_meta list": _set("user_meta", [1, 2]),
    "files dict": _set("files", {}),
    "file not dict": _set("files.0", 7),
    "file path int": _set("files.0.path", 7),
    "file path escapes": _set("files.0.path", "checkpoint/../../etc/passwd"),
    "file extra key": _set("files.0.mode", "x"),
    "file missing size": lambda d: d["files"][0].pop("size_bytes"),
    "n_pages negative": _set("page_table.n_pages", -1),
    "n_pages huge": _set("page_table.n_pages", 2**64),
    "n_pages string": _set("page_table.n_pages", "3"),
    "columns list": _set("page_table.columns", []),
    "column not pair": _set("page_table.columns.offset", "x"),
    "column dtype": _set("page_table.columns.offset.0", "<i8"),
    "column not base64": _set("page_table.columns.offset.1", "!!!!"),
    "column short": _set("page_table.columns.offset.1", "AAAAAAAAAAA="),
    "table checksum int": _set("page_table.xxh3_64", 5),
    "encoding": _set("page_table.encoding", "hex"),
    "kind": _set("kind", "something-else"),
    "name mismatch": _set("name", "m-1"),
    "haunit invalid": _set("haunit", "../m"),
    "haunit other": _set("haunit", "x"),
    "unknown field": _set("extra", 1),
    "missing files": _drop("files"),
    "missing user_meta": _drop("user_meta"),
    "missing base": _drop("base"),
    "version float": _set("format_version", 2.0),
    "version bool": _set("format_version", True),
    "version string": _set("format_version", "2"),
    "version future": _set("format_version", 99),
    "version 0": _set("format_version", 0),
}

# fields whose changed value is still well formed: only the document checksum catches it
ALTERED: dict[str, Callable[[Doc], None]] = {
    "user_meta input position": _set("user_meta.input_offset", 10**6),
    "user_meta extra key": _set("user_meta.replay_from", 0),
    "created_unix_s": _set("created_unix_s", 1.0),
    "snapshot_id": _set("snapshot_id", 12345),
    "structure psid": _set("structures.counts", 9),
    "document checksum": _set(DOCUMENT_CHECKSUM_KEY, "0" * 16),
    "checksum removed": _drop(DOCUMENT_CHECKSUM_KEY),
}


def _raw_cases(good: bytes) -> dict[str, bytes]:
    deep = 200_000
    cases = {
        "empty": b"",
        "null": b"null",
        "list": b"[]",
        "number": b"12",
        "string": b'"manifest"',
        "deep array": b"[" * deep + b"]" * deep,
        "deep object": b'{"a":' * deep + b"1" + b"}" * deep,
        "deep user_meta": good.replace(b'"user_meta": {', b'"user_meta": {"x": ' + b"[" * deep
                                       + b"]" * deep + b", ", 1),
        "integer of 5000 digits": good.replace(b'"seq": 2', b'"seq": ' + b"9" * 5000, 1),
        "size_bytes of 5000 digits": good.replace(b'"size_bytes": ', b'"size_bytes": '
                                                  + b"9" * 5000, 1),
        "NaN": good.replace(b'"created_unix_s": ', b'"created_unix_s": NaN, "x": ', 1),
        "Infinity": good.replace(b'"created_unix_s": ', b'"created_unix_s": Infinity, "x": ', 1),
        "1e999": good.replace(b'"created_unix_s": ', b'"created_unix_s": 1e999, "x": ', 1),
        "not utf-8": b"\xff\xfe" + good[2:],
        "nul bytes": good[:100] + b"\x00" * 50 + good[150:],
        "random bytes": np.random.default_rng(1).integers(0, 256, 3000, np.uint8).tobytes(),
        "random ascii": np.random.default_rng(2).integers(32, 127, 3000, np.uint8).tobytes(),
    }
    for frac in (0.0001, 0.1, 0.5, 0.9, 0.999):
        cases[f"truncated at {frac:.2%}"] = good[:int(len(good) * frac)]
    return cases


def _cases(pristine: dict[str, Any]) -> dict[str, bytes]:
    good = pristine["files"]["checkpoint/m-2/manifest.json"]
    doc = _newest_doc(pristine)
    out = _raw_cases(good)
    for name, edit in FIELD_EDITS.items():
        d = copy.deepcopy(doc)
        d.pop(DOCUMENT_CHECKSUM_KEY)
        edit(d)
        out[f"{name} (sealed)"] = _encode(d, seal=True)
        out[f"{name} (unsealed)"] = _encode({**d, DOCUMENT_CHECKSUM_KEY:
                                             doc[DOCUMENT_CHECKSUM_KEY]}, seal=False)
    for name, edit in ALTERED.items():
        d = copy.deepcopy(doc)
        edit(d)
        out[f"altered {name}"] = _encode(d, seal=False)
    return out


def _all_case_names() -> list[str]:
    fake_good = json.dumps({"seq": 2, "size_bytes": 1, "user_meta": {},
                            "created_unix_s": 1.0}).encode()
    names = list(_raw_cases(fake_good))
    names += [f"{n} ({s})" for n in FIELD_EDITS for s in ("sealed", "unsealed")]
    names += [f"altered {n}" for n in ALTERED]
    return names


@pytest.mark.timeout(600)  # a hang guard
def test_every_damage_is_a_manifest_error(pristine: dict[str, Any]) -> None:
    cases = _cases(pristine)
    assert sorted(cases) == sorted(_all_case_names())
    for name, data in cases.items():
        try:
            Manifest.from_json(data, where="m-2")
        except ManifestError as exc:
            assert "m-2" in str(exc), (name, exc)
            assert len(str(exc)) < 600, (name, len(str(exc)))  # no 5000-digit echo
        else:
            pytest.fail(f"{name}: accepted")


@pytest.mark.timeout(600)  # a hang guard
@pytest.mark.parametrize("case", _all_case_names())
def test_restore_falls_back_and_cli_answers(case: str, pristine: dict[str, Any],
                                            tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = _root_with(tmp_path, pristine, _cases(pristine)[case])
    pm = _pm()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        man = restore(pm, open_root(str(root)), "m")
    assert man.name == "m-1" and man.user_meta == {"input_offset": 1000}
    assert [str(x.message) for x in w if issubclass(x.category, DamagedCheckpointWarning)]
    k, v = HashMap.create(pm, "counts", key="<u8", value=VAL).items()
    assert dict(zip(k.tolist(), v["n"].tolist())) == pristine["states"][0]
    assert main(["checkpoints", "ls", "--all", str(root)]) == 0
    out = capsys.readouterr().out
    assert "m-1" in out and "DAMAGED" in out.split("m-2", 1)[1].splitlines()[0]
    assert main(["checkpoints", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED m-2" in out and "ok      m-1" in out


def test_ls_all_on_damaged_root_prints_no_traceback(pristine: dict[str, Any],
                                                    tmp_path: Path) -> None:
    """The command line as a user runs it: one line per checkpoint, no traceback."""
    doc = _newest_doc(pristine)
    doc.pop(DOCUMENT_CHECKSUM_KEY)
    doc["files"][0]["size_bytes"] = -4096  # an OverflowError before the fix
    root = _root_with(tmp_path, pristine, _encode(doc, seal=True))
    (root / "checkpoint/m-3").mkdir()  # a partial checkpoint: no manifest
    (root / "checkpoint/m-3/w000.pages").write_bytes(b"x" * 10)
    proc = subprocess.run([sys.executable, "-m", "sguard", "checkpoints", "ls", "--all",
                           str(root)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.startswith("  m-")}
    assert "DAMAGED" in lines["m-2"] and "ManifestError" in lines["m-2"]
    assert "partial" in lines["m-3"] and "full" in lines["m-1"]


# --------------------------------------------------------- format versions


def test_current_manifests_carry_the_document_checksum(pristine: dict[str, Any]) -> None:
    doc = _newest_doc(pristine)
    assert doc["format_version"] == FORMAT_VERSION == 2
    body = {k: v for k, v in doc.items() if k != DOCUMENT_CHECKSUM_KEY}
    assert doc[DOCUMENT_CHECKSUM_KEY] == document_checksum(body)
    # the layout of the file does not matter, only the document
    compact = json.dumps(doc, separators=(",", ":")).encode()
    assert Manifest.from_json(compact).user_meta == {"input_offset": 2000}


def _as_version_1(doc: Doc) -> Doc:
    v1 = {k: v for k, v in doc.items() if k != DOCUMENT_CHECKSUM_KEY}
    v1["format_version"] = 1
    return v1


def test_version_1_checkpoints_still_restore(pristine: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint written by the previous format (no document checksum) restores."""
    v1 = {name: _as_version_1(json.loads(pristine["files"][f"checkpoint/{name}/manifest.json"]))
          for name in ("m-1", "m-2")}
    root = _root_with(tmp_path, pristine, json.dumps(v1["m-2"], indent=1).encode())
    (root / "checkpoint/m-1/manifest.json").write_text(json.dumps(v1["m-1"], indent=1))
    pm = _pm()
    man = restore(pm, open_root(str(root)), "m")
    assert man.name == "m-2" and man.format_version == 1
    k, v = HashMap.create(pm, "counts", key="<u8", value=VAL).items()
    assert dict(zip(k.tolist(), v["n"].tolist())) == pristine["states"][1]
    # the next checkpoint builds on it, in the current format
    with CheckpointManager(pm, str(root), "m") as mgr:
        assert mgr.restore() is not None
        HashMap.create(pm, "counts", key="<u8", value=VAL).upsert(
            np.array([1], "<u8"), combine={"n": "count"})
        new = mgr.checkpoint().result()
    assert not new.full and new.base == "m-2"
    assert json.loads((root / new.manifest_path).read_bytes())["format_version"] == 2
    assert restore(_pm(), open_root(str(root)), "m").name == new.name


def test_version_downgrade_with_checksum_field_is_refused(pristine: dict[str, Any]) -> None:
    """Claiming version 1 does not switch the document checksum off while it is there."""
    doc = _newest_doc(pristine)
    doc["format_version"] = 1
    with pytest.raises(ManifestError, match="unknown field"):
        Manifest.from_json(json.dumps(doc).encode())


def test_version_1_structure_checks_still_apply(pristine: dict[str, Any]) -> None:
    doc = _as_version_1(_newest_doc(pristine))
    doc["files"][0]["size_bytes"] = -1
    with pytest.raises(ManifestError, match="size_bytes"):
        Manifest.from_json(json.dumps(doc).encode())


# ----------------------------------------------------- names and roots


@pytest.mark.parametrize("haunit", [None, "", "   ", " m", "m ", "\t", 3])
def test_restore_refuses_missing_or_blank_haunit(haunit: Any, pristine: dict[str, Any],
                                                 tmp_path: Path) -> None:
    root = _root_with(tmp_path, pristine, None)
    pm = _pm()
    HashMap.create(pm, "mine", key="<u8", value=VAL).put(np.array([5], "<u8"),
                                                         np.array([(7,)], VAL))
    with pytest.raises(InvalidNameError):
        restore(pm, open_root(str(root)), haunit)
    assert pm.names() == ["mine"]  # untouched


@pytest.mark.parametrize("uri", ["", " ", "   ", "\t", "\n", " /tmp/x", "/tmp/x ",
                                 " s3://bucket/p"])
def test_open_root_refuses_blank_uris(uri: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidURIError):
        open_root(uri)
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize("cmd", ["ls", "verify", "show"])
def test_cli_missing_root_is_an_error_and_not_created(cmd: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "root"
    for uri in (str(missing), f"file://{missing}"):
        assert main(["checkpoints", cmd, uri]) == 2
        err = capsys.readouterr().err.strip()
        assert "does not exist" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "no").exists()


def test_cli_blank_uri_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "ls", "   "]) == 2
    assert "blank" in capsys.readouterr().err


def test_all_damaged_gives_checkpoint_not_found(pristine: dict[str, Any],
                                                tmp_path: Path) -> None:
    root = _root_with(tmp_path, pristine, b"{")
    (root / "checkpoint/m-1/manifest.json").write_bytes(b"[" * 100_000)
    pm = _pm()
    HashMap.create(pm, "mine", key="<u8", value=VAL).put(np.array([5], "<u8"),
                                                         np.array([(7,)], VAL))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedCheckpointWarning)
        with pytest.raises(CheckpointNotFoundError, match="damaged: m-2, m-1"):
            restore(pm, open_root(str(root)), "m")
    # documented: empty, even though no candidate got as far as loading pages
    assert pm.names() == [] and pm.stats()["used_frames"] == 0
    assert issubclass(ManifestError, CheckpointDamagedError)


def test_cli_show_refuses_a_blank_checkpoint_name(pristine: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = _root_with(tmp_path, pristine, None)
    assert main(["checkpoints", "show", str(root), "   "]) == 2
    assert "not a checkpoint name" in capsys.readouterr().err
    assert main(["checkpoints", "show", str(root), "m-2"]) == 0
    assert "over the whole manifest" in capsys.readouterr().out


def test_non_canonical_base64_column_is_refused() -> None:
    """Two texts decoding to the same column bytes would slip past both checksums."""
    one = np.ones(1, np.uint64)
    man = Manifest("m", 1, 1, 4096, True, 0, None, (PageFile("checkpoint/m-1/w000.pages", 4096),),
                   PageTable(one * 0, np.zeros(1, np.uint32), one * 0, one * 7), {}, {})
    doc = json.loads(man.to_json())
    text = doc["page_table"]["columns"]["checksum"][1]
    assert text.endswith("=")  # 8 bytes: the last character carries unused bits
    i = len(text.rstrip("=")) - 1
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    twins = [t for t in (text[:i] + ch + text[i + 1:] for ch in alphabet)
             if t != text and base64.b64decode(t) == base64.b64decode(text)]
    assert twins
    doc["page_table"]["columns"]["checksum"][1] = twins[0]
    doc[DOCUMENT_CHECKSUM_KEY] = document_checksum(doc)
    with pytest.raises(ManifestError, match="canonical base64"):
        Manifest.from_json(json.dumps(doc).encode())
