"""What a path is backed by, and the rules every command follows when it writes a file.

- backing(): the identity of what holds a path's bytes (a file's device and inode, a
  block device, the file behind a loop device, a partition's disk) and where the path's
  byte 0 is in it. Two paths are the same file when their identities are equal, through
  any symlink, hard link or loop device: the overlap rule (format/areas.py) and the
  output rule below both ask this.
- check_outputs(): no output may be an input. A root-hash file, a signature or a sidecar
  written over the data image, the hash image, the key or the certificate would destroy
  it; every such collision is refused in one line before anything is written.
- write_atomically(): a small output (root hash, signature, metrics, plot) is written to a
  fresh file made by mkstemp in the same directory, flushed, then renamed over the path.
  mkstemp opens with O_CREAT|O_EXCL, so a symlink planted at a fixed temporary name can
  redirect nothing, and a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import tempfile

from .errors import ConfigError

LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")  # struct loop_info64 (linux/loop.h)


def backing(path: str) -> tuple[tuple, int]:
    """(identity of what holds path's bytes, byte of it where path's byte 0 is)."""
    if "://" in path:
        return ("remote", path), 0
    try:
        st = os.stat(path)
    except FileNotFoundError:
        try:
            parent = os.stat(os.path.dirname(os.path.abspath(path)))
        except OSError:
            return ("path", os.path.abspath(path)), 0
        return ("new", parent.st_dev, parent.st_ino, os.path.basename(path)), 0
    except OSError:
        return ("path", os.path.abspath(path)), 0
    if stat.S_ISBLK(st.st_mode):
        return _block_backing(path, st.st_rdev)
    return ("file", st.st_dev, st.st_ino), 0


def _block_backing(path: str, rdev: int) -> tuple[tuple, int]:
    """A block device's backing: a loop device's file, a partition's disk, or itself."""
    sys_dir = f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}"
    loop = _loop_backing(path) if os.path.isdir(f"{sys_dir}/loop") else None
    if loop is not None:
        return loop
    try:
        with open(f"{sys_dir}/partition"):
            pass
        with open(f"{sys_dir}/start") as f:
            start = int(f.read()) * 512
        with open(os.path.join(os.path.realpath(sys_dir), "..", "dev")) as f:
            major, minor = (int(n) for n in f.read().split(":"))
    except (OSError, ValueError):
        return ("block", rdev), 0
    disk, base = _block_backing(f"/dev/block/{major}:{minor}", os.makedev(major, minor))
    return disk, base + start


def _loop_backing(path: str) -> tuple[tuple, int] | None:
    """The file behind a loop device and the loop's offset into it, or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
    except OSError:
        return None  # an unbound loop device
    finally:
        os.close(fd)
    lo_device, lo_inode, _, lo_offset = _LOOP_INFO64.unpack(info)[:4]
    major = (lo_device & 0xFFF00) >> 8  # the kernel's huge_encode_dev
    minor = (lo_device & 0xFF) | ((lo_device >> 12) & 0xFFF00)
    return ("file", os.makedev(major, minor), lo_inode), lo_offset


def same_file(a: str, b: str) -> bool:
    """Whether two paths name the same bytes (backing(), offsets included)."""
    return backing(a) == backing(b)


def check_outputs(outputs, inputs, regular: bool = True) -> None:
    """Refuse any output (pairs of option key and path) that is one of the inputs (pairs
    of role and path), in one line naming both; with regular, also an existing output
    that is not a regular file (a small file is never written into a device)."""
    known = [(role, path, backing(path)[0]) for role, path in inputs if path]
    for key, path in outputs:
        if not path or path == "-":
            continue
        where = backing(path)[0]
        for role, other_path, other in known:
            if where == other:
                raise ConfigError(f"{key}: {path} is the {role} ({other_path}): an output "
                                  f"may not be an input")
        if regular:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.stat(path).st_mode):
                    raise ConfigError(f"{key}: {path} exists and is not a regular file")


def write_atomically(path: str, payload: bytes | str, mode: int | None = None) -> None:
    """PATH replaced whole in one rename by a file made with mkstemp beside it; mode
    (default: 0666 less the umask, as open() would create it) is set before the rename.
    A failure removes the temporary file and leaves PATH as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                     dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload.encode() if isinstance(payload, str) else payload)
            f.flush()
            os.fchmod(f.fileno(), _default_mode() if mode is None else mode)
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _default_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask
