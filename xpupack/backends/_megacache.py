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
import zlib
from collections import Counter

from ..errors import PackageFormatError

#: the container version ``torch.utils._appending_byte_serializer`` writes (``_ENCODING_VERSION``)
CONTAINER_VERSION = 1
_UINT64 = 8
_CRC = 4


class _Reader:
    """Reads the container's fields, refusing any that runs past the end."""

    def __init__(self, blob: memoryview, where: str):
        self.blob, self.at, self.where = blob, 0, where

    def done(self) -> bool:
        return self.at == len(self.blob)

    def uint64(self) -> int:
        return int.from_bytes(self.field(_UINT64), "big")

    def field(self, size: int | None = None) -> memoryview:
        if size is None:
            size = self.uint64()
        if size > len(self.blob) - self.at:
            raise self.damaged(f"a field of {size} bytes at byte {self.at} runs past the end")
        self.at += size
        return self.blob[self.at - size : self.at]

    def name(self) -> str:
        """An artifact type's name: base64 of an identifier (``inductor``, ``autotune``...)."""
        try:
            name = base64.b64decode(self.field(), validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            name = ""
        if not name.isidentifier():
            raise self.damaged(f"the artifact type before byte {self.at} is not a name")
        return name

    def damaged(self, what: str) -> PackageFormatError:
        return PackageFormatError(
            f"{self.where} is not PyTorch's cache-artifact container version {CONTAINER_VERSION}: {what}; "
            "it was written by another torch, or is damaged — `xpupack verify` checks its digest",
            path=self.where,
        )


def artifact_counts(blob: bytes, where: str) -> dict[str, int]:
    """How many artifacts of each type a mega-cache holds, in its order: ``{"inductor": 2, "aot_autograd": 2}``.

    Args:
        blob: what ``torch.compiler.save_cache_artifacts`` returned first.
        where: the file it came from (for messages).

    Returns:
        The number of artifacts of each type name that PyTorch wrote (``autotune``: kernel tuning results).

    Raises:
        PackageFormatError: ``blob`` is not a container of the version this reads, or is damaged.
    """
    reader = _Reader(memoryview(blob), where)
    checksum = reader.field(_CRC)
    if int.from_bytes(checksum, "big") != zlib.crc32(reader.blob[_CRC:]):
        raise reader.damaged("its CRC-32 does not match")
    if (version := reader.uint64()) != CONTAINER_VERSION:
        raise reader.damaged(f"its version is {version}")
    counts: Counter[str] = Counter()
    while not reader.done():
        name = reader.name()
        for _ in range(reader.uint64()):  # each artifact is a key and a content: the loop ends at the blob's end
            reader.field()
            reader.field()
            counts[name] += 1
    return dict(counts)
