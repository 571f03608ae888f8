"""The hash-map and key-dictionary kernels read and write through raw addresses
(``arr.ctypes.data``): every address must belong to an array that stays alive for the whole
kernel call.

The kernel once took the address of its own scratch (``sc = np.empty(...)``) before its row
loop. numba frees a local array right after its last use as an array, so that address
dangled for the whole loop; with the GIL released, another thread's allocation took the
memory and the two overwrote each other (the demo worker's SIGSEGV in CI). The scratch now
comes from the caller; these tests fail on the old kernel."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmm
from mmm._kernels import hashmap as K
from mmm._kernels import keydict as KD
from mmm.structures.hashmap import HashMap
from mmm.structures.keydict import KeyDict

# Upserts in the main thread while a second thread allocates and fills heap buffers of
# about the scratch's size. MALLOC_ARENA_MAX=1 puts both threads on one malloc arena, so a
# freed scratch is handed to the other thread at once (without it the crash needs the
# demo's I/O threads and luck). The old kernel dies with SIGSEGV or miscounts here.
_CHURN = textwrap.dedent("""
    import threading
    import numpy as np
    import mmm
    from mmm.structures.hashmap import HashMap

    stop = False

    def churn():
        while not stop:
            for size in (1500, 1700, 1800, 1900, 2000, 2100, 2400):
                np.full(size // 8, -1, np.int64)

    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 28)
    m = HashMap.create(pm, "m", key="<u4", value=[("n", "<i8"), ("hi", "<i8")])
    keys = np.random.default_rng(0).integers(0, 5000, (200, 1024)).astype("<u4")
    ts = np.arange(keys.size, dtype=np.int64).reshape(keys.shape)
    m.upsert(keys[0], {"ts": ts[0]}, {"n": "count", "hi": ("max", "ts")})  # compiled now
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    for r in range(1, len(keys)):
        m.upsert(keys[r], {"ts": ts[r]}, {"n": "count", "hi": ("max", "ts")})
        m.get(keys[r])
    stop = True
    thread.join()
    uk, inv, cnt = np.unique(keys, return_inverse=True, return_counts=True)
    hi = np.full(len(uk), -1, np.int64)
    np.maximum.at(hi, inv.ravel(), ts.ravel())
    gk, gv = m.items()
    o = np.argsort(gk)
    assert np.array_equal(gk[o], uk), "keys differ"
    assert np.array_equal(gv["n"][o], cnt), "counts differ"
    assert np.array_equal(gv["hi"][o], hi), "maxima differ"
    print("ok")
""")


def test_kernel_survives_allocations_in_another_thread() -> None:
    env = dict(os.environ, MALLOC_ARENA_MAX="1")
    out = subprocess.run([sys.executable, "-c", _CHURN], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
    assert out.stdout.split() == ["ok"]


def _bound(target: ast.expr) -> set[str]:
    """The names an assignment to ``target`` rebinds (``a``, ``a, b``; not ``a[i]``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(e) for e in target.elts))
    return set()


def _name(arg: ast.expr) -> str:
    """A variable's name; any other expression (``np.empty(...)``) as its source text, which
    is no parameter's name."""
    return arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)


def _params(fn: ast.FunctionDef) -> set[str]:
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}


def _addr_params(tree: ast.Module) -> dict[str, list[str]]:
    """For each function of the module, the positions of the parameters whose address it
    takes (``_addr(p)``), directly or through a helper it passes ``p`` to."""
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    takes: dict[str, set[str]] = {name: set() for name in fns}
    changed = True
    while changed:  # to a fixed point: helpers call helpers
        changed = False
        for name, fn in fns.items():
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                callee = call.func.id if isinstance(call.func, ast.Name) else None
                if callee == "_addr":
                    hit = {_name(call.args[0])}
                elif callee in fns:
                    pos = [i for i, a in enumerate(fns[callee].args.args)
                           if a.arg in takes[callee]]
                    hit = {_name(call.args[i]) for i in pos if i < len(call.args)}
                else:
                    continue
                if not hit <= takes[name]:
                    takes[name] |= hit
                    changed = True
    return {name: sorted(takes[name]) for name in fns}


@pytest.mark.parametrize("module", [K, KD], ids=["hashmap", "keydict"])
def test_every_raw_address_is_of_a_caller_held_array(module: object) -> None:
    """Static: in `mmm._kernels.hashmap` and `mmm._kernels.keydict`, ``_addr`` (the only
    place that reads ``.ctypes.data``: the hash map's, which the key dictionary imports) is
    applied only to a function's own parameters (never rebound), so in a compiled kernel
    only to arrays its caller holds for the call."""
    src = inspect.getsource(module)  # type: ignore[arg-type]
    tree = ast.parse(src)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "ctypes"]
    own = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_addr"]
    if module is K:
        assert all(own[0].lineno <= n.lineno <= own[0].end_lineno for n in uses)  # type: ignore[operator]
    else:
        assert not own and not uses and getattr(KD, "_addr") is K._addr
    takes = _addr_params(tree)
    bad = []
    for fn in (f for f in tree.body if isinstance(f, ast.FunctionDef)):
        params = _params(fn)
        rebound = {name for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign,
                                                                  ast.AnnAssign, ast.For))
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                   for name in _bound(t)}
        for name in takes[fn.name]:
            if name not in params or name in rebound:
                bad.append(f"{fn.name}: address of {name!r}, not a parameter it keeps")
    assert not bad, bad
    if module is K:
        assert "scratch" in takes["rows"] and "sc" not in takes["rows"]
    else:  # its per-chunk rows live in the caller's scratch, its inputs are read by address
        assert {"scratch", "pool", "offs", "valid", "out", "state"} <= set(takes["intern_rows"])


def test_intern_rows_rejects_a_short_scratch() -> None:
    """The key dictionary's kernel keeps its per-chunk rows in the caller's scratch: one
    shorter than `KD.SCRATCH` + 1 would be written past its end, so it is refused."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    kd = KeyDict.create(pm, "kd")
    data = np.frombuffer(b"abcabcd", np.uint8)
    offs = np.array([0, 3, 7], np.int64)
    out = np.full(2, -7, np.int64)
    state = np.zeros(2, np.int64)
    args = (KD.MODE_LOOKUP, 0, data.ctypes.data, len(data), offs, np.zeros(0, np.bool_), False,
            kd._flat, kd._ps.frames, kd._ps.mod, pm.pool.pins, kd._rseqs, kd._cseqs,
            kd._iseqs, kd._geo(), out)
    with pytest.raises(ValueError, match="scratch"):
        KD.intern_rows(*args, np.empty(KD.SCRATCH, np.int64), state)
    assert out.tolist() == [-7, -7]
    assert KD.intern_rows(*args, np.empty(KD.SCRATCH + 1, np.int64), state) == KD.DONE
    assert out.tolist() == [-1, -1] and state[0] == 2


def test_rows_rejects_a_short_scratch() -> None:
    """A scratch shorter than `K.SCRATCH` would be written past its end: refused."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    m = HashMap.create(pm, "m", key="<u4", value="<i8")
    m.put(np.arange(10, dtype="<u4"), np.arange(10))
    kw, kb = m._words(m._canon(np.arange(5, dtype="<u4"), "keys"))
    ls = m._no_ops
    args = (K.MODE_GET, 0, kw, kb, m._flat, m._ps.frames, m._next_of, m._bucket_seq,
            m._last_seq, pm.pool.pins, pm.pool.undo, pm.pool.undo_data, m._ps.mod, m._geo(), ls.ops, ls.codes, ls.offs,
            ls.sizes, ls.lanes, ls.lidx, ls.aligned, np.empty((0, 5), np.int64),
            np.empty((0, 5), np.uint64), np.empty((0, 5), np.float64),
            np.empty((5, 0), np.uint8), np.zeros((5, 8), np.uint8), np.zeros(5, np.bool_))
    with pytest.raises(ValueError, match="scratch"):
        K.rows(*args, np.empty(K.SCRATCH - 1, np.int64), np.zeros(3, np.int64))
    found = np.zeros(5, np.bool_)
    args = args[:-1] + (found,)
    assert K.rows(*args, np.empty(K.SCRATCH, np.int64), np.zeros(3, np.int64)) == K.DONE
    assert found.all()
