"""The kernel's nbd netlink family: connect, reconfigure, disconnect, status, LINK_DEAD.

The messages mirror what Ceph's rbd-nbd sends (netlink_connect, netlink_disconnect) and
the kernel's nbd_genl_* functions read. The device's own state beside them is in sysfs:
/sys/block/nbdN/pid exists while it is connected, /backend holds the identifier given at
connect (kernel 5.7 on), /size its size in 512-byte sectors, /queue/io_timeout the block
layer's request timer in ms. Everything here needs CAP_SYS_ADMIN, as the kernel checks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import subprocess
from pathlib import Path

from ..errors import AttachError
from . import genl, uapi
from .genl import GenlSocket, NetlinkError

NBD_MAJOR = 43
SYS_BLOCK = Path("/sys/block")


def family(sock: GenlSocket) -> tuple[int, int]:
    """(family id, multicast group id) of the kernel's nbd family; loads the nbd module
    once (modprobe, as systemd's modprobe@nbd) when the kernel does not know it yet."""
    try:
        fam, groups = genl.resolve_family(sock, uapi.NBD_GENL_FAMILY_NAME)
    except NetlinkError as e:
        if e.errno != errno.ENOENT:
            raise
        # no modprobe (no kmod): the lookup below says what is missing
        with contextlib.suppress(OSError):
            subprocess.run(["modprobe", "nbd"], capture_output=True)
        try:
            fam, groups = genl.resolve_family(sock, uapi.NBD_GENL_FAMILY_NAME)
        except NetlinkError:
            raise AttachError("the kernel has no nbd driver (modprobe nbd failed)") from None
    if uapi.NBD_GENL_MCAST_GROUP_NAME not in groups:
        raise AttachError("the kernel's nbd family has no multicast group "
                          f"{uapi.NBD_GENL_MCAST_GROUP_NAME!r}")
    return fam, groups[uapi.NBD_GENL_MCAST_GROUP_NAME]


def _sockets(fds: list[int]) -> bytes:
    return genl.nested(uapi.NBD_ATTR_SOCKETS, *(
        genl.nested(uapi.NBD_SOCK_ITEM, genl.u32(uapi.NBD_SOCK_FD, fd)) for fd in fds))


def connect_attrs(fds: list[int], size: int, server_flags: int, block_size: int,
                  dead_timeout_s: int, timeout_s: int, backend: str,
                  index: int | None) -> bytes:
    """The attributes of NBD_CMD_CONNECT (no NBD_ATTR_TIMEOUT when timeout_s is 0: the
    kernel then never cuts a slow link, and only resends what a replaced link held)."""
    attrs = [] if index is None else [genl.u32(uapi.NBD_ATTR_INDEX, index)]
    attrs += [genl.u64(uapi.NBD_ATTR_SIZE_BYTES, size),
              genl.u64(uapi.NBD_ATTR_BLOCK_SIZE_BYTES, block_size),
              genl.u64(uapi.NBD_ATTR_SERVER_FLAGS, server_flags),
              genl.u64(uapi.NBD_ATTR_CLIENT_FLAGS, 0),  # the device outlives this process
              genl.u64(uapi.NBD_ATTR_DEAD_CONN_TIMEOUT, dead_timeout_s),
              genl.string(uapi.NBD_ATTR_BACKEND_IDENTIFIER, backend)]
    if timeout_s:
        attrs.append(genl.u64(uapi.NBD_ATTR_TIMEOUT, timeout_s))
    return b"".join(attrs) + _sockets(fds)


class NbdKernel:
    """The nbd family's requests on one netlink socket, and its events on another."""

    def __init__(self) -> None:
        self._requests = GenlSocket()
        self._events: GenlSocket | None = None
        try:
            self.family, self.group = family(self._requests)
        except BaseException:
            self._requests.close()
            raise

    def close(self) -> None:
        self._requests.close()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> NbdKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, cmd: int, attrs: bytes, what: str) -> list[dict[int, bytes]]:
        return self._requests.request(self.family, cmd, uapi.NBD_GENL_VERSION, attrs, what)

    def subscribe(self) -> None:
        """Receive LINK_DEAD from now on (before connecting: none is missed)."""
        if self._events is None:
            self._events = GenlSocket()
            self._events.join(self.group)

    def link_dead(self, timeout: float | None) -> list[int]:
        """Indexes of the devices whose link died, received within timeout seconds."""
        assert self._events is not None, "subscribe() first"
        return [genl.as_u32(attrs[uapi.NBD_ATTR_INDEX])
                for cmd, attrs in self._events.events(timeout)
                if cmd == uapi.NBD_CMD_LINK_DEAD and uapi.NBD_ATTR_INDEX in attrs]

    def connect(self, fds: list[int], size: int, server_flags: int, block_size: int,
                dead_timeout_s: int, timeout_s: int, backend: str,
                index: int | None = None) -> int:
        """Connect a device (index, or any free one) to the negotiated sockets: its index."""
        where = f"/dev/nbd{index}" if index is not None else "a free nbd device"
        replies = self._request(uapi.NBD_CMD_CONNECT, connect_attrs(
            fds, size, server_flags, block_size, dead_timeout_s, timeout_s, backend, index),
            f"connect {where}")
        for reply in replies:
            if uapi.NBD_ATTR_INDEX in reply:
                return genl.as_u32(reply[uapi.NBD_ATTR_INDEX])
        if index is None:
            raise AttachError("connect: the kernel did not say which device it connected")
        return index

    def reconfigure(self, index: int, fds: list[int], backend: str,
                    timeout_s: int | None = None) -> None:
        """Hand the device new sockets for dead links (and/or a new request timeout). The
        kernel takes one socket per dead link and drops (with success) any socket for which
        no link is dead; it refuses the request unless backend is the identifier the device
        was connected with. A timeout of 0 also sets the queue's timer back to 30 s."""
        attrs = (genl.u32(uapi.NBD_ATTR_INDEX, index)
                 + genl.string(uapi.NBD_ATTR_BACKEND_IDENTIFIER, backend))
        if timeout_s is not None:
            attrs += genl.u64(uapi.NBD_ATTR_TIMEOUT, timeout_s)
        if fds:
            attrs += _sockets(fds)
        self._request(uapi.NBD_CMD_RECONFIGURE, attrs, f"reconfigure /dev/nbd{index}")

    def disconnect(self, index: int) -> None:
        self._request(uapi.NBD_CMD_DISCONNECT, genl.u32(uapi.NBD_ATTR_INDEX, index),
                      f"disconnect /dev/nbd{index}")

    def status(self) -> dict[int, bool]:
        """{index: connected} of every nbd device the kernel has."""
        out: dict[int, bool] = {}
        for reply in self._request(uapi.NBD_CMD_STATUS, b"", "status"):
            for _item, device in genl.iter_attrs(reply.get(uapi.NBD_ATTR_DEVICE_LIST, b"")):
                fields = genl.parse_attrs(device)
                if uapi.NBD_DEVICE_INDEX in fields:
                    out[genl.as_u32(fields[uapi.NBD_DEVICE_INDEX])] = bool(
                        fields.get(uapi.NBD_DEVICE_CONNECTED, b"\0")[0])
        return out


# -- the device in /dev and /sys ------------------------------------------------------

def device_index(device: str) -> int:
    """N of /dev/nbdN (or nbdN); AttachError for anything else."""
    match = re.fullmatch(r"(?:/dev/)?nbd(\d+)", device)
    if not match:
        raise AttachError(f"{device}: not an nbd device (/dev/nbdN)")
    index = int(match.group(1))
    path = f"/dev/nbd{index}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise AttachError(f"{path}: no such device (is the nbd module loaded? "
                          f"modprobe nbd)") from None
    if not stat.S_ISBLK(st.st_mode) or os.major(st.st_rdev) != NBD_MAJOR:
        raise AttachError(f"{path}: not an nbd block device")
    return index


def _sys(index: int, name: str) -> Path:
    return SYS_BLOCK / f"nbd{index}" / name


def connected(index: int) -> bool:
    """Whether the device has a connection set up (its pid file exists while it does)."""
    return _sys(index, "pid").exists()


def backend(index: int) -> str | None:
    """The backend identifier given at connect, None if there is none."""
    try:
        return _sys(index, "backend").read_text().strip() or None
    except OSError:
        return None


def size_bytes(index: int) -> int:
    try:
        return int(_sys(index, "size").read_text()) * 512
    except (OSError, ValueError):
        return 0


def set_io_timer(index: int, ms: int) -> None:
    """The block layer's request timer (queue/io_timeout): how often a request in flight is
    looked at again; what the kernel then does is in docs/attach.md."""
    _sys(index, "queue/io_timeout").write_text(str(ms))


def devices() -> list[int]:
    """Indexes of the nbd devices in /sys/block, in order."""
    return sorted(int(p.name[3:]) for p in SYS_BLOCK.glob("nbd*") if p.name[3:].isdigit())
