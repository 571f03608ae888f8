#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): tests the package as a user installs it.
#
#   bash scripts/test.sh [pytest args]        e.g.  bash scripts/test.sh -x -q -k demo
#
# 1. creates a small tools venv with uv ($SGUARD_TEST_WORK/tools, once);
# 2. builds the wheel (uv build) from a copy of this checkout (nothing is written into the
#    checkout);
# 3. installs the wheel, not editable, with its test extras into a separate venv
#    ($SGUARD_TEST_WORK/venv, default build/test-wheel/venv: created fresh on first use and
#    whenever pyproject.toml changes; the sguard wheel is reinstalled on every run);
# 4. smoke-tests the installed `sguard` command (--version, --help of every command), and
#    compiles the numba kernels once (`sguard kernels warm`) for it, and records the JVM
#    class-data archive the suite's Spark JVMs start from (tests/jvm_archive.py);
# 5. runs pytest on a copy of tests/ outside the checkout, so `import mmm` can only find the
#    installed package (tests/sguard/test_install.py asserts it is under site-packages).
#
# SGUARD_TEST_WORKERS=N runs pytest in N parallel pytest-xdist workers (default: the machine's
# cores, at most 4; 0 runs every test in one process, in collection order).
# SGUARD_TEST_SOURCE=1 skips 1-5 and runs pytest on the source tree in .venv (the README's
# editable environment, created on first use as scripts/demo.sh does: a quicker loop while
# editing; CI never uses it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# The suite runs in SGUARD_TEST_WORKERS pytest-xdist workers (default: one per core, at most 4;
# each Spark test itself keeps 2 cores busy, so more workers than cores only adds load).
# --dist loadfile sends each test file to one worker, so that its module fixtures start once;
# session fixtures (the SparkSession, the SeaweedFS cluster) start once per worker. Files are
# handed out in collection order (--no-loadscope-reorder), which tests/conftest.py starts with
# the longest files (LONGEST_FIRST), so that no long file starts last. A -n given in the
# arguments wins; SGUARD_TEST_WORKERS=0 runs in this process.
CORES="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
WORKERS="${SGUARD_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}"
case "$WORKERS" in ''|*[!0-9]*) echo "SGUARD_TEST_WORKERS must be a number, not '$WORKERS'" >&2; exit 2;; esac
if [ "$WORKERS" = 1 ]; then WORKERS=0; fi   # one worker is one process: no xdist needed
PAR=()
if [ "$WORKERS" != 0 ]; then
  PAR=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
if [ "${SGUARD_TEST_SOURCE:-0}" = 1 ]; then
  source "$ROOT/scripts/_venv.sh"   # the README's environment (.venv, editable), made once
  exec python -m pytest -q ${PAR[@]+"${PAR[@]}"} "$@"
fi

WORK="${SGUARD_TEST_WORK:-$ROOT/build/test-wheel}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

# A copy of the checkout's files (tracked and untracked, minus what git ignores).
copy_checkout() {  # copy_checkout DEST
  rm -rf "$1" && mkdir -p "$1"
  if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
      | (cd "$ROOT" && xargs -0 -r cp -p --parents -t "$1" 2>/dev/null || true)
  else
    (cd "$ROOT" && tar --exclude=./.venv --exclude=./build --exclude=./.git -cf - .) \
      | tar -xf - -C "$1"
  fi
}

# uv (PyPI) builds the wheel and installs it several times faster than pip; it lives in a
# venv of its own, so that the test run needs neither .venv nor anything else of this checkout
TOOLS="$WORK/tools"
UV="$TOOLS/bin/uv"
if [ ! -x "$UV" ]; then
  rm -rf "$TOOLS"
  "${PYTHON:-python3}" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q uv
fi

step "building the wheel"
copy_checkout "$WORK/src"
rm -rf "$WORK/dist"
"$UV" build -q --wheel --out-dir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/sguard-*.whl)"
echo "$WHEEL"

step "installing it (not editable) with the test extras into a fresh venv"
VENV="$WORK/venv"
if [ ! -x "$VENV/bin/python" ] || [ pyproject.toml -nt "$VENV/.sguard-deps" ]; then
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$UV" pip install -q --compile-bytecode --python "$VENV/bin/python" "${WHEEL}[test]"
  touch "$VENV/.sguard-deps"
fi
"$UV" pip install -q --compile-bytecode --python "$VENV/bin/python" --reinstall --no-deps "$WHEEL"
# set up as scripts/_venv.sh marks .venv: tests/test_readme.py runs the pages' commands with
# this venv as the scratch copy's .venv
touch "$VENV/.sguard-installed"

step "CLI smoke tests of the installed command"
RUN="$WORK/run"
rm -rf "$RUN" && mkdir -p "$RUN"
cd "$RUN"
VERSION="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sguard"))')"
test "$("$VENV/bin/sguard" --version)" = "sguard $VERSION"
"$VENV/bin/python" - <<'EOF'
import importlib, sysconfig
from pathlib import Path
site = Path(sysconfig.get_paths()["purelib"]).resolve()
for name in ("mmm", "mmm.structures", "ioservice", "peace", "sguard"):
    f = Path(importlib.import_module(name).__file__).resolve()
    assert site in f.parents, f"{name} imported from {f}, not from {site}"
print(f"mmm, ioservice, peace, sguard import from {site}")
EOF
"$VENV/bin/sguard" --help >/dev/null
# every command's --help in one process (the entry point's own function, as `sguard` calls it)
"$VENV/bin/python" - <<'EOF'
import contextlib, io
from sguard.cli import main
for cmd in ("demo", "kernels", "kernels warm", "checkpoints", "checkpoints ls",
            "checkpoints verify", "checkpoints show", "peace", "peace simulate",
            "peace schedule", "peace serve"):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main([*cmd.split(), "--help"])
    except SystemExit as exc:
        rc = exc.code
    assert rc in (0, None) and "usage:" in out.getvalue(), f"sguard {cmd} --help failed ({rc})"
EOF
"$VENV/bin/sguard" demo --batches -5 2>/dev/null && { echo "a bad argument was accepted"; exit 1; }
echo "sguard $VERSION: --version, --help of every command: ok"

# Each process that first calls a numba kernel compiles it unless numba's disk cache holds it;
# on a fresh install that is ~100 s of one core, paid again in every process that starts before
# the first has written it (parallel tests, Spark's Python workers, the pages' commands).
# Compile once, for the installed package.
cp -rp "$ROOT/tests" "$ROOT/notebooks" "$ROOT/pytest.ini" "$RUN/"
# Beside it, the suite's Spark JVMs get a class-data-sharing archive of Spark's classes
# (tests/jvm_archive.py: recorded once per machine and Spark version, ~25 s; it saves ~5 s
# of each of the suite's JVM starts). Without one, they start as usual.
(cd "$RUN" && "$VENV/bin/python" -m tests.jvm_archive >"$WORK/jvm-archive.log" 2>&1) &
ARCHIVE_PID=$!
step "compiling the kernels once (sguard kernels warm)"
# (a variant that no longer compiles, after a kernel's arguments changed, is only reported:
# its kernel compiles at first use as without the warm-up; scripts/kernel_variants.py renews
# the list)
"$VENV/bin/sguard" kernels warm || true
wait "$ARCHIVE_PID" || true
echo "JVM class-data archive: $(cat "$WORK/jvm-archive.log" 2>/dev/null || true)"

step "the test suite against the installed package"
export SGUARD_REPO="$ROOT" SGUARD_TEST_INSTALLED=1
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$RUN" ${PAR[@]+"${PAR[@]}"} "$@"
rc=$?
set -e
step "done, pytest exit status $rc"
exit $rc
