"""Every command in the README and in the guides (docs/*.md) works as written, from a copy
of the checkout.

The pages are README.md, then docs/*.md in name order. Their ```bash blocks are run line by
line, in order, by ``bash`` in one scratch copy of the checkout (a "fresh clone", shared by
every page) whose ``.venv`` is the environment under test: under ``scripts/test.sh`` the
venv where the wheel is installed (not editable), so the pages' commands run the package a
user installs, with the kernels the suite's warm-up compiled (`fresh_clone`). Each
bash block is one test (``test_page_bash_block[docs/peace.md:bash1]``), so a failure names
its page; lines that depend on each other (``sguard demo`` then ``sguard checkpoints ls`` of
its output) sit in one block. The prose's inline commands (see `inline_commands`) of a page
run after its blocks, as one more test (``...:inline``). Its ```python blocks are run, one
test each, by the interpreter under test (tests/test_pages_python.py: a file of their own, so
that pytest-xdist's ``--dist loadfile`` runs them on another worker than the bash blocks). ```text blocks (commands that need your own S3 or
HDFS service, patterns with placeholders) are not run.

De-duplication, to keep the run as long as it was when only the README was run: each
distinct command line (as run, i.e. after its reduction below) runs once per test run, and
each distinct python block once; a page that repeats a command another page already ran
skips it. So a guide may repeat the README's commands for the reader at no cost. Under
pytest-xdist the bash blocks run in one worker (``--dist loadfile``; one group under
``--dist loadgroup``), so they share that one copy and its record of what ran.

Long commands run in a reduced form: the command exactly as written, with
arguments appended that make it small (argparse takes the last value of an
option), so the script, module and every option written on a page must
exist and parse. Commands without a size knob run as ``--help`` by default and
in full under ``-m slow``, as does every command unreduced. A command on a page
that is neither run nor listed in `REDUCED` fails the test: add an entry when a
new long command is documented.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ioservice.testing import SeaweedCluster
from tests.ioservice.conftest import seaweed  # noqa: F401 - the SeaweedFS cluster fixture

#: appended to a command (matched by its leading words) to run it small
REDUCED: dict[tuple[str, ...], list[str]] = {
    # the main job: scripts/demo.sh runs `sguard spark demo` (8 batches is its minimum)
    ("bash", "scripts/demo.sh"): ["--batches", "8", "--rows", "2000", "--keys", "500"],
    # the same job named inline in the prose: scripts/demo.sh above already runs it
    (".venv/bin/sguard", "spark", "demo"): ["--help"],
    (".venv/bin/sguard", "demo"): ["--batches", "6", "--batch", "2000", "--groups", "1500",
                                   "--checkpoint-every", "1", "--page-bytes", "4096"],
    (".venv/bin/sguard", "peace", "simulate"): ["--writers", "4", "--sizes-mb", "128",
                                                "--policies", "peace", "hdfs", "--no-progress"],
    (".venv/bin/python", "-m", "bench.mmm_ops"): ["--tuples", "20000", "--batch", "4096",
                                                  "--no-cold-start"],
    (".venv/bin/python", "-m", "bench.chkpt_latency"): [
        "--state-mb", "4", "--duration-s", "2", "--first-s", "0.5", "--interval-s", "1",
        "--partitions", "1", "--rounds", "1"],
    (".venv/bin/python", "-m", "bench.io_throughput"): [
        "--local-mb", "8", "--repeats", "1", "--workers", "1", "--no-seaweedfs"],
    (".venv/bin/python", "-m", "bench.recovery"): [
        "--sizes-mb", "4", "--repeats", "1", "--page-bytes", "65536"],
    # no size knob: --help by default (the module and its options exist), full under -m slow
    (".venv/bin/python", "-m", "bench.chkpt_prepare"): ["--help"],
    (".venv/bin/python", "-m", "bench.peace_fig10"): ["--help"],
    (".venv/bin/python", "-m", "bench.spark_stateful"): ["--help"],
    (".venv/bin/python", "-m", "bench.rescale"): ["--help"],
    (".venv/bin/python", "-m", "bench.peace_live"): ["--help"],
    (".venv/bin/python", "-m", "bench.spark_processors"): ["--help"],
    (".venv/bin/python", "-m", "bench.keydict"): ["--help"],
    (".venv/bin/python", "-m", "bench.spark_keys"): ["--help"],
    (".venv/bin/python", "-m", "bench.spark_ttl"): ["--help"],
    (".venv/bin/python", "-m", "bench.big_state"): ["--help"],
}
#: what a command's output must say beyond its exit status 0 (matched by its leading words)
EXPECT: dict[tuple[str, ...], Callable[[str], None]] = {}


def _demo_says(out: str) -> None:
    """The main job injected every failure, restarted its SIGKILLed driver, and both
    operators' sink rows and states equal a failure-free run."""
    assert "VERDICT: PASS" in out, out[-3000:]
    assert "driver SIGKILLed mid-batch 6" in out, out[-3000:]
    assert out.count(": equal; final state") == 2, out[-3000:]
    assert "restored in" in out and "rolled_back_file in" in out, out[-3000:]


EXPECT[("bash", "scripts/demo.sh")] = _demo_says
#: benches that write only <name>.json (no plot)
NO_PLOT = {"keydict", "spark_keys", "spark_ttl"}
#: the README's test command is the suite running this very test; CI runs it (checked below)
SELF = ("bash", "scripts/test.sh")
TIMEOUT_S = 900


def checkout() -> Path:
    """The checkout whose pages are tested: ``$SGUARD_REPO`` or the directory above tests/."""
    env = os.environ.get("SGUARD_REPO")
    root = Path(env) if env else Path(__file__).resolve().parents[1]
    assert (root / "README.md").is_file() and (root / "scripts").is_dir(), \
        f"no checkout at {root}: set SGUARD_REPO"
    return root


def pages(root: Path | None = None) -> list[str]:
    """The pages whose commands are run: README.md, then docs/*.md by name (paths from root)."""
    root = root or checkout()
    return ["README.md"] + sorted(p.relative_to(root).as_posix()
                                  for p in (root / "docs").glob("*.md"))


def page_text(page: str) -> str:
    return (checkout() / page).read_text(encoding="utf-8")


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced ```<lang> blocks of a markdown text."""
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)]


def block_commands(body: str) -> list[str]:
    """The command lines of one bash block (continuations joined, comments kept)."""
    out: list[str] = []
    pending = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.strip().startswith("#"):
            out.append(line.strip())
    return out


def commands(text: str) -> list[str]:
    """The command lines of all bash blocks of a page."""
    return [c for body in blocks(text, "bash") for c in block_commands(body)]


def inline_commands(text: str) -> list[str]:
    """Inline code spans of the prose that are complete commands (no placeholders).

    A span counts when it starts with ``bash scripts/`` or ``.venv/bin/`` and has
    arguments; spans with ``<``, ``[``, ``|``, ``...`` or upper-case placeholders
    are patterns, not commands.
    """
    prose = re.sub(r"^```.*?^```", "", re.sub(r"<!--.*?-->", "", text, flags=re.S),
                   flags=re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [s for s in spans if re.match(r"^(bash scripts/|\.venv/bin/)\S+ \S", s)
            and not re.search(r"[<\[|]|\.\.\.|\b[A-Z]{3,}\b", s)]


def reduction(command: str) -> tuple[tuple[str, ...] | None, list[str]]:
    """The `REDUCED` key matching ``command`` and what to append (None: run as written)."""
    words = tuple(shlex.split(command, comments=True))
    for key, extra in REDUCED.items():
        if words[:len(key)] == key:
            return key, extra
    return None, []


#: the packages: not copied into the scratch copy, so that its commands import them from the
#: environment under test (its ``.venv``, below), where the suite's kernel warm-up compiled
#: them (scripts/test.sh): a copy at a new path would compile every numba kernel again in
#: each process that first calls it, and would not be the package under test
PACKAGES = ("mmm", "ioservice", "peace", "sguard")


def fresh_clone(src: Path, dest: Path) -> Path:
    """Copy the checkout's files (no .git, .venv, build output, run data, and not the
    `PACKAGES`); its ``.venv`` is a link to the environment of the interpreter under test:
    the venv with the installed wheel under scripts/test.sh (which marks it set up, as
    scripts/_venv.sh marks the checkout's), the checkout's own .venv when pytest runs there."""
    skip = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.egg-info",
                                  "sguard-data", ".mypy_cache", ".hypothesis", "out")

    def ignore(where: str, names: list[str]) -> set[str]:
        top = set(PACKAGES) if Path(where) == src else set()
        return set(skip(where, names)) | (top & set(names))
    shutil.copytree(src, dest, ignore=ignore, symlinks=True)
    venv = Path(sys.prefix)
    stamp = venv / ".sguard-installed"
    assert (venv / "bin" / "python").exists() and stamp.exists(), \
        f"{venv} is not set up: run `bash scripts/demo.sh --help` (the README's first command)"
    assert stamp.stat().st_mtime >= (src / "pyproject.toml").stat().st_mtime, \
        f"{venv} is older than pyproject.toml: run `bash scripts/demo.sh --help` to refresh it"
    (dest / ".venv").symlink_to(venv, target_is_directory=True)
    return dest


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*"))}


class Clone:
    """The scratch copy every page's commands run in, and what already ran there."""

    def __init__(self, dest: Path) -> None:
        self.dir = fresh_clone(checkout(), dest)
        self.results = _digest(self.dir / "bench" / "results")
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV", "SGUARD_TEST_INSTALLED")}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if not p.startswith(sys.prefix))
        self.ran: list[str] = []

    def run(self, where: str, cmds: list[str], full: bool) -> list[str]:
        """Run each command not run before (reduced unless ``full``); returns those run."""
        done: list[str] = []
        for cmd in cmds:
            words = tuple(shlex.split(cmd, comments=True))
            if words[:len(SELF)] == SELF:
                continue
            key, extra = reduction(cmd)
            line = cmd if full or key is None else shlex.join([*words, *extra])
            if line in self.ran:  # another page ran this very command: once is enough
                continue
            out = subprocess.run(["bash", "-c", line], cwd=self.dir, env=self.env,
                                 capture_output=True, text=True, timeout=TIMEOUT_S)
            assert out.returncode == 0, (f"{where}: command failed (exit {out.returncode}): "
                                         f"{line}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            check = EXPECT.get(key) if key is not None else None
            if check is not None and "--help" not in line:
                check(out.stdout)
            self.ran.append(line)
            done.append(line)
            if (len(words) >= 3 and words[:2] == (".venv/bin/python", "-m")
                    and words[2].startswith("bench.") and "--help" not in line):
                name = words[2].split(".", 1)[1]
                assert (self.dir / "bench" / "out" / f"{name}.json").is_file(), line
                if name not in NO_PLOT:
                    assert (self.dir / "bench" / "out" / f"{name}.png").is_file(), line
        assert _digest(self.dir / "bench" / "results") == self.results, \
            f"{where}: a command changed the committed bench/results"
        return done


def bash_items() -> list[tuple[str, str]]:
    """(page, item) per bash block (``bash1``...) and per page with inline commands."""
    items: list[tuple[str, str]] = []
    for page in pages():
        text = page_text(page)
        items += [(page, f"bash{i + 1}") for i in range(len(blocks(text, "bash")))]
        if inline_commands(text):
            items.append((page, "inline"))
    return items


def item_commands(page: str, item: str) -> list[str]:
    text = page_text(page)
    if item == "inline":
        return inline_commands(text)
    return block_commands(blocks(text, "bash")[int(item.removeprefix("bash")) - 1])


def python_items() -> list[tuple[str, int]]:
    return [(page, i + 1) for page in pages()
            for i in range(len(blocks(page_text(page), "python")))]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Clone:
    return Clone(tmp_path_factory.mktemp("pages") / "clone")


@pytest.mark.xdist_group("pages")  # one worker, one scratch copy, each command once
@pytest.mark.parametrize(("page", "item"), [pytest.param(p, i, id=f"{p}:{i}")
                                            for p, i in bash_items()])
def test_page_bash_block(page: str, item: str, clone: Clone) -> None:
    """Each command of a page's bash block (or its prose) exits 0 in the fresh copy
    (reduced if long; skipped if another page already ran it)."""
    clone.run(f"{page}:{item}", item_commands(page, item), full=False)


def test_pages_cover_the_essentials() -> None:
    """The pages together document enough commands, and the ones this suite relies on."""
    every = [c for page in pages() for c in commands(page_text(page))]
    assert len(every) >= 10, every
    readme = commands(page_text("README.md"))
    assert any(c.startswith("bash scripts/demo.sh") for c in readme), readme
    assert any(c.startswith(".venv/bin/sguard checkpoints ls") for c in every), every
    assert any(c.startswith(".venv/bin/sguard demo") for c in every), every


@pytest.mark.slow
def test_every_page_command_runs_in_full(tmp_path: Path, request: pytest.FixtureRequest
                                         ) -> None:
    """The same, unreduced, every page in order (5-30 minutes: opt-in with ``-m slow`` or
    ``SGUARD_SLOW=1``)."""
    markexpr = str(request.config.getoption("markexpr") or "")
    if os.environ.get("SGUARD_SLOW") != "1" and not re.fullmatch(r"\s*slow\s*", markexpr):
        pytest.skip("opt-in: -m slow or SGUARD_SLOW=1")
    full = Clone(tmp_path / "clone")
    for page, item in bash_items():
        full.run(f"{page}:{item}", item_commands(page, item), full=True)


def test_readme_test_command_is_what_ci_runs() -> None:
    """The README's `bash scripts/test.sh` is CI's entry point (so this suite runs it)."""
    src = checkout()
    readme = commands((src / "README.md").read_text(encoding="utf-8"))
    assert any(tuple(shlex.split(c, comments=True)) == SELF for c in readme), readme
    ci = (src / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^\s*bash scripts/test\.sh\b", ci, re.M), ci


@pytest.mark.parametrize("page", pages())
def test_bare_sguard_is_not_assumed_on_path(page: str) -> None:
    """No command of a page, in a block or inline, calls a bare `sguard` / `python` / `pytest`.

    They live in .venv/bin, which the README's two commands do not put on PATH.
    """
    text = page_text(page)
    prose = re.sub(r"^```.*?^```", "", re.sub(r"<!--.*?-->", "", text, flags=re.S),
                   flags=re.S | re.M)
    for cmd in commands(text) + re.findall(r"`([^`\n]+)`", prose):
        assert not re.match(r"^(sguard|python3?|pytest) ", cmd), f"{page}: {cmd}"


def test_no_page_speaks_of_sessions() -> None:
    """The pages date what they report; a reference to when the docs were worked on means
    nothing to a reader.

    A SparkSession (``local_session``) or a process session of its own (``setsid``) is fine.
    """
    allowed = re.compile(r"(?i)(spark|local_|own_|new_)session|process sessions?\b|"
                         r"sessions? of (its|their) own")
    for page in pages():
        text = page_text(page)
        for m in re.finditer(r"(?i)session", text):
            context = text[max(0, m.start() - 20):m.end() + 20]
            assert allowed.search(context), f"{page}: ...{context}..."


def test_readme_s3_configuration_works_against_a_real_s3(tmp_path: Path,
                                                        seaweed: SeaweedCluster) -> None:
    """The S3 lines of the guide that documents storage roots (```text: they need a service)
    work with their placeholders filled in for a local SeaweedFS cluster (the suite's, shared
    with the other SeaweedFS tests of this process; a prefix of its own): the documented
    environment variables are the ones `sguard checkpoints` reads."""
    import numpy as np

    import mmm
    from ioservice import CheckpointManager, open_root
    from mmm.structures.hashmap import HashMap

    texts = [page_text(page) for page in pages()]
    text = next(t for t in texts if any("SGUARD_S3_ENDPOINT" in b for b in blocks(t, "text")))
    lines = [ln.strip() for body in blocks(text, "text") for ln in body.splitlines()]
    s3_lines = [ln for ln in lines if "SGUARD_S3_ENDPOINT" in ln or "s3://" in ln]
    assert len(s3_lines) == 2 and s3_lines[0].startswith("export "), s3_lines
    prefix = f"ckpt-{uuid.uuid4().hex[:12]}"
    seaweed.create_bucket("readme")
    host_port = seaweed.s3_endpoint.removeprefix("http://")
    root = open_root(f"s3://readme/{prefix}", s3_endpoint=seaweed.s3_endpoint,
                     s3_access_key=seaweed.access_key, s3_secret_key=seaweed.secret_key)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    counts = HashMap.create(pm, "counts", key="<u4", value=[("n", "<i8")])
    counts.upsert(np.arange(100, dtype="<u4"), combine={"n": "count"})
    with CheckpointManager(pm, root, "readme0") as mgr:
        pending = mgr.checkpoint()
        assert pending is not None
        pending.result()
    fill = {"<host>:<port>": host_port, "<key>": seaweed.access_key,
            "<secret>": seaweed.secret_key, "<bucket>": "readme", "<prefix>": prefix}
    script = "\n".join(s3_lines)
    for placeholder, value in fill.items():
        script = script.replace(placeholder, value)
    assert "<" not in script, script
    clone = fresh_clone(checkout(), tmp_path / "clone")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "SGUARD_S3")) and k != "PYTHONPATH"}
    out = subprocess.run(["bash", "-ec", script], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "readme0-1" in out.stdout, out.stdout  # the checkpoint written above
