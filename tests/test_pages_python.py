"""Every ```python block of the README and the guides (docs/*.md) runs without error on the
package under test, one test each (the pages and their blocks as tests/test_readme.py reads
them; that file runs their bash blocks). A file of its own, so that under pytest-xdist's
``--dist loadfile`` these blocks run on another worker than the bash blocks.

The blocks run one after another in one interpreter (`BlockRunner`), each in a namespace
of its own (so a block that uses a name it does not import or define fails, as it would
pasted alone), with the environment and working directory reset around it and any Spark
context it left open stopped. What they share is the interpreter's imported modules and
the JVM that PySpark starts once: a Spark block pays the JVM's start and warm-up once
per file instead of once per block."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.test_readme import blocks, page_text, python_items

_PYTHON_RAN: set[str] = set()

_DONE = "@@sguard-page-block-done@@ "
_CHILD = r'''
import contextlib, json, os, sys, traceback
DONE = sys.argv[1]
for line in sys.stdin:
    req = json.loads(line)
    env, cwd = dict(os.environ), os.getcwd()
    os.chdir(req["cwd"])
    ok, err = True, ""
    try:
        exec(compile(req["body"], req["name"], "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        ok, err = exc.code in (0, None), f"SystemExit({exc.code!r})"
    except BaseException:
        ok, err = False, traceback.format_exc()
    try:  # a Spark context the block left open would serve the next block's session
        from pyspark import SparkContext
        if SparkContext._active_spark_context is not None:
            SparkContext._active_spark_context.stop()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stdout.write("\n" + DONE + json.dumps({"ok": ok, "error": err[-3000:]}) + "\n")
    sys.stdout.flush()
'''


class BlockRunner:
    """One child interpreter that runs the blocks sent to it, one at a time."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._err = open(log, "ab")  # noqa: SIM115 - open as long as the child runs
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, _DONE],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, cwd=str(log.parent))
        self._buf = b""

    def run(self, name: str, body: str, cwd: Path, timeout: float) -> tuple[bool, str]:
        """(whether the block ran without error, its traceback and output's tail)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"name": name, "body": body, "cwd": str(cwd)})
                               + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            head, sep, rest = self._buf.partition(_DONE.encode())
            if sep and b"\n" in rest:
                line, _, self._buf = rest.partition(b"\n")
                res: dict[str, Any] = json.loads(line)
                return bool(res["ok"]), res["error"] + "\n" + head.decode(
                    errors="replace")[-2000:]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                return False, f"timed out after {timeout} s\n" + self._tail()
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the interpreter died
                self.proc.wait()
                return False, (f"the interpreter exited ({self.proc.returncode})\n"
                               + self._tail())
            self._buf += chunk
            if len(self._buf) > 1 << 20 and _DONE.encode() not in self._buf:
                self._buf = self._buf[-65536:]  # the output's tail is enough

    def _tail(self) -> str:
        self._err.flush()
        return self.log.read_bytes()[-3000:].decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BlockRunner]]:
    """A holder of the current `BlockRunner` (replaced when a block killed it)."""
    d = tmp_path_factory.mktemp("page-blocks")
    holder = [BlockRunner(d / "stderr-0.log")]
    yield holder
    holder[0].close()


@pytest.mark.parametrize(("page", "index"), [pytest.param(p, i, id=f"{p}:python{i}")
                                             for p, i in python_items()])
def test_page_python_block(page: str, index: int, tmp_path: Path,
                           runner: list[BlockRunner]) -> None:
    """Each ```python block of a page runs without error on the package under test
    (a block identical to one already run is not run again)."""
    body = blocks(page_text(page), "python")[index - 1]
    if body in _PYTHON_RAN:
        return
    if not runner[0].alive:
        runner[0].close()
        runner[0] = BlockRunner(runner[0].log.with_name(f"stderr-{page}-{index}.log"
                                                         .replace("/", "_")))
    ok, err = runner[0].run(f"<{page} python block {index}>", body, tmp_path, 300)
    assert ok, f"{page}: python block {index} failed:\n{body}\n{err}"
    _PYTHON_RAN.add(body)


def test_runner_isolates_blocks(tmp_path: Path) -> None:
    """A block sees no name, environment variable or working directory another block
    left, and an error, an exit status or the interpreter's death is reported."""
    r = BlockRunner(tmp_path / "stderr.log")
    try:
        ok, out = r.run("a", "import os\nx = 1\nos.environ['SGUARD_X'] = '1'\nos.chdir('/')\n"
                        "print('out')", tmp_path, 60)
        assert ok and out.split() == ["out"], out
        ok, err = r.run("b", "print(x)", tmp_path, 60)
        assert not ok and "NameError: name 'x' is not defined" in err
        ok, err = r.run("c", "import os\nassert 'SGUARD_X' not in os.environ\n"
                        f"assert os.getcwd() == {str(tmp_path)!r}", tmp_path, 60)
        assert ok, err
        assert r.run("d", "raise SystemExit(0)", tmp_path, 60)[0]
        ok, err = r.run("e", "import sys\nsys.exit(3)", tmp_path, 60)
        assert not ok and "SystemExit(3)" in err
        ok, err = r.run("f", "import os\nos._exit(5)", tmp_path, 60)
        assert not ok and "exited (5)" in err and not r.alive
    finally:
        r.close()
