"""The sha256 of a package's files: checked in worker threads, and, for weights files, remembered once
verified (docs/safety.md, "Remembered verifications").

A load reads its weights once, and checking their digest must not read them a second time: a load
hashes each weights file in a worker thread from the very bytes it copies into the model (hashlib lets
go of the GIL), and waits for the digests before anything runs on those weights. A
weights file this machine verified before, and that has not changed since, is not hashed again: its
verification is remembered under xpupack's cache folder by the file's size, modification and change
times, inode and device (`FileState`). Nothing can change a file's contents without changing its change
time (``st_ctime``; unlike the modification time, no program can set it), so a remembered verification
holds exactly as long as the file is unchanged — with two limits, both handled here:

- a file system stamps times at a coarse granularity (a clock tick; seconds on some), so a write in the
  same tick as the verification would leave the state as it was: a file changed less than `SETTLE_S`
  before it is hashed is never remembered (git calls such an entry "racily clean");
- a file changed while it was being hashed or read: its state is compared before and after (`Digests.wait`).

``XPUPACK_REMEMBER_VERIFIED=0`` turns remembering off: every load hashes every file again.

On a machine of `HASH_AHEAD_CORES` cores or more, a load hashes each weights file in a thread of its own from
the start, reading it a second time (from the page cache the copy fills or has filled), instead of from the
bytes it copies: fed at the copy's pace, a 5 GB shard's hash finished long after its copy (one core's sha256 is
slower than the copy into a GPU), and the files' hashes ran one after another behind the copies. On an H100
host (16 cores), 4 GB of weights in one file loaded at 1.3 GB/s hashed from the copied bytes, 4.0 GB/s with
the verification remembered (benchmarks/weights_io.py).

Torch-free, so ``xpupack verify`` hashes without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import astuple, dataclass
from pathlib import Path

from .errors import IntegrityError

#: a file whose last change is more recent than this when it is hashed is not remembered (timestamp granularity:
#: a clock tick on Linux file systems, 1 s on some network file systems and 2 s on FAT)
SETTLE_S = 2.0
#: the most verifications remembered (the oldest are forgotten first)
MAX_REMEMBERED = 4096
_REMEMBERED_FILE = "verified-files.json"
_BLOCK = 8 << 20


def sha256_of(path: Path, stop: threading.Event | None = None) -> str:
    """The sha256 of the file at ``path`` (hex), read in 8 MiB blocks; ``stop`` set: gives up (returns "")."""
    digest = hashlib.sha256()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with path.open("rb", buffering=0) as stream:
        while count := stream.readinto(block):
            digest.update(view[:count])  # lets go of the GIL: threads hash files side by side
            if stop is not None and stop.is_set():
                return ""
    return digest.hexdigest()


@dataclass(frozen=True)
class FileState:
    """What changes whenever a file's contents change: size, modification and change times, inode, device."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileState:
        info = path.stat()  # through a link (the Hub cache's): the blob's own
        return cls(info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)

    def settled(self, now_ns: int) -> bool:
        """Whether the last change is older than `SETTLE_S` at ``now_ns``, so any later change shows."""
        return now_ns - max(self.mtime_ns, self.ctime_ns) > SETTLE_S * 1e9


#: from this many cores on, a load hashes its weights files ahead, in threads of their own (`hash_ahead`)
HASH_AHEAD_CORES = 4


def hash_ahead() -> bool:
    """Whether a load hashes its weights files in threads of their own from the start (cores to spare: a core
    copies, the others hash) rather than from the bytes it copies (read once: a machine of few cores)."""
    return (os.cpu_count() or 1) >= HASH_AHEAD_CORES


def cache_dir() -> Path:
    """xpupack's cache folder: ``XPUPACK_CACHE``, else ``$XDG_CACHE_HOME/xpupack``, else ``~/.cache/xpupack``."""
    if os.environ.get("XPUPACK_CACHE"):
        return Path(os.environ["XPUPACK_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xpupack"


def remembering() -> bool:
    """Whether loads trust remembered verifications (``XPUPACK_REMEMBER_VERIFIED``, default on)."""
    return os.environ.get("XPUPACK_REMEMBER_VERIFIED", "1").strip().lower() not in ("0", "false", "no", "off")


class Remembered:
    """The weights files this machine verified: ``{real path: {sha256, state}}`` in one JSON file of the cache
    folder, replaced atomically; concurrent writers may lose each other's entries, which costs a hash later."""

    _lock = threading.Lock()

    def __init__(self, folder: Path | None = None):
        self.file = (folder or cache_dir()) / _REMEMBERED_FILE

    def knows(self, path: Path, sha256: str, state: FileState) -> bool:
        """Whether ``path``, in ``state`` now, was verified to have ``sha256`` in that same state."""
        entry = self._read().get(os.path.realpath(path))
        return entry is not None and entry.get("sha256") == sha256 and entry.get("state") == list(astuple(state))

    def remember(self, verified: dict[Path, tuple[str, FileState]]) -> None:
        """Records ``{path: (sha256, state it was hashed in)}``; a file not `FileState.settled` is left out."""
        now = time.time_ns()
        settled = {path: entry for path, entry in verified.items() if entry[1].settled(now)}
        if not settled:
            return
        with self._lock:
            entries = self._read()
            for path, (sha256, state) in settled.items():
                key = os.path.realpath(path)
                entries.pop(key, None)  # re-inserted last: the newest is forgotten last
                entries[key] = {"sha256": sha256, "state": list(astuple(state))}
            kept = dict(list(entries.items())[-MAX_REMEMBERED:])
            with suppress(OSError):  # a read-only cache folder costs a hash next time, nothing else
                self._write(kept)

    def _write(self, entries: dict[str, dict]) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.file.parent, prefix=".verified-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as stream:
                json.dump({"version": 1, "files": entries}, stream)
            os.replace(temporary, self.file)  # a reader sees the old file or the new one, never half of one
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("version") == 1 else None
        return (
            {key: value for key, value in files.items() if isinstance(value, dict)} if isinstance(files, dict) else {}
        )


class Digests:
    """sha256 checks of some of a package's files, in worker threads, awaited with `wait`.

    Args:
        root: the package folder.
        listed: the manifest's ``files`` (``{relative: {sha256, size}}``).
        relatives: the files to check, in the order their errors are reported.
        remembered: where verifications are remembered (they are then recorded there, and trusted where
            ``trust_remembered``); None: neither.
        by_reader: the files are about to be read whole (a load streams its weights): whoever reads one
            hashes the bytes it reads and hands the digest over (`hashed`), so the file is read once. `wait`
            hashes whatever no reader did. Otherwise the threads start hashing at once.
    """

    def __init__(
        self,
        root: Path,
        listed: dict[str, dict],
        relatives: list[str],
        *,
        remembered: Remembered | None = None,
        trust_remembered: bool = False,
        by_reader: bool = False,
    ):
        self.root, self._listed, self._remembered = root, listed, remembered
        self._stop = threading.Event()
        self._states = {relative: FileState.of(root / relative) for relative in relatives}
        #: the files to hash, in order (the rest are remembered as verified in the state they are in)
        self._needed = [
            relative
            for relative, state in self._states.items()
            if not (
                trust_remembered
                and remembered is not None
                and remembered.knows(root / relative, listed[relative]["sha256"], state)
            )
        ]
        self._pool = ThreadPoolExecutor(max(1, min(len(self._needed), os.cpu_count() or 1, 8)), "xpupack-sha256")
        self._futures: dict[str, Future[str]] = {}
        self._by_reader: dict[str, str] = {}
        if not by_reader:
            self._hash_the_rest()
        self._awaited = False
        self._outcome: IntegrityError | None = None

    @property
    def hashing(self) -> list[str]:
        """The files to hash (not remembered as verified)."""
        return list(self._needed)

    def needs(self, relative: str) -> bool:
        """Whether a reader of ``relative`` should hash it (`hashed`): no one has, and it is not remembered."""
        return relative in self._needed and relative not in self._by_reader and relative not in self._futures

    def hashed(self, relative: str, sha256: str) -> None:
        """The sha256 of everything a reader read of ``relative``, from its first byte to its last."""
        self._by_reader[relative] = sha256

    def _hash_the_rest(self) -> None:
        for relative in self._needed:
            if self.needs(relative):
                self._futures[relative] = self._pool.submit(sha256_of, self.root / relative, self._stop)

    def wait(self) -> None:
        """Returns once every file checked out, unchanged since the check began.

        Raises:
            IntegrityError: a file does not match its sha256, or changed while it was checked or read.
        """
        if not self._awaited:
            self._awaited = True
            try:
                self._hash_the_rest()
                self._check()
            except IntegrityError as exc:
                self._outcome = exc
            finally:
                self._pool.shutdown()
        if self._outcome is not None:
            raise self._outcome

    def _check(self) -> None:
        verified = {}
        for relative in self._needed:
            actual, expected = (
                self._by_reader.get(relative) or self._futures[relative].result(),
                self._listed[relative]["sha256"],
            )
            if actual != expected:
                raise IntegrityError(
                    f"{self.root / relative} does not match its sha256 in the manifest; the file was changed "
                    "or damaged — rebuild or re-download the package",
                    path=relative,
                    expected=expected,
                    actual=actual,
                )
            verified[self.root / relative] = (actual, self._states[relative])
        for relative, state in self._states.items():
            if FileState.of(self.root / relative) != state:
                raise IntegrityError(
                    f"{self.root / relative} changed while it was being checked and read; load it again once "
                    "nothing writes the package",
                    path=relative,
                )
        if self._remembered is not None:
            self._remembered.remember(verified)

    def cancel(self) -> None:
        """Stops hashing (an interrupted load): the threads give up within a block."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def reported_first(self) -> Iterator[None]:
        """An error raised inside while digests are pending gives way to a failed digest: a damaged file is
        what to report (a header it garbled fails its parse first, say). ``KeyboardInterrupt`` and the
        like stop the hashing and pass."""
        try:
            yield
        except Exception as exc:
            try:
                self.wait()
            except IntegrityError as damaged:
                raise damaged from exc
            raise
        except BaseException:
            self.cancel()
            raise
