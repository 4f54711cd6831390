"""The run's periodic, atomic checkpoints to resume from.

One checkpoint directory ``<run_dir>/checkpoints/step-<N>/`` holds:

* the trainer's files, written by the trainer's own snapshot (:meth:`Trainer.snapshot`; a
  :class:`~orchestrator.trainer.snapshot.TrainerSnapshot`: ``model/`` and ``trainer.pt``, or
  a group of ranks' shards);
* the run's state, ``run_state.json`` and ``rng.pt`` (see :mod:`orchestrator.run.resume`);
* ``MANIFEST.json``, written last: every other file with its size and SHA-256.

:class:`CheckpointStore` writes such a directory atomically: into a temporary directory,
every file fsynced, the manifest last, then renamed into place. A directory without a
manifest (a crash mid-write) is never loaded, and one whose files do not match their
manifest is reported in one line and skipped for the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.errors import ConfigError, PolyRLError
from orchestrator.faults import kill_point

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
BEST = "best.json"  # in the checkpoints directory: the best checkpoint, when one is kept
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(PolyRLError):
    """A checkpoint directory whose files do not match its manifest."""


@dataclass(frozen=True)
class Best:
    """The checkpoint of ``step`` scored ``value`` by ``metric`` (``checkpoint.keep_best``),
    the highest of the run's evaluations so far."""

    step: int
    metric: str
    value: float

    @classmethod
    def of(cls, data: object) -> Best | None:
        """Read back from ``best.json`` or ``run_state.json`` (None stays None)."""
        if not isinstance(data, dict):
            return None
        return cls(step=int(data["step"]), metric=str(data["metric"]), value=float(data["value"]))


class CheckpointStore:
    """``<run_dir>/checkpoints/step-<N>/``: written atomically, the last ``keep`` kept, and
    the best one (``best.json``) and those held for an evaluation besides."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._held: frozenset[int] = frozenset()  # steps an evaluation will score
        self._lock = threading.Lock()  # one writer or pruner at a time

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """``write(tmp_dir)`` fills a temporary directory; it becomes ``step-<step>`` once every
        file is on disk and the manifest, written last, lists them."""
        with self._lock:
            return self._save(step, write)

    def _save(self, step: int, write: Callable[[Path], None]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        kill_point("checkpoint", step)
        files = {str(p.relative_to(tmp)): _describe(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        for name in files:
            _fsync(tmp / name)
        _write_synced(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
        final = self.path(step)
        if final.exists():  # a resumed run writing the same step again
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(self.root)  # the rename itself is durable once the directory is synced
        self._prune()
        return final

    def steps(self) -> list[int]:
        """Steps with a complete (manifested) checkpoint directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = [int(m.group(1)) for p in self.root.iterdir()
                 if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
        return sorted(found)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint whose files match its manifest; corrupt ones are reported in
        one line each and skipped."""
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                verify(path)
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return path
        return None

    # -- the best checkpoint ------------------------------------------------------------------

    def best(self) -> Best | None:
        """The best checkpoint ``best.json`` names, if its directory is still complete."""
        try:
            best = Best.of(json.loads((self.root / BEST).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring %s: %s", self.root / BEST, e)
            return None
        return best if best is not None and best.step in self.steps() else None

    def set_best(self, best: Best | None) -> None:
        """Name ``best`` in ``best.json`` (None: remove it); its checkpoint is kept from now on,
        the one it replaces goes at the next prune."""
        path = self.root / BEST
        if best is None:
            path.unlink(missing_ok=True)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{BEST}.tmp"
        _write_synced(tmp, json.dumps(asdict(best)) + "\n")
        tmp.rename(path)

    def hold(self, steps: Iterable[int]) -> None:
        """Keep the checkpoints of ``steps`` (besides the latest and the best) until the next
        call: an evaluation of their weights is still running."""
        self._held = frozenset(steps)

    def prune(self) -> None:
        """Remove what is neither among the newest ``keep``, nor the best, nor held."""
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        best = self.best()
        kept = self._held | ({best.step} if best is not None else set())
        for step in self.steps()[: -self.keep]:
            if step not in kept:
                shutil.rmtree(self.path(step), ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)


def verify(path: Path) -> None:
    """Raise :class:`CorruptCheckpoint` unless every file matches ``path``'s manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"unreadable {MANIFEST} ({e})") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CorruptCheckpoint(
                f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}")
        if _sha256(file) != expected["sha256"]:
            raise CorruptCheckpoint(f"{name} does not match its checksum")


def _describe(path: Path) -> dict[str, object]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
