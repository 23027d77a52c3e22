"""Where image bytes come from: a local file opened read-only.

Reads go straight into the caller's buffer with preadv (no copy; the GIL is released
while the kernel reads). A short read means the image ends before the geometry says it
should (for example truncated under a running server): that is an ImageIOError naming
the image and the byte, which the plugin turns into EIO for that request only.

The offline tools (format, verify) read through the same class: whole mapped windows of
data (ImageFile.window) and exact reads of hash blocks (ImageFile.read_exact), their
messages naming the image by its path alone; format writes the hash image through
HashImageWriter, the only class here that opens an image for writing. The data image is
never opened for writing.
"""

from __future__ import annotations

import contextlib
import mmap
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

    # Used by the offline tools (builder.py): they name the image by its path alone.

    _mappable = True  # until window() fails to map this image

    def __enter__(self) -> ImageFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def end(self) -> int:
        """The image's size found by seeking to its end (st_size is 0 for a block device)."""
        return os.lseek(self.fd, 0, os.SEEK_END)

    def read_exact(self, size: int, offset: int) -> bytes:
        """Exactly size bytes at offset, or ImageIOError naming the image and the byte."""
        chunks = []
        got = 0
        while got < size:
            try:
                buf = os.pread(self.fd, size - got, offset + got)
            except OSError as e:
                raise ImageIOError(f"{self.path}: {e.strerror} (reading at byte "
                                   f"{offset + got})") from None
            if not buf:
                raise ImageIOError(f"{self.path}: image ends at byte {offset + got}, "
                                   f"{offset + size} needed")
            chunks.append(buf)
            got += len(buf)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def window(self, offset: int, size: int) -> memoryview:
        """size bytes at offset (page-aligned), mapped rather than read when the image can be.

        Hashing a mapped window (MAP_POPULATE faults it in at once) reads the page cache
        directly and saves copying every byte once (about 10% of format's CPU here). An
        image that cannot be mapped (a character device, say) is read from then on. The
        image must not shrink while mapped (SIGBUS): callers check its size first.
        """
        if self._mappable:
            try:
                return memoryview(mmap.mmap(self.fd, size, offset=offset,
                                            flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                            prot=mmap.PROT_READ))
            except (OSError, ValueError):
                self._mappable = False
        return memoryview(self.read_exact(size, offset))


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


class HashImageWriter(ImageFile):
    """The hash image as format writes it: opened read-write, created (mode 0644) if
    missing; discard() removes it again only if this writer created it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.role = "hash"
        self.created = not os.path.exists(path)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ImageIOError(f"{path}: {e.strerror}") from None

    def pwrite_all(self, buf: bytes, offset: int) -> None:
        """Write all of buf at offset, or raise ImageIOError naming the image and the byte."""
        view = memoryview(buf)
        while view:
            try:
                done = os.pwrite(self.fd, view, offset)
            except OSError as e:
                raise ImageIOError(f"{self.path}: {e.strerror} (writing at byte "
                                   f"{offset})") from None
            view, offset = view[done:], offset + done

    def extend_to(self, size: int) -> None:
        """Grow the image to size bytes if it is shorter (the new bytes read as zeros)."""
        if self.end() < size:
            self._call(os.ftruncate, size)

    def sync(self) -> None:
        """Flush what was written to the disk."""
        self._call(os.fsync)

    def discard(self) -> None:
        """Close the image and remove it if this writer created it (a failed format)."""
        self.close()
        if self.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _call(self, call, *args) -> None:
        try:
            call(self.fd, *args)
        except OSError as e:
            raise ImageIOError(f"{self.path}: {e.strerror}") from None
