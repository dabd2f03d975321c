"""What PyTorch's portable cache artifacts ("mega-cache") hold, counted by type without torch and without pickle.

``torch.compiler.save_cache_artifacts`` writes its artifacts into the
container of ``torch.utils._appending_byte_serializer``: a CRC-32 of the rest,
the container version (1), then for each artifact type its name, how many
artifacts follow, and each one's key and content, every field a big-endian
uint64 length and its bytes (names and keys base64 within). Only the contents
are pickles (Inductor's graphs, AOTAutograd's entries) or JSON (autotuning
results); the container is plain lengths and strings, so `xpupack inspect` can
read it from any package, trusted or not, and never looks inside a content.

``torch.compiler._cache.CacheArtifactManager.deserialize`` reads the same
container without pickle too (PyTorch's first mega-cache, before it became this
container, was one pickle), but it imports torch and Inductor, which `inspect`
does not pay for.
"""

from __future__ import annotations

import base64
import binascii
import os
import zlib
from collections import Counter
from typing import BinaryIO

from ..errors import PackageFormatError

#: the container version ``torch.utils._appending_byte_serializer`` writes (``_ENCODING_VERSION``)
CONTAINER_VERSION = 1
_UINT64 = 8
_CRC = 4
#: what one read takes from the file: the reader never holds more (a package's cache may be gigabytes)
_BLOCK = 1 << 20
#: the longest artifact type name read (base64 of an identifier: ``aot_autograd`` takes 16 bytes)
_MAX_NAME = 256


class _Reader:
    """Reads the container's fields from a file, refusing any that runs past its end; keys and contents
    are skipped, never read into memory."""

    def __init__(self, stream: BinaryIO, size: int, where: str):
        self.stream, self.size, self.where = stream, size, where
        self.at = stream.seek(_CRC)

    def done(self) -> bool:
        return self.at == self.size

    def uint64(self) -> int:
        return int.from_bytes(self.read(_UINT64), "big")

    def read(self, size: int) -> bytes:
        self.fits(size)
        data = self.stream.read(size)
        if len(data) != size:
            raise self.damaged(f"it ended at byte {self.at + len(data)} while it was read")
        self.at += size
        return data

    def skip(self) -> None:
        """Passes over one field (an artifact's key or content)."""
        size = self.uint64()
        self.fits(size)
        self.at = self.stream.seek(size, os.SEEK_CUR)

    def fits(self, size: int) -> None:
        if size > self.size - self.at:
            raise self.damaged(f"a field of {size} bytes at byte {self.at} runs past the end")

    def name(self) -> str:
        """An artifact type's name: base64 of an identifier (``inductor``, ``autotune``...)."""
        size = self.uint64()
        if size > _MAX_NAME:
            raise self.damaged(f"the artifact type at byte {self.at} is {size} bytes long, not a name")
        try:
            name = base64.b64decode(self.read(size), validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            name = ""
        if not name.isidentifier():
            raise self.damaged(f"the artifact type before byte {self.at} is not a name")
        return name

    def check_crc(self) -> None:
        """The CRC-32 at the start against the rest of the file, read a block at a time."""
        self.stream.seek(0)
        stored = int.from_bytes(self.read_block(_CRC), "big")
        crc, left = 0, self.size - _CRC
        while left:
            block = self.read_block(min(left, _BLOCK))
            crc, left = zlib.crc32(block, crc), left - len(block)
        if stored != crc:
            raise self.damaged("its CRC-32 does not match")
        self.at = self.stream.seek(_CRC)

    def read_block(self, size: int) -> bytes:
        block = self.stream.read(size)
        if len(block) != size:
            raise self.damaged("it is shorter than its size, or changed while it was read")
        return block

    def damaged(self, what: str) -> PackageFormatError:
        return PackageFormatError(
            f"{self.where} is not PyTorch's cache-artifact container version {CONTAINER_VERSION}: {what}; "
            "it was written by another torch, or is damaged — rebuild the package (`xpupack verify` checks "
            "its digest)",
            path=self.where,
        )


def artifact_counts(stream: BinaryIO, where: str) -> dict[str, int]:
    """How many artifacts of each type a mega-cache holds, in its order: ``{"inductor": 2, "aot_autograd": 2}``.

    The file is read a block at a time (a CRC-32 over all of it, then the fields, keys and contents
    skipped), so a cache of any size costs a megabyte of memory.

    Args:
        stream: the file ``torch.compiler.save_cache_artifacts``'s bytes were written to, open for
            reading in binary (``io.BytesIO`` for bytes in memory).
        where: the file it is (for messages).

    Returns:
        The number of artifacts of each type name that PyTorch wrote (``autotune``: kernel tuning results).

    Raises:
        PackageFormatError: the file is not a container of the version this reads, or is damaged.
    """
    size = stream.seek(0, os.SEEK_END)
    reader = _Reader(stream, size, where)
    if size < _CRC:
        raise reader.damaged(f"it has {size} bytes, too few for its CRC-32")
    reader.check_crc()
    if (version := reader.uint64()) != CONTAINER_VERSION:
        raise reader.damaged(f"its version is {version}")
    counts: Counter[str] = Counter()
    while not reader.done():
        name = reader.name()
        for _ in range(reader.uint64()):  # each artifact is a key and a content: the loop ends at the file's end
            reader.skip()
            reader.skip()
            counts[name] += 1
    return dict(counts)
