"""An NBD URI, and the fixed-newstyle negotiation that makes a socket the kernel can take.

The kernel's driver speaks only the transmission phase: the client negotiates (proto.md,
"Fixed newstyle negotiation"): the server's greeting, our flags, then NBD_OPT_GO with the
export name and the infos we ask for (the export's size and flags, its description, its
block sizes). An nbd-verity server names the image it serves in its description ("root
hash HEX"), so that a reconnect never hands the kernel a server of another image.
No structured replies are asked for: the kernel reads simple replies only.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import AttachError
from . import uapi

DEFAULT_PORT = 10809
HANDSHAKE_TIMEOUT_S = 10.0  # a server that says nothing for this long is skipped
MAX_INFO_SIZE = 1 << 16  # an option reply longer than this is not a server we know
# TCP keepalive on the kernel's socket: a peer that vanished without a word (a host that
# lost power) is found dead in about IDLE + INTERVAL * COUNT seconds, then reconnected.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
_ROOT_HASH = re.compile(r"\broot hash ([0-9a-f]{16,})\b")


@dataclass(frozen=True)
class Uri:
    """Where one server is: a Unix socket path or a TCP host and port, and the export."""

    text: str
    export: str
    unix: str | None = None
    host: str | None = None
    port: int = DEFAULT_PORT

    @classmethod
    def parse(cls, text: str) -> Uri:
        """nbd://HOST[:PORT][/EXPORT], nbd+unix:///[EXPORT]?socket=PATH, or an absolute
        socket path (the default export); AttachError otherwise."""
        if text.startswith("/"):
            return cls(text=text, export="", unix=text)
        parts = urlsplit(text)
        export = unquote(parts.path[1:]) if parts.path.startswith("/") else unquote(parts.path)
        if parts.scheme in ("nbds", "nbds+unix"):
            raise AttachError(f"{text}: TLS (nbds) is not supported by attach; use nbd:// "
                              f"over a trusted link (the server verifies every byte)")
        if parts.scheme == "nbd+unix":
            sockets = parse_qs(parts.query).get("socket")
            if not sockets or not sockets[0].startswith("/"):
                raise AttachError(f"{text}: nbd+unix needs ?socket=/absolute/path")
            return cls(text=text, export=export, unix=sockets[0])
        if parts.scheme == "nbd":
            try:
                port = DEFAULT_PORT if parts.port is None else parts.port
            except ValueError:
                raise AttachError(f"{text}: bad port") from None
            if not 0 < port < 65536:
                raise AttachError(f"{text}: bad port")
            if not parts.hostname:
                raise AttachError(f"{text}: no host")
            return cls(text=text, export=export, host=parts.hostname, port=port)
        raise AttachError(f"{text}: not an NBD URI (nbd://HOST[:PORT]/EXPORT or "
                          f"nbd+unix:///EXPORT?socket=PATH)")


@dataclass
class Negotiated:
    """A socket in the transmission phase, and what the server said of its export."""

    sock: socket.socket
    size: int
    flags: int
    description: str
    block_sizes: tuple[int, int, int] | None

    @property
    def root_hash(self) -> str | None:
        """The root hash the server names in its description (an nbd-verity server)."""
        match = _ROOT_HASH.search(self.description)
        return match.group(1) if match else None

    @property
    def multi_conn(self) -> bool:
        return bool(self.flags & uapi.NBD_FLAG_CAN_MULTI_CONN)

    def close(self) -> None:
        """Leave the transmission phase politely (NBD_CMD_DISC), then close."""
        with contextlib.suppress(OSError):
            self.sock.sendall(struct.pack(">IHHQQI", uapi.NBD_REQUEST_MAGIC, 0,
                                          uapi.NBD_CMD_DISC, 0, 0, 0))
        self.sock.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AttachError("the server closed the connection during the handshake")
        data += chunk
    return data


def open_socket(uri: Uri, timeout: float) -> socket.socket:
    """A connected stream socket to the server (AttachError when it cannot be reached)."""
    try:
        if uri.unix is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(uri.unix)
            except BaseException:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((uri.host, uri.port), timeout=timeout)
    except OSError as e:
        raise AttachError(f"{uri.text}: {e.strerror or e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
    return sock


def go_request(export: str) -> bytes:
    """NBD_OPT_GO for export, asking for its size and flags, description and block sizes."""
    name = export.encode()
    infos = (uapi.NBD_INFO_EXPORT, uapi.NBD_INFO_DESCRIPTION, uapi.NBD_INFO_BLOCK_SIZE)
    data = (struct.pack(">I", len(name)) + name + struct.pack(">H", len(infos))
            + b"".join(struct.pack(">H", i) for i in infos))
    return struct.pack(">QII", uapi.IHAVEOPT, uapi.NBD_OPT_GO, len(data)) + data


def negotiate(uri: Uri, timeout: float = HANDSHAKE_TIMEOUT_S) -> Negotiated:
    """Connect and negotiate uri's export: a socket in the transmission phase (blocking,
    no timeout: the kernel owns it from here). AttachError for anything else."""
    sock = open_socket(uri, timeout)
    try:
        sock.settimeout(timeout)
        result = _negotiate(sock, uri)
        sock.settimeout(None)
        return result
    except (OSError, struct.error) as e:
        sock.close()
        raise AttachError(f"{uri.text}: handshake: {e}") from None
    except AttachError as e:
        sock.close()
        raise AttachError(f"{uri.text}: {e}") from None


def _negotiate(sock: socket.socket, uri: Uri) -> Negotiated:
    magic, opt_magic, server_flags = struct.unpack(">QQH", _recv(sock, 18))
    if magic != uapi.NBDMAGIC:
        raise AttachError("not an NBD server (no NBDMAGIC greeting)")
    if opt_magic != uapi.IHAVEOPT or not server_flags & uapi.NBD_FLAG_FIXED_NEWSTYLE:
        raise AttachError("the server does not speak fixed newstyle negotiation")
    client_flags = uapi.NBD_FLAG_C_FIXED_NEWSTYLE
    if server_flags & uapi.NBD_FLAG_NO_ZEROES:
        client_flags |= uapi.NBD_FLAG_C_NO_ZEROES
    sock.sendall(struct.pack(">I", client_flags) + go_request(uri.export))
    size = flags = None
    description = ""
    block_sizes = None
    while True:
        reply_magic, option, kind, length = struct.unpack(">QIII", _recv(sock, 20))
        if reply_magic != uapi.OPT_REPLY_MAGIC or option != uapi.NBD_OPT_GO:
            raise AttachError("malformed option reply")
        if length > MAX_INFO_SIZE:
            raise AttachError(f"option reply of {length} bytes")
        data = _recv(sock, length)
        if kind & uapi.NBD_REP_FLAG_ERROR:
            why = uapi.REP_ERRORS.get(kind, f"error {kind & ~uapi.NBD_REP_FLAG_ERROR}")
            text = data.decode(errors="replace").strip()
            raise AttachError(f"export {uri.export!r}: {why}" + (f" ({text})" if text else ""))
        if kind == uapi.NBD_REP_ACK:
            break
        if kind != uapi.NBD_REP_INFO or len(data) < 2:
            continue  # a reply we did not ask for: ignored, as proto.md allows
        info = struct.unpack_from(">H", data)[0]
        if info == uapi.NBD_INFO_EXPORT and len(data) >= 12:
            size, flags = struct.unpack_from(">QH", data, 2)
        elif info == uapi.NBD_INFO_DESCRIPTION:
            description = data[2:].decode(errors="replace")
        elif info == uapi.NBD_INFO_BLOCK_SIZE and len(data) >= 14:
            block_sizes = struct.unpack_from(">III", data, 2)
    if size is None or flags is None:
        raise AttachError("the server did not send the export's size")
    return Negotiated(sock=sock, size=size, flags=flags, description=description,
                      block_sizes=block_sizes)
