#!/usr/bin/env bash
# Runs the main job on the embedded default: a local Spark streaming pipeline with stateful
# operators (state in mmm pages, checkpoints on local files), failures injected mid-run,
# output checked against a failure-free run. Exit code 0 = PASS.
source "$(dirname "$0")/_venv.sh"
exec python -m sguard spark demo "$@"
