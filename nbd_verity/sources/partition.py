"""One partition of an image as an image of its own: byte 0 is the partition's first byte.

A Discoverable Disk Image holds the data and the hash tree in two partitions of one
file (or block device, or URL); the verifier and the offline tools read each through a
PartitionSource over an opened source (ImageFile or NbdSource), so no offset arithmetic
leaks into them. A read past the partition's end is an ImageIOError, like a read past a
file's end: a partition never lends bytes of its neighbour. The partition owns its
source and closes it; counters (NBD sources) pass through for `ctl stats`.
"""

from __future__ import annotations

from ..errors import ImageIOError


class PartitionSource:
    """size bytes from offset of source, with ImageFile's read interface."""

    def __init__(self, source, offset: int, size: int, label: str) -> None:
        self.source = source
        self.offset = offset
        self._size = size
        self.role = source.role
        self.path = f"{source.path} ({label})"  # what messages name

    def size(self) -> int:
        return self._size

    def _check(self, size: int, offset: int) -> None:
        if offset < 0 or offset + size > self._size:
            raise ImageIOError(f"{self.role} image {self.path} ends at byte {self._size}, "
                               f"{offset + size} needed")

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill buf with the partition's bytes at offset, or raise ImageIOError."""
        self._check(len(buf), offset)
        self.source.read_into(buf, self.offset + offset)

    def read(self, size: int, offset: int) -> bytearray:
        buf = bytearray(size)
        self.read_into(memoryview(buf), offset)
        return buf

    def read_exact(self, size: int, offset: int) -> bytes:
        """As ImageFile.read_exact (the offline tools' read)."""
        return bytes(self.read(size, offset))

    def window(self, offset: int, size: int) -> memoryview:
        """As ImageFile.window: mapped where the source can map (offsets page-aligned
        inside the partition need not be in the file; then it is read)."""
        self._check(size, offset)
        inner = getattr(self.source, "window", None)
        if inner is None:
            return memoryview(self.read_exact(size, offset))
        return inner(self.offset + offset, size)

    def counters(self) -> dict:
        inner = getattr(self.source, "counters", None)
        return inner() if inner is not None else {}

    def reset_counters(self) -> None:
        getattr(self.source, "reset_counters", lambda: None)()

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> PartitionSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
