#!/usr/bin/env bash
# Runs the whole test suite in a fresh virtual environment (created on first use).
source "$(dirname "$0")/_venv.sh"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec python -m pytest -q "$@"
