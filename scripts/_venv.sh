# Sourced by the README's commands: creates .venv (once) and installs sguard with its test extras.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.sguard-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  # uv (PyPI) installs what pip would, several times faster, and scripts/test.sh's venv
  # links the same files from uv's cache instead of unpacking them again; the bytecode is
  # compiled at install, as pip does (a Python that may not write it, PYTHONDONTWRITEBYTECODE,
  # would otherwise compile every module it imports in every process)
  .venv/bin/python -m pip install -q --upgrade pip uv
  .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[test,bench]"
  touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
