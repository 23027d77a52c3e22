"""Generic netlink over Python's own AF_NETLINK socket: messages, attributes, a family.

A message is nlmsghdr (16 bytes), genlmsghdr (4) and attributes (nla_len, nla_type, the
value padded to 4 bytes). Every request asks for an ack; the kernel's answer to a request
is any reply messages, then NLMSG_ERROR whose code is 0 (done) or -errno (refused).
Nothing here knows the nbd family: kernel.py builds its messages from these parts.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator

from ..errors import AttachError
from . import uapi

_NLMSGHDR = struct.Struct("=IHHII")
_GENLHDR = struct.Struct("=BBH")
_NLA = struct.Struct("=HH")
RECV_SIZE = 1 << 16


class NetlinkError(AttachError):
    """The kernel refused a request (errno set), or answered something unreadable."""

    def __init__(self, message: str, errnum: int = 0) -> None:
        super().__init__(message)
        self.errno = errnum


def _pad(n: int) -> int:
    return (n + 3) & ~3


# -- attributes -----------------------------------------------------------------------

def attr(kind: int, value: bytes) -> bytes:
    """One attribute, padded."""
    raw = _NLA.pack(_NLA.size + len(value), kind) + value
    return raw + b"\0" * (_pad(len(raw)) - len(raw))


def u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def u64(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=Q", value))


def string(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def nested(kind: int, *children: bytes) -> bytes:
    return attr(kind | uapi.NLA_F_NESTED, b"".join(children))


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """{type: value} of a run of attributes (the nested flag dropped; the last one wins)."""
    out: dict[int, bytes] = {}
    for kind, value in iter_attrs(data):
        out[kind] = value
    return out


def iter_attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    while pos + _NLA.size <= len(data):
        length, kind = _NLA.unpack_from(data, pos)
        if length < _NLA.size or pos + length > len(data):
            raise NetlinkError(f"netlink: malformed attribute at byte {pos}")
        yield kind & 0x3FFF, data[pos + _NLA.size:pos + length]
        pos += _pad(length)


def as_u32(value: bytes) -> int:
    return struct.unpack_from("=I", value)[0]


def as_u16(value: bytes) -> int:
    return struct.unpack_from("=H", value)[0]


# -- messages -------------------------------------------------------------------------

def message(family: int, cmd: int, version: int, attrs: bytes, seq: int,
            flags: int = uapi.NLM_F_REQUEST | uapi.NLM_F_ACK) -> bytes:
    """One generic netlink request."""
    body = _GENLHDR.pack(cmd, version, 0) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, flags, seq, 0) + body


def split(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(type, seq, payload) of each message in one datagram."""
    pos = 0
    while pos + _NLMSGHDR.size <= len(data):
        length, kind, _flags, seq, _pid = _NLMSGHDR.unpack_from(data, pos)
        if length < _NLMSGHDR.size or pos + length > len(data):
            raise NetlinkError("netlink: malformed message")
        yield kind, seq, data[pos + _NLMSGHDR.size:pos + length]
        pos += _pad(length)


def genl_payload(payload: bytes) -> tuple[int, dict[int, bytes]]:
    """(cmd, attributes) of a generic netlink message's payload."""
    if len(payload) < _GENLHDR.size:
        raise NetlinkError("netlink: message shorter than its generic header")
    cmd, _version, _ = _GENLHDR.unpack_from(payload)
    return cmd, parse_attrs(payload[_GENLHDR.size:])


class GenlSocket:
    """One NETLINK_GENERIC socket: requests with acks, or (joined to a group) events."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, uapi.NETLINK_GENERIC)
        self.sock.bind((0, 0))
        self._seq = 0
        self._lock = threading.Lock()  # one request at a time on this socket

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> GenlSocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, family: int, cmd: int, version: int, attrs: bytes = b"",
                what: str = "netlink request") -> list[dict[int, bytes]]:
        """Send one request; the attributes of each reply message, once the kernel acks.
        NetlinkError (with errno) when the kernel refuses it."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self.sock.send(message(family, cmd, version, attrs, seq))
            replies: list[dict[int, bytes]] = []
            while True:
                data = self.sock.recv(RECV_SIZE)
                for kind, got_seq, payload in split(data):
                    if got_seq != seq:
                        continue  # an event or a stale answer: not ours
                    if kind == uapi.NLMSG_ERROR:
                        code = struct.unpack_from("=i", payload)[0]
                        if code:
                            raise NetlinkError(f"{what}: {os.strerror(-code)}", -code)
                        return replies
                    if kind == uapi.NLMSG_DONE:
                        return replies
                    replies.append(genl_payload(payload)[1])

    def join(self, group: int) -> None:
        """Receive the multicast group's events on this socket."""
        self.sock.setsockopt(uapi.SOL_NETLINK, uapi.NETLINK_ADD_MEMBERSHIP, group)

    def events(self, timeout: float | None) -> list[tuple[int, dict[int, bytes]]]:
        """(cmd, attributes) of the events received within timeout seconds (maybe none)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(RECV_SIZE)
        except TimeoutError:
            return []
        finally:
            self.sock.settimeout(None)
        return [genl_payload(payload) for kind, _seq, payload in split(data)
                if kind not in (uapi.NLMSG_ERROR, uapi.NLMSG_DONE)]


def resolve_family(sock: GenlSocket, name: str) -> tuple[int, dict[str, int]]:
    """(family id, {multicast group name: id}) of a generic netlink family.
    NetlinkError with errno ENOENT when the kernel has no such family (module not loaded)."""
    replies = sock.request(uapi.GENL_ID_CTRL, uapi.CTRL_CMD_GETFAMILY, 1,
                           string(uapi.CTRL_ATTR_FAMILY_NAME, name),
                           what=f"generic netlink family {name!r}")
    if not replies or uapi.CTRL_ATTR_FAMILY_ID not in replies[0]:
        raise NetlinkError(f"generic netlink family {name!r}: no id in the kernel's answer")
    reply = replies[0]
    groups: dict[str, int] = {}
    for _index, group in iter_attrs(reply.get(uapi.CTRL_ATTR_MCAST_GROUPS, b"")):
        fields = parse_attrs(group)
        if uapi.CTRL_ATTR_MCAST_GRP_NAME in fields and uapi.CTRL_ATTR_MCAST_GRP_ID in fields:
            groups[fields[uapi.CTRL_ATTR_MCAST_GRP_NAME].rstrip(b"\0").decode()] = \
                as_u32(fields[uapi.CTRL_ATTR_MCAST_GRP_ID])
    return as_u16(reply[uapi.CTRL_ATTR_FAMILY_ID]), groups
