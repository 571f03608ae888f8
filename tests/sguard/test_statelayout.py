"""The layout document survives a failed replacement on a store without rename (S3)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from ioservice import StorageRoot, open_root
from ioservice.errors import StorageIOError
from sguard.statelayout import (LAYOUT_FILE, LayoutError, OperatorLayout, read_layout,
                                schema_from_layout, schema_to_json, write_layout)


class S3LikeRoot(StorageRoot):
    """A real local root whose `write_atomic` of the layout file fails the way S3's does.

    `StorageRoot.write_atomic` on S3 deletes the target when the PUT fails (pyarrow
    cannot abort an upload); this wrapper does exactly that for `LAYOUT_FILE` when
    armed, on the real filesystem.
    """

    fail_layout = False

    def write_atomic(self, relpath: str, data: Any) -> None:
        if self.fail_layout and relpath == LAYOUT_FILE:
            self.delete_file(relpath, missing_ok=True)
            raise StorageIOError(f"injected: PUT of {relpath} failed")
        super().write_atomic(relpath, data)


def _layout(gen: int, parts: int) -> OperatorLayout:
    return OperatorLayout(operator="running_aggregate", name="agg", schema={"key": "i8"},
                          num_partitions=parts, key="k", generation=gen)


def test_new_root_has_no_layout(tmp_path: Path) -> None:
    assert read_layout(open_root(str(tmp_path))) is None


def test_failed_replacement_on_s3_leaves_the_new_generation_readable(tmp_path: Path) -> None:
    root = S3LikeRoot(pafs.LocalFileSystem(), str(tmp_path))
    write_layout(root, _layout(0, 2))
    write_layout(root, _layout(1, 4))
    root.fail_layout = True
    with pytest.raises(StorageIOError):
        write_layout(root, _layout(2, 8))
    assert not (tmp_path / LAYOUT_FILE).exists()
    # the state is not mistaken for a new one: generation 2 was complete before its commit
    assert read_layout(root) == _layout(2, 8)
    root.fail_layout = False
    write_layout(root, replace(_layout(2, 8), extra={"note": "x"}))
    assert read_layout(root) == replace(_layout(2, 8), extra={"note": "x"})


def test_failed_copy_leaves_the_layout_as_it_was(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    write_layout(root, _layout(0, 2))
    (tmp_path / "layout" / "g00000001.json").mkdir()  # the copy cannot be written
    with pytest.raises(Exception):
        write_layout(root, _layout(1, 4))
    assert read_layout(root) == _layout(0, 2)


def test_the_layout_file_wins_over_copies(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    write_layout(root, _layout(0, 2))
    (tmp_path / "layout" / "g00000007.json").write_bytes(_layout(7, 3).to_json())
    assert read_layout(root) == _layout(0, 2)


def test_a_damaged_copy_is_an_error_not_a_new_state(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    write_layout(root, _layout(0, 2))
    (tmp_path / LAYOUT_FILE).unlink()
    (tmp_path / "layout" / "g00000000.json").write_bytes(b"{\"layout_version\": 1")
    with pytest.raises(LayoutError, match="g00000000.json"):
        read_layout(root)


def test_the_arrow_schema_round_trips_through_the_layout(tmp_path: Path) -> None:
    """schema_to_json / schema_from_layout (also importable from sguard.spark.api) keep every
    field and type through a written and re-read layout; a layout without one says so."""
    import pyarrow as pa

    from sguard.spark import api
    assert api.schema_from_layout is schema_from_layout and api.schema_to_json is schema_to_json
    schema = pa.schema([("k", pa.int64()), ("v", pa.float64()), ("s", pa.string())])
    root = open_root(str(tmp_path))
    lay = OperatorLayout(operator="aggregate", name="agg", schema={}, num_partitions=2, key="k",
                         extra={"arrow_schema": schema_to_json(schema)})
    write_layout(root, lay)
    back = read_layout(root)
    assert back is not None and schema_from_layout(back) == schema
    with pytest.raises(LayoutError, match="'agg'.*arrow_schema"):
        schema_from_layout(replace(lay, extra={}))
