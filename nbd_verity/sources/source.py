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

An image is a regular file or a block device (a partition, a logical volume, a loop
device), and this module is the one home of two rules about it: what may be opened as an
image (check_kind refuses a directory, FIFO, character device or socket in one line, and
without opening a FIFO, which would block) and how big it is (size_of_fd: st_size for a
file, the size the kernel reports for a block device, whose st_size is 0).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat

from ..errors import ImageIOError


class ImageFile:
    """A read-only image with exact-length reads."""

    def __init__(self, path: str, role: str) -> None:
        self.path = path
        self.role = role  # "data", "hash" or "fec", for messages
        self.fd = open_image(path, role, os.O_RDONLY)

    def size(self) -> int:
        """The image's size in bytes (a block device's as the kernel reports it)."""
        return size_of_fd(self.fd)

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

    def check_room(self, size: int) -> None:
        """Refuse a block device smaller than size bytes as an output: it cannot grow (a
        regular file grows as it is written)."""
        if stat.S_ISBLK(os.fstat(self.fd).st_mode) and self.size() < size:
            raise ImageIOError(f"{self.role}: {self.path} is {self.size()} bytes, "
                               f"{size} needed")

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


def image_kind_problem(mode: int) -> str | None:
    """Why a file of this st_mode cannot hold an image, or None (a regular file or a
    block device)."""
    if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
        return None
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_kind(path: str, role: str, mode: int) -> None:
    """Refuse, in one line naming the role and the path, a file that is not an image."""
    problem = image_kind_problem(mode)
    if problem is not None:
        raise ImageIOError(f"{role}: {path}: {problem}, not a regular file or a block device")


def open_image(path: str, role: str, flags: int, mode: int = 0o644) -> int:
    """Open an image (flags: O_RDONLY, or O_RDWR with O_CREAT for an output) and return
    its fd, or raise ImageIOError in one line.

    The kind is checked by stat before opening (opening a FIFO for reading blocks until a
    writer comes; opening a device has effects of its own) and again by fstat after
    (the path may have changed in between, hence also O_NONBLOCK, cleared once checked).
    """
    try:
        check_kind(path, role, os.stat(path).st_mode)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise ImageIOError(f"{role}: {path}: No such file or directory") from None
    except OSError as e:
        raise ImageIOError(f"{role}: {path}: {e.strerror}") from None
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, mode)
    except OSError as e:
        raise ImageIOError(f"{role}: {path}: {e.strerror}") from None
    try:
        check_kind(path, role, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(stream, limit: int, name: str, error: type[Exception]) -> bytes:
    """At most limit bytes of a readable stream (a file, an HTTP body), or error in one
    line naming name: the one rule for files that are read whole (sidecars, certificates,
    keys, root hash files)."""
    try:
        blob = stream.read(limit + 1)
    except OSError as e:
        raise error(f"{name}: {e.strerror or e}") from None
    if len(blob) > limit:
        raise error(f"{name}: larger than {limit} bytes")
    return blob


def read_small_file(path: str, limit: int, error: type[Exception],
                    missing_ok: bool = False, label: str | None = None) -> bytes | None:
    """A small regular file's bytes (read_capped), or None if it is missing and missing_ok.

    Only a regular file is read: a FIFO would block the open until a writer came, a
    device or a directory is not a file of bytes to read whole. label (default: the path)
    starts every message."""
    name = label or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise error(f"{name}: No such file or directory") from None
    except OSError as e:
        raise error(f"{name}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{name}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return read_capped(f, limit, name, error)


def size_of_fd(fd: int) -> int:
    """The one rule for an image's size: st_size for a regular file; for a block device
    (st_size 0) the kernel's size of it, which a seek to its end returns (as
    BLKGETSIZE64 does; every read here is a pread, so the file position is unused)."""
    st = os.fstat(fd)
    return os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size


def image_size(path: str, role: str) -> int:
    """The size of the image at path, opened read-only as an image."""
    with ImageFile(path, role) as image:
        return image.size()


def check_output_room(path: str, role: str, size: int) -> None:
    """Refuse, before anything is written, an existing output that cannot grow (a block
    device) and is smaller than size bytes; a missing path or a regular file passes."""
    if not os.path.lexists(path):
        return
    with ImageFile(path, role) as image:
        image.check_room(size)


class ImageWriter(ImageFile):
    """An output image (the hash image format writes, the FEC parity): opened read-write,
    created (mode 0644) if missing; discard() removes it again only if this writer
    created it. A block device is written in place; it cannot grow. A new file is made
    with O_EXCL (a symlink planted meanwhile makes it fail, not write elsewhere), and a
    symlink to nothing is refused rather than followed to create its target."""

    def __init__(self, path: str, role: str) -> None:
        self.path = path
        self.role = role
        self.created = not os.path.lexists(path)
        if not self.created and not os.path.exists(path):
            raise ImageIOError(f"{role}: {path}: a symlink to a missing file")
        self.fd = open_image(path, role, os.O_RDWR | (os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                                      if self.created else 0))

    def pwrite_all(self, buf: bytes, offset: int) -> None:
        """Write all of buf at offset, or raise ImageIOError naming the image and the byte."""
        view = memoryview(buf)
        while view:
            try:
                done = os.pwrite(self.fd, view, offset)
            except OSError as e:
                raise ImageIOError(f"{self.role}: {self.path}: {e.strerror} (writing at "
                                   f"byte {offset})") from None
            view, offset = view[done:], offset + done

    def extend_to(self, size: int) -> None:
        """Grow the image to size bytes if it is shorter (the new bytes read as zeros)."""
        if self.size() < size:
            self.check_room(size)
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
            raise ImageIOError(f"{self.role}: {self.path}: {e.strerror}") from None


class HashImageWriter(ImageWriter):
    """The hash image as format writes it."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "hash")
