"""The trainer's resume point: one folder per policy version, the ledger as the pointer.

Layout (``HOME/trainer/states``)::

    v0000000012/        the complete training state of version 12 (model, optimizer, RNG:
                        ``GRPOTrainer.write_checkpoint_files``), fsynced before it got this name
    .v0000000013.tmp/   a state being written; a crash leaves it, nothing loads it, start deletes it

A step commits in this order (node/roles/trainer.py; each line ends at a named
``crash_point`` that the crash tests kill the trainer at):

1. write version v+1 under its temporary name, fsync files then folders  (``state.partial``, ``state.written``)
2. rename it to ``v+1``, fsync the parent                               (``state.renamed``)
3. ``Ledger.commit_step``: the step's batches become trained and v+1 the
   resume point, in one SQLite transaction. This is the commit point.    (``ledger.committed``)
4. delete the folders of older versions                                 (``state.pruned``)
5. publish v+1 to the run (export, chunk store, gossip)                 (``published``)

So the previous version's folder is kept until the new one is committed, and a
version is announced only after it is committed: a version number the run has
seen is never trained again with different weights.

At start (:meth:`TrainerStates.reconcile`) the ledger decides. A folder newer
than the ledger's commit is an uncommitted step (it died between 2 and 3): it is
deleted, not adopted, because the ledger holds its batches as untrained (they
are trained again, once, into the resumed line) and nobody ever received its
weights (step 5 never ran). Adopting it would train those batches twice. A
ledger commit whose folder is missing, or folders (or trained batches) without
any commit, have no consistent resume point: the trainer refuses with
:class:`CheckpointError` instead of silently starting again at version 0.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from node.errors import CheckpointError
from node.util import crash_point, fsync_dir

log = logging.getLogger(__name__)

_FOLDER = re.compile(r"v(\d{10})")


class TrainerStates:
    """The versioned training-state folders under ``root``. Blocking methods (disk, torch):
    call them through ``trio.to_thread``."""

    def __init__(self, root: Path | str, legacy: Path | str | None = None) -> None:
        self.root = Path(root)
        # the single folder older homes kept (HOME/trainer/checkpoint); adopted once at start
        self.legacy = Path(legacy) if legacy is not None else None

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:010d}"

    def versions(self) -> list[int]:
        """Versions with a complete folder (a folder only gets its name once complete)."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _FOLDER.fullmatch(p.name)))

    def write(self, trainer: Any) -> Path:
        """Steps 1-2: the trainer's state as the folder of its version, durably. Refuses to
        replace an existing folder (a version is written once per line of training)."""
        final = self.folder(trainer.version)
        if final.exists():
            raise CheckpointError(f"training state {final} exists already; refusing to overwrite version")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{final.name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        trainer.write_checkpoint_files(tmp)
        os.replace(tmp, final)
        fsync_dir(self.root)
        crash_point("state.renamed", trainer.version)
        return final

    def prune(self, keep: int) -> list[int]:
        """Step 4: delete every version folder but ``keep`` (the committed one)."""
        gone = [v for v in self.versions() if v != keep]
        for v in gone:
            shutil.rmtree(self.folder(v))
        if gone:
            fsync_dir(self.root)
        return gone

    def reconcile(self, committed: int | None, trained_batches: int) -> int | None:
        """Which version to resume (None: a new run, start from the initial model), after
        cleaning what a crash left. ``committed`` is the ledger's commit, ``trained_batches``
        how many batches it holds as trained. Raises CheckpointError if nothing consistent
        exists (see the module docstring)."""
        self._clean_tmp()
        self._adopt_legacy(committed)
        on_disk = self.versions()
        if committed is None:
            if trained_batches or any(v > 0 for v in on_disk):
                raise CheckpointError(
                    f"the ledger has no committed training state but {self.root} holds versions {on_disk} "
                    f"and the ledger {trained_batches} trained batches: the ledger (node.db) was replaced or "
                    "lost; refusing to guess where this run stands (restore node.db, or start a new run in a "
                    "new home)"
                )
            self.prune(keep=-1)  # an initial state whose commit never landed: written again
            return None
        if committed not in on_disk:
            if committed == 0 and not trained_batches:
                log.warning("the ledger's version 0 has no state folder: starting again from the initial model")
                self.prune(keep=-1)
                return None
            raise CheckpointError(
                f"the ledger committed version {committed} but {self.root} holds no folder for it "
                f"(versions there: {on_disk}); refusing to start at another version (restore "
                f"{self.folder(committed)}, or start a new run in a new home)"
            )
        newer = [v for v in on_disk if v > committed]
        if newer:
            log.warning(
                "dropping uncommitted training state %s: the trainer died before the ledger committed it; "
                "its batches are still untrained in the ledger and were never published",
                newer,
            )
        self.prune(keep=committed)
        return committed

    def _clean_tmp(self) -> None:
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def _adopt_legacy(self, committed: int | None) -> None:
        """A home from before versioned folders: its one folder becomes the folder of the
        version it holds (one rename), if that is the ledger's commit."""
        old = self.legacy
        if old is None or not (old / "trainer_state.pt").exists():
            return
        import torch

        version = int(torch.load(old / "trainer_state.pt", map_location="cpu", weights_only=False)["version"])
        if committed is not None and version != committed:
            raise CheckpointError(
                f"{old} holds version {version} but the ledger committed {committed}: an old home whose "
                "state cannot be matched to its ledger"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        os.replace(old, self.folder(version))
        fsync_dir(self.root)
        fsync_dir(old.parent)
        log.info("moved the training state of %s to %s", old, self.folder(version))
