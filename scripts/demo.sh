#!/usr/bin/env bash
# Runs the main job (the demo operator) on the embedded default (local filesystem).
source "$(dirname "$0")/_venv.sh"
exec python -m sguard demo "$@"
