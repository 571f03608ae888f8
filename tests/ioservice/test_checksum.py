"""`ioservice.format.page_checksums` (one compiled call) against python-xxhash, digest for digest."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from ioservice.format import page_checksums
from mmm.page import MAX_PAGE_BYTES, MIN_PAGE_BYTES


def _reference(pages: np.ndarray) -> np.ndarray:
    return np.array([xxhash.xxh3_64_intdigest(bytes(p)) for p in pages], dtype=np.uint64)


# every page size a checkpoint can hold, plus every xxh3 length class (0, 1-3, 4-8,
# 9-16, 17-128, 129-240, long) and odd, unaligned tails
@pytest.mark.parametrize("width", [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 4097,
                                   MIN_PAGE_BYTES, 8192, 65536, MAX_PAGE_BYTES])
def test_matches_xxhash(width: int) -> None:
    rng = np.random.default_rng(width)
    n = 3 if width >= MAX_PAGE_BYTES else 17
    pages = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
    got = page_checksums(pages)
    assert got.dtype == np.uint64 and got.shape == (n,)
    assert np.array_equal(got, _reference(pages))


def test_zero_rows_and_views() -> None:
    assert page_checksums(np.zeros((0, 8192), np.uint8)).shape == (0,)
    rng = np.random.default_rng(1)
    big = rng.integers(0, 256, size=(9, 8192 + 24), dtype=np.uint8)
    view = big[1::2, 8:8 + 8192]  # strided, offset: not C-contiguous
    assert np.array_equal(page_checksums(view), _reference(view))


def test_one_flipped_byte_changes_only_its_page() -> None:
    rng = np.random.default_rng(2)
    pages = rng.integers(0, 256, size=(64, 8192), dtype=np.uint8)
    before = page_checksums(pages)
    pages[37, 5000] ^= 1
    after = page_checksums(pages)
    assert np.flatnonzero(before != after).tolist() == [37]


def test_threads_agree() -> None:
    rng = np.random.default_rng(3)
    pages = rng.integers(0, 256, size=(256, 8192), dtype=np.uint8)
    want = _reference(pages)
    got: list[np.ndarray] = []

    def run() -> None:
        got.append(page_checksums(pages))

    th = [threading.Thread(target=run) for _ in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert len(got) == 4 and all(np.array_equal(g, want) for g in got)


def test_rejects_wrong_shape_or_dtype() -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        page_checksums(np.zeros(8192, np.uint8))
    with pytest.raises(ValueError, match="2-D uint8"):
        page_checksums(np.zeros((2, 8), np.int32))  # type: ignore[arg-type]


@pytest.mark.parametrize("width", [MIN_PAGE_BYTES, 8192, 65536])
def test_verify_rows_finds_every_kind_of_damage(width: int) -> None:
    """`verify_rows` (the read path's fused check) counts the rows failing their checksum,
    names the first one, and finds the first row whose id (at any byte offset) differs."""
    from ioservice._checksum import verify_rows
    rng = np.random.default_rng(width)
    pages = rng.integers(0, 256, size=(9, width), dtype=np.uint8)
    at = 13  # unaligned on purpose
    ids = pages[:, at:at + 8].copy().view("<u8")[:, 0].copy()
    sums = _reference(pages)
    assert verify_rows(pages, sums, ids, at) == (0, -1, -1)
    bad = sums.copy()
    bad[[2, 7]] ^= np.uint64(1)
    assert verify_rows(pages, bad, ids, at) == (2, 2, -1)
    wrong = ids.copy()
    wrong[5] += np.uint64(1 << 56)  # differs only in the id's last byte
    assert verify_rows(pages, sums, wrong, at) == (0, -1, 5)
    assert verify_rows(pages[:0], sums[:0], ids[:0], at) == (0, -1, -1)
    with pytest.raises(ValueError):
        verify_rows(pages, sums[:3], ids, at)
    with pytest.raises(ValueError):
        verify_rows(pages, sums, ids, width - 7)


@pytest.mark.parametrize("width", [MIN_PAGE_BYTES, 8192])
def test_pread_verify_rows_reads_and_finds_damage_like_verify_rows(tmp_path, width: int) -> None:
    """`pread_verify_rows` (the local read: ``pread`` and verification in one compiled
    call) reads exactly the pages at the offset, reports what `verify_rows` reports,
    stops at damage, and reports the end of the file and a failing descriptor."""
    import os
    from ioservice._checksum import pread_verify_rows, verify_rows
    rng = np.random.default_rng(width)
    pages = rng.integers(0, 256, size=(11, width), dtype=np.uint8)
    at = 8
    ids = pages[:, at:at + 8].copy().view("<u8")[:, 0].copy()
    sums = _reference(pages)
    path = tmp_path / "f.pages"
    path.write_bytes(pages.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for piece in (1, 3, 20):
            out = np.zeros((7, width), np.uint8)
            got = pread_verify_rows(fd, out, 2 * width, sums[2:9], ids[2:9], at, piece)
            assert got == (7 * width, 1, 0, -1, -1)
            assert np.array_equal(out, pages[2:9])
            bad = sums[2:9].copy()
            bad[4] ^= np.uint64(1)
            assert pread_verify_rows(fd, out, 2 * width, bad, ids[2:9], at, piece)[2:] == \
                verify_rows(pages[2:9], bad, ids[2:9], at)
            wrong = ids[2:9].copy()
            wrong[3] += np.uint64(1)
            assert pread_verify_rows(fd, out, 2 * width, sums[2:9], wrong, at, piece)[2:] == \
                (0, -1, 3)
            # not verified: read all the same
            assert pread_verify_rows(fd, out, 2 * width, bad, wrong, at, piece, False) == \
                (7 * width, 1, 0, -1, -1)
            # past the end: status 0 and the bytes that exist
            pad = np.zeros(2, np.uint64)
            assert pread_verify_rows(fd, out, 6 * width, np.r_[sums[6:], pad],
                                     np.r_[ids[6:], pad], at, piece)[:2] == (5 * width, 0)
    finally:
        os.close(fd)
    out = np.zeros((2, width), np.uint8)
    assert pread_verify_rows(fd, out, 0, sums[:2], ids[:2], at, 1)[:2] == (0, -1)  # closed fd
    with pytest.raises(ValueError, match="writable"):
        pread_verify_rows(fd, np.zeros((2, width), np.uint8)[:, ::2], 0, sums[:2], ids[:2], at, 1)
    with pytest.raises(ValueError):
        pread_verify_rows(fd, out, 0, sums[:3], ids[:2], at, 1)


def test_b64decode_strict_agrees_with_the_standard_library() -> None:
    """The manifest's compiled base64 decoder returns what
    ``base64.b64decode(validate=True)`` returns for every length of valid text, and
    refuses what a strict reading refuses: other characters, padding inside the text or
    more than two, a length not a multiple of 4, non-ASCII."""
    import base64
    from ioservice._checksum import b64decode_strict
    rng = np.random.default_rng(3)
    for n in list(range(0, 40)) + [3 * 70000 + 1]:
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        text = base64.b64encode(raw).decode()
        assert b64decode_strict(text) == base64.b64decode(text, validate=True) == raw
    for bad in ("QUJD!", "QU JD", "QUJ\n", "QQ=A", "Q===", "====", "QUJDQQ", "QUJDQ", "QUJ=QUJD",
                "QUJ\u00e9"):
        with pytest.raises(ValueError):
            b64decode_strict(bad)
