"""Ownership epochs: a partition's durable state is written by its current owner only.

A partition can have two writers at once on a real cluster: a host that
froze (a long GC pause, a network partition, a SIGSTOP) while Spark gave the
partition to another one, or a speculative task attempt. The state URI is the
one authority every attempt can reach, so ownership is decided there, in one
atomic step per claim, without asking the driver:

    <state-uri>/fence/<haunit>/e000000000007-b000000000042-<token>.json    one claim

A host that takes a partition (its local slot does not hold the current
epoch) *claims* epoch ``e = highest claim + 1`` by writing a claim file named
by the epoch and a random token, then lists the claims again: if any other
claim has an epoch ``>= e`` (a concurrent claimer), it claims again above
them. The name also carries the batch the claim was made at, so one listing
tells everything; the file is created exclusively (``O_EXCL`` on ``file://``),
with no temporary file beside it (a listing must never race with one). On S3
(no conditional PUT through pyarrow)
the token in the name keeps two claims of one epoch apart, and the re-listing
makes sure at most one of them goes on. The **owner** is the claim with the
highest epoch; every other claimant is **fenced**.

What the epoch guards (`sguard.spark.runtime`):

* names: checkpoint sequence numbers of epoch ``e`` lie in
  ``[e * 10**9, (e + 1) * 10**9)`` (`seq_range`), page files carry a unique
  tag, manifests are created, never replaced, and input-log files carry the
  epoch, so no writer ever replaces what another wrote;
* commits: a writer checks that it still owns the partition before a
  checkpoint's manifest and after its input-log file, and a stale one fails
  its task with `FencedError`. It deletes nothing (retention, log trimming and
  claim collection ask `is_owner` first);
* reads: a check followed by a write can still be overtaken (a writer frozen
  between the two), so readers decide what counts. An input-log file of epoch
  ``e`` for batch ``x`` counts only if no claim ``e' > e`` was made at a
  batch ``<= x`` (`FenceView.log_valid`): from its claim on, the new owner
  logs every batch itself, and an older epoch's file of such a batch is a
  stale writer's. Of the valid files of a batch the highest epoch wins. A
  checkpoint needs no such rule: it holds the state after ``b - 1`` taken at
  the start of batch ``b`` by a writer that owned the partition then, and
  Spark committed ``b - 1`` before ``b`` started, so even one committed late by
  a stale writer holds correct state (its sequence number is below every
  newer owner's, so recovery prefers the newer owner's).

Claims are collected by the owner once both its kept checkpoints lie in its own
era (`collect`): from then on only its own claim is needed to judge older files.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from ioservice import StorageExistsError, StorageRoot

from sguard.spark.errors import FencedError

logger = logging.getLogger(__name__)

__all__ = ["FENCE_DIR", "SEQ_PER_EPOCH", "Claim", "FenceView", "claim", "read_claims",
           "seq_range", "epoch_of_seq", "check_owner", "is_owner", "collect"]

FENCE_DIR = "fence"
SEQ_PER_EPOCH = 10 ** 9
_CLAIM_RE = re.compile(r"^e(?P<epoch>\d{12})-b(?P<batch>\d{12})-(?P<token>[0-9a-f]{6,32})\.json$")
_MAX_EPOCH = 10 ** 9 - 1  # seq_range must stay within 18 digits


@dataclass(frozen=True, order=True)
class Claim:
    """One claim: ``epoch`` taken by ``token`` at the start of batch ``batch``."""

    epoch: int
    token: str
    batch: int


def _dir(haunit: str) -> str:
    return f"{FENCE_DIR}/{haunit}"


def _path(haunit: str, c: Claim) -> str:
    return f"{_dir(haunit)}/e{c.epoch:012d}-b{max(c.batch, 0):012d}-{c.token}.json"


def seq_range(epoch: int) -> tuple[int, int]:
    """Checkpoint sequence numbers of epoch `epoch`: ``[epoch * 10**9, (epoch + 1) * 10**9)``."""
    return epoch * SEQ_PER_EPOCH, (epoch + 1) * SEQ_PER_EPOCH


def epoch_of_seq(seq: int) -> int:
    """The epoch a checkpoint sequence number belongs to (0: written without fencing)."""
    return seq // SEQ_PER_EPOCH


def read_claims(root: StorageRoot, haunit: str) -> "FenceView":
    """Every claim of `haunit` (one listing)."""
    claims = []
    for e in root.list_dir(_dir(haunit), allow_not_found=True):
        m = _CLAIM_RE.match(e.name)
        if not e.is_dir and m is not None:
            claims.append(Claim(int(m["epoch"]), m["token"], int(m["batch"])))
    return FenceView(haunit, tuple(sorted(claims)))


@dataclass(frozen=True)
class FenceView:
    """The claims of one HA unit as listed at one moment."""

    haunit: str
    claims: tuple[Claim, ...]

    @property
    def top(self) -> int:
        """The highest epoch claimed (0: none)."""
        return self.claims[-1].epoch if self.claims else 0

    def owner(self) -> Claim | None:
        """The current owner: the single claim of the highest epoch (None if none, or if
        two claims tie there: both claimants are then fenced and claim again)."""
        if not self.claims:
            return None
        top = [c for c in self.claims if c.epoch == self.top]
        return top[0] if len(top) == 1 else None

    def owns(self, epoch: int, token: str) -> bool:
        o = self.owner()
        return o is not None and (o.epoch, o.token) == (epoch, token)

    def fenced_from(self, epoch: int) -> int | None:
        """The first batch from which writes of `epoch` no longer count: the lowest batch
        any higher epoch was claimed at (None: not fenced)."""
        higher = [c.batch for c in self.claims if c.epoch > epoch]
        return min(higher) if higher else None

    def log_valid(self, epoch: int, batch: int) -> bool:
        """Whether an input-log file of `epoch` for `batch` counts (module docstring)."""
        f = self.fenced_from(epoch)
        return f is None or batch < f


def claim(root: StorageRoot, haunit: str, batch: int, *, max_tries: int = 64) -> Claim:
    """Claim the next epoch of `haunit` for a task about to run `batch`.

    Raises
    ------
    FencedError
        If `max_tries` claims in a row were overtaken by concurrent claimers.
    """
    token = uuid.uuid4().hex[:16]
    view = read_claims(root, haunit)
    epoch = view.top + 1
    body = json.dumps({"batch": batch, "token": token}).encode()
    for _ in range(max_tries):
        if epoch > _MAX_EPOCH:
            raise FencedError(f"{haunit}: epochs used up ({epoch})")
        try:
            # create-only, and no temp file beside it: the name is the claim, and a
            # listing must never race with a temp file vanishing in this directory
            with root.open_output_stream(_path(haunit, Claim(epoch, token, batch)),
                                         exclusive=True) as out:
                out.write(body)
        except StorageExistsError:  # cannot happen with a fresh token; claim higher anyway
            epoch += 1
            continue
        view = read_claims(root, haunit)
        if view.owns(epoch, token):
            logger.info("%s: epoch %d claimed for batch %d", haunit, epoch, batch)
            return Claim(epoch, token, batch)
        epoch = view.top + 1  # overtaken or tied: ours never counts, go above
    raise FencedError(f"{haunit}: could not claim an epoch in {max_tries} tries "
                      f"(concurrent claimers)")


def is_owner(root: StorageRoot, haunit: str, me: Claim) -> bool:
    """Whether `me` is still the owner (one listing)."""
    return read_claims(root, haunit).owns(me.epoch, me.token)


def check_owner(root: StorageRoot, haunit: str, me: Claim, what: str) -> None:
    """Raise `FencedError` unless `me` still owns `haunit`.

    Raises
    ------
    FencedError
        Naming the HA unit, our epoch, the owner's, and what was refused.
    """
    view = read_claims(root, haunit)
    if view.owns(me.epoch, me.token):
        return
    o = view.owner()
    raise FencedError(
        f"{haunit}: this task holds epoch {me.epoch}, but "
        f"{'epoch %d (claimed at batch %d)' % (o.epoch, o.batch) if o else 'a newer claim'} "
        f"owns the partition now: {what} refused (another task attempt or host took the "
        f"partition over; this attempt's result must not count)")


def collect(root: StorageRoot, haunit: str, me: Claim) -> int:
    """Delete the claims below `me` (the owner's, once its kept checkpoints and the log
    they need lie in its own era); returns how many. Never deletes `me` or anything above."""
    n = 0
    for c in read_claims(root, haunit).claims:
        if c.epoch < me.epoch:
            root.delete_file(_path(haunit, c), missing_ok=True)
            n += 1
    return n
