"""Weights between a model and a package's files, a tensor at a time (the layout: `xpupack.shards`).

Writing: the tensors are cut into shards (`shards.plan_shards`); each shard is written as a safetensors
file by a thread of its own (up to four side by side), while another thread hashes the same bytes, so
the manifest's sha256 costs no second read of the file. safetensors' ``save_file`` cannot hand over
the bytes it writes, and hashing its file afterwards adds a full read at the speed of one core's sha256
(about 1 GB/s on the 2-core CI machine, beside 3 GB/s for writing to the page cache). The layout
written is safetensors' own (an 8-byte little-endian header length, the JSON header padded with spaces
to 8 bytes, then the data, widest dtypes first so that every tensor is aligned), and safetensors' own
parser reads every file back before the package is complete. A tensor on an accelerator comes to the
host when its turn to be written comes, never the whole model at once.

Reading: `stored_tensors` hands out each tensor of each file, in file order, as a CPU tensor over
safetensors' memory map of the file (the loader copies it where it belongs), and hashes the file from
that same memory on the way.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import sys
import threading
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from . import _device
from .digests import Digests
from .shards import SAFETENSORS_DTYPES, WEIGHTS, WEIGHTS_INDEX, index_json, plan_shards, shard_name

#: torch's dtypes -> safetensors' codes
_CODES = {getattr(torch, name): code for code, name in SAFETENSORS_DTYPES.items() if hasattr(torch, name)}
#: shards written at once, at most (each by a thread, with a thread hashing it)
_MAX_WRITERS = 4
#: files a load hashes at once, at most: sha256 runs at one core's speed, and a load's copies want one too
_HASHING_AT_ONCE = max(1, min((os.cpu_count() or 1) - 1, 8))
#: tensors handed to the hashing thread and not yet hashed, at most (each is held on the host until then)
_IN_FLIGHT = 4


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_size: int) -> tuple[str, dict[str, dict]]:
    """Writes ``tensors`` into ``folder``: one ``model.safetensors`` when they fit ``max_shard_size`` bytes, else
    shards and their index.

    Returns:
        The manifest's ``model.weights`` (the file, or the index), and ``{file: {sha256, size}}`` of the files of
        tensors written.
    """
    planned = plan_shards({name: tensor.nbytes for name, tensor in tensors.items()}, max_shard_size)
    if len(planned) <= 1:
        files = {WEIGHTS: planned[0] if planned else []}
    else:
        files = {shard_name(k, len(planned)): names for k, names in enumerate(planned, 1)}
    # shards side by side: one file's sha256 runs at the speed of one core (about 1-2 GB/s), below a disk's
    with ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1, _MAX_WRITERS)), "xpupack-write") as pool:
        futures = {
            file: pool.submit(_write_file, folder / file, {name: tensors[name] for name in names})
            for file, names in files.items()
        }
        written = {file: future.result() for file, future in futures.items()}
    if len(files) == 1:
        return WEIGHTS, written
    index = index_json(files, sum(tensor.nbytes for tensor in tensors.values()))
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return WEIGHTS_INDEX, written


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """One safetensors file of ``tensors``; returns its ``{sha256, size}``, hashed as it was written."""
    if sys.byteorder != "little":
        raise NotImplementedError("xpupack writes safetensors (little-endian) on little-endian machines only")
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))  # widest first: aligned
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _CODES:
            raise ValueError(f"{name} is a {tensor.dtype} tensor, which safetensors cannot store")
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    pending: queue.Queue = queue.Queue(maxsize=_IN_FLIGHT)

    def hash_pending() -> None:
        while (chunk := pending.get()) is not None:
            digest.update(chunk)  # lets go of the GIL: hashing runs beside the writing

    hasher = threading.Thread(target=hash_pending, name="xpupack-sha256", daemon=True)
    hasher.start()
    try:
        with path.open("wb") as stream:
            # a generator: a tensor comes to the host only when its turn to be written comes
            chunks: Iterator[bytes | memoryview] = chain(
                [struct.pack("<Q", len(text)) + text], (_host_bytes(tensors[name]) for name in order)
            )
            for chunk in chunks:
                pending.put(chunk)
                stream.write(chunk)
            # the save flushes every file to disk before the package is complete (`_fsutil.replace_dir`):
            # done here, it runs while the hashing catches up
            stream.flush()
            os.fsync(stream.fileno())
    finally:
        pending.put(None)
        hasher.join()
    return {"sha256": digest.hexdigest(), "size": 8 + len(text) + offset}


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order, on the host (a copy for an accelerator's tensor)."""
    return _memory(_device.host_bytes_copy(tensor.detach()))


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, no copy (the array under the view keeps the tensor alive)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def stored_tensors(
    root: Path, files: list[str], digests: Digests | None = None
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``(stored name, tensor)`` for every tensor of ``files``, a file at a time and in the order of the file's
    data (sequential reads). Each tensor is on the CPU over safetensors' memory map of the file: copy it
    before taking the next.

    A file ``digests`` needs is hashed on the way by a worker thread, from the same memory: its header as
    read from the file, then each tensor's bytes in order — the whole file, as safetensors refuses a header
    whose tensors leave a byte of the file out. The copies never wait for the hashing: a file's memory map
    stays open until its thread is done, the next file is read meanwhile (up to one file per core being
    hashed at once), and each digest goes to ``digests`` once its file is hashed to its end.
    """
    from safetensors import safe_open

    hashing: deque[tuple[str, _Hashing, ExitStack]] = deque()  # files being hashed, oldest first
    try:
        for file in files:
            opened = ExitStack()
            stored = opened.enter_context(safe_open(str(root / file), framework="pt", device="cpu"))
            if digests is None or not digests.needs(file):
                with opened:
                    for name in stored.offset_keys():
                        yield name, stored.get_tensor(name)
                continue
            hashing.append((file, _Hashing(root / file), opened))
            while len(hashing) > _HASHING_AT_ONCE:
                _hashed(digests, *hashing.popleft())
            for name in stored.offset_keys():
                tensor = stored.get_tensor(name)
                hashing[-1][1].feed(_memory(tensor))
                yield name, tensor
            hashing[-1][1].feed(None)
        while hashing:
            _hashed(digests, *hashing.popleft())  # type: ignore[arg-type]
    finally:  # stopped early: the threads end before the memory maps they read close
        for _file, hasher, opened in hashing:
            hasher.feed(None)
            hasher.finish()
            opened.close()


def _hashed(digests: Digests, file: str, hasher: _Hashing, opened: ExitStack) -> None:
    """Waits for ``file``'s hashing, closes its memory map, hands its digest to ``digests``."""
    with opened:
        digests.hashed(file, hasher.finish())


class _Hashing:
    """The sha256 of one file, computed in a worker thread from what `feed` hands it (None: the end), starting
    from its header."""

    def __init__(self, path: Path):
        self._digest = hashlib.sha256()
        with path.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            self._digest.update(struct.pack("<Q", length) + stream.read(length))  # safetensors checked the length
        # unbounded: the chunks are views of the memory map (nothing is copied), and the copies must not wait
        self._pending: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="xpupack-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._pending.get()) is not None:
            self._digest.update(chunk)

    def feed(self, chunk: memoryview | None) -> None:
        self._pending.put(chunk)

    def finish(self) -> str:
        """The digest, once everything fed is hashed (the end must have been fed)."""
        self._thread.join()
        return self._digest.hexdigest()
