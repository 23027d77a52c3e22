"""Where image bytes come from: a local file opened read-only.

Reads go straight into the caller's buffer with preadv (no copy; the GIL is released
while the kernel reads). A short read means the image ends before the geometry says it
should (for example truncated under a running server): that is an ImageIOError naming
the image and the byte, which the plugin turns into EIO for that request only.
"""

from __future__ import annotations

import os

from .errors import ImageIOError


class ImageFile:
    """A read-only image with exact-length reads."""

    def __init__(self, path: str, role: str) -> None:
        self.path = path
        self.role = role  # "data" or "hash", for messages
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ImageIOError(f"{role}: {path}: {e.strerror}") from None

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill buf with the bytes at offset, or raise ImageIOError."""
        done = 0
        total = len(buf)
        while done < total:
            try:
                n = os.preadv(self.fd, [buf[done:]], offset + done)
            except OSError as e:
                raise ImageIOError(f"{self.role} image {self.path}: read at byte "
                                   f"{offset + done}: {e.strerror}") from None
            if n == 0:
                raise ImageIOError(f"{self.role} image {self.path} ends at byte "
                                   f"{self.size()}, {offset + total} needed (truncated?)")
            done += n

    def read(self, size: int, offset: int) -> bytearray:
        buf = bytearray(size)
        self.read_into(memoryview(buf), offset)
        return buf

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
