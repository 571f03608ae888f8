"""Named points in the write path where a test can freeze the process (SIGSTOP).

Tests of fencing need a writer frozen at an exact place, as a long GC pause,
a network partition or a host that hangs would freeze it: before a page file
is opened, in the middle of a page, before a manifest, before an input-log
file. Code on those paths calls ``reached("<point>")``; when the environment
variable ``SGUARD_STOP_AT`` names that point (a comma-separated list is
allowed), the process announces itself by creating
``$SGUARD_STOP_DIR/stopped-<point>-<pid>`` and sends itself SIGSTOP, once per
point and process. Whoever resumes it (SIGCONT) decides when it goes on.

Unset (always, outside tests), a call costs one dictionary lookup.

Points used: ``page_file`` (`ioservice.IOService`, before a page file is
opened), ``mid_page`` (after the first half of the first page of a file),
``manifest`` (`ioservice.CheckpointManager`, right before the manifest is
written, after any ``before_commit`` check), ``inputlog`` (the Spark runtime,
before an input-log file is written).
"""
from __future__ import annotations

import os
import signal

__all__ = ["ENV_POINTS", "ENV_DIR", "reached", "armed"]

ENV_POINTS = "SGUARD_STOP_AT"
ENV_DIR = "SGUARD_STOP_DIR"
_fired: set[str] = set()


def armed(point: str) -> bool:
    """Whether `point` would stop this process now."""
    spec = os.environ.get(ENV_POINTS)
    return spec is not None and point in spec.split(",") and point not in _fired


def reached(point: str) -> None:
    """Stop this process here if the environment asks for it (see module docstring)."""
    if not armed(point):
        return
    _fired.add(point)
    d = os.environ.get(ENV_DIR)
    if d:
        with open(os.path.join(d, f"stopped-{point}-{os.getpid()}"), "w") as fh:
            fh.write(point)
    os.kill(os.getpid(), signal.SIGSTOP)
