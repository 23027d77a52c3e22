"""attach's generic netlink messages, byte by byte; the real kernel's nlctrl family; URIs.

The bytes are read back twice: with genl's own decoders (split, genl_payload, iter_attrs)
and with the small walker here, written from linux/netlink.h (nlattr: u16 length, u16
type, the value, zeros to the next multiple of 4), which also sees the nested flag and
the padding that genl's decoders drop. This host's kernel has no nbd driver: the nbd
family's requests go to a peer on a socket pair that answers as the kernel does (a reply,
then the NLMSG_ERROR ack); the generic netlink controller ("nlctrl") is the real kernel's.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading

import pytest

from nbd_verity.attach import genl, uapi
from nbd_verity.attach.genl import GenlSocket, NetlinkError
from nbd_verity.attach.handshake import DEFAULT_PORT, Uri
from nbd_verity.attach.identity import Identity
from nbd_verity.attach.kernel import NbdKernel, connect_attrs
from nbd_verity.errors import AttachError

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
GENLMSGHDR = struct.Struct("=BBH")  # cmd, version, reserved
ROOT = "5e97b6c0ce4d7bdbb127f8c7c92243f27b4ba0ac26fa392574055bf771a3f368"
SIZE = 16 << 20  # 8 digits: the backend string's length is not a multiple of 4
BACKEND = Identity(ROOT, SIZE).backend
FAMILY = 0x1A  # any id: the message does not depend on it
U64 = {uapi.NBD_ATTR_SIZE_BYTES: SIZE, uapi.NBD_ATTR_BLOCK_SIZE_BYTES: 4096,
       uapi.NBD_ATTR_SERVER_FLAGS: 0x503, uapi.NBD_ATTR_CLIENT_FLAGS: 0,
       uapi.NBD_ATTR_DEAD_CONN_TIMEOUT: 60}


def walk(data: bytes) -> list[tuple[int, int, bytes]]:
    """(raw nla_type, nla_len, value) of each attribute; the padding must be zeros and
    the run must end on the last attribute's padding."""
    out, pos = [], 0
    while pos < len(data):
        assert pos + 4 <= len(data), f"{len(data) - pos} stray bytes at {pos}"
        length, kind = struct.unpack_from("=HH", data, pos)
        assert 4 <= length <= len(data) - pos, f"attribute at {pos}: nla_len {length}"
        padded = (length + 3) & ~3
        assert data[pos + length:pos + padded] == bytes(padded - length), f"padding at {pos}"
        out.append((kind, length, data[pos + 4:pos + length]))
        pos += padded
    assert pos == len(data), "the last attribute's padding runs past the message"
    return out


def header(data: bytes) -> tuple[tuple[int, int, int, int, int], tuple[int, int, int], bytes]:
    """(nlmsghdr fields, genlmsghdr fields, attributes) of one request."""
    nl = NLMSGHDR.unpack_from(data)
    gen = GENLMSGHDR.unpack_from(data, NLMSGHDR.size)
    return nl, gen, data[NLMSGHDR.size + GENLMSGHDR.size:]


def check_sockets(kind: int, value: bytes, fds: list[int]) -> None:
    """NBD_ATTR_SOCKETS (nested): one nested NBD_SOCK_ITEM per fd, each an NBD_SOCK_FD."""
    assert kind == uapi.NBD_ATTR_SOCKETS | uapi.NLA_F_NESTED
    items = walk(value)
    assert [k for k, _, _ in items] == [uapi.NBD_SOCK_ITEM | uapi.NLA_F_NESTED] * len(fds)
    for (_, length, item), fd in zip(items, fds, strict=True):
        assert length == 4 + 8
        assert walk(item) == [(uapi.NBD_SOCK_FD, 8, struct.pack("=I", fd))]
    # genl's own decoder drops the flag and finds the same fds
    assert [genl.as_u32(genl.parse_attrs(item)[uapi.NBD_SOCK_FD])
            for _, item in genl.iter_attrs(value)] == fds


# -- NBD_CMD_CONNECT ---------------------------------------------------------------------

def test_connect_message_field_by_field():
    fds = [5, 1023]
    attrs = connect_attrs(fds, SIZE, 0x503, 4096, 60, 30, BACKEND, index=3)
    data = genl.message(FAMILY, uapi.NBD_CMD_CONNECT, uapi.NBD_GENL_VERSION, attrs, seq=7)
    (length, kind, flags, seq, pid), (cmd, version, reserved), body = header(data)
    assert (length, kind, flags, seq, pid) == (
        len(data), FAMILY, uapi.NLM_F_REQUEST | uapi.NLM_F_ACK, 7, 0)
    assert (cmd, version, reserved) == (uapi.NBD_CMD_CONNECT, 1, 0)
    assert len(data) % 4 == 0
    got = walk(body)
    kinds = [k & ~uapi.NLA_F_NESTED for k, _, _ in got]
    assert kinds == [uapi.NBD_ATTR_INDEX, uapi.NBD_ATTR_SIZE_BYTES,
                     uapi.NBD_ATTR_BLOCK_SIZE_BYTES, uapi.NBD_ATTR_SERVER_FLAGS,
                     uapi.NBD_ATTR_CLIENT_FLAGS, uapi.NBD_ATTR_DEAD_CONN_TIMEOUT,
                     uapi.NBD_ATTR_BACKEND_IDENTIFIER, uapi.NBD_ATTR_TIMEOUT,
                     uapi.NBD_ATTR_SOCKETS]
    values = {k & ~uapi.NLA_F_NESTED: (k, n, v) for k, n, v in got}
    assert values[uapi.NBD_ATTR_INDEX] == (uapi.NBD_ATTR_INDEX, 8, struct.pack("=I", 3))
    for kind, number in {**U64, uapi.NBD_ATTR_TIMEOUT: 30}.items():
        assert values[kind] == (kind, 12, struct.pack("=Q", number)), kind
    kind, length, value = values[uapi.NBD_ATTR_BACKEND_IDENTIFIER]
    assert kind == uapi.NBD_ATTR_BACKEND_IDENTIFIER  # no nested flag on a string
    assert value == BACKEND.encode() + b"\0" and length == 4 + len(BACKEND) + 1
    assert length % 4 != 0  # the padding walk() checked was really there
    check_sockets(*values[uapi.NBD_ATTR_SOCKETS][::2], fds)
    # and genl's own decoders read the same message back
    [(got_kind, got_seq, payload)] = list(genl.split(data))
    assert (got_kind, got_seq) == (FAMILY, 7)
    got_cmd, parsed = genl.genl_payload(payload)
    assert got_cmd == uapi.NBD_CMD_CONNECT
    assert genl.as_u32(parsed[uapi.NBD_ATTR_INDEX]) == 3
    assert {k: struct.unpack("=Q", parsed[k])[0] for k in U64} == U64
    assert parsed[uapi.NBD_ATTR_BACKEND_IDENTIFIER].rstrip(b"\0").decode() == BACKEND


def test_connect_without_index_or_timeout_leaves_both_out():
    """Any free device (no NBD_ATTR_INDEX) and no kernel request timeout (timeout_s 0:
    no NBD_ATTR_TIMEOUT at all, not a zero)."""
    attrs = connect_attrs([9], SIZE, 0x503, 4096, 60, 0, BACKEND, index=None)
    kinds = [k & ~uapi.NLA_F_NESTED for k, _, _ in walk(attrs)]
    assert uapi.NBD_ATTR_INDEX not in kinds and uapi.NBD_ATTR_TIMEOUT not in kinds
    assert kinds[-1] == uapi.NBD_ATTR_SOCKETS and len(kinds) == 7
    assert connect_attrs([9], SIZE, 0x503, 4096, 60, 0, BACKEND, index=0).startswith(
        genl.u32(uapi.NBD_ATTR_INDEX, 0))  # device 0 is an index, not "none"


def test_u64_values_keep_all_64_bits():
    big = (1 << 63) + 12345
    [(kind, length, value)] = walk(genl.u64(uapi.NBD_ATTR_SIZE_BYTES, big))
    assert (kind, length, struct.unpack("=Q", value)[0]) == (uapi.NBD_ATTR_SIZE_BYTES, 12, big)


@pytest.mark.parametrize("text", ["", "x", "ab", "abc", "abcd"])
def test_strings_are_nul_terminated_and_padded(text):
    raw = genl.string(uapi.NBD_ATTR_BACKEND_IDENTIFIER, text)
    assert len(raw) % 4 == 0
    [(_, length, value)] = walk(raw)
    assert value == text.encode() + b"\0" and length == 4 + len(text) + 1


def test_a_malformed_attribute_is_refused():
    raw = genl.u32(uapi.NBD_ATTR_INDEX, 1)
    bad = struct.pack("=HH", 40, uapi.NBD_ATTR_INDEX) + raw[4:]  # says 40, has 8
    with pytest.raises(NetlinkError, match="malformed attribute at byte 0"):
        list(genl.iter_attrs(bad))
    with pytest.raises(NetlinkError, match="malformed message"):
        list(genl.split(struct.pack("=IHHII", 99, FAMILY, 0, 1, 0)))


def test_two_messages_in_one_datagram_split_apart():
    one = genl.message(FAMILY, uapi.NBD_CMD_STATUS, 1, b"", seq=1)
    two = genl.message(FAMILY, uapi.NBD_CMD_CONNECT, 1, genl.string(10, "abcde"), seq=2)
    got = list(genl.split(one + two))
    assert [(k, s) for k, s, _ in got] == [(FAMILY, 1), (FAMILY, 2)]
    assert genl.genl_payload(got[1][2]) == (uapi.NBD_CMD_CONNECT, {10: b"abcde\0"})


# -- the nbd family's requests, answered by a peer as the kernel answers --------------------

class KernelPeer:
    """The other end of a datagram socket pair: records each request and answers it as
    the kernel does (the given reply messages, then NLMSG_ERROR with code)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.requests: list[bytes] = []

    def answer(self, code: int = 0, replies: tuple[bytes, ...] = (),
               stale_first: bool = False) -> threading.Thread:
        def run() -> None:
            request = self.sock.recv(1 << 16)
            self.requests.append(request)
            _len, family, _flags, seq, _pid = NLMSGHDR.unpack_from(request)
            if stale_first:  # an answer to an older request: must be skipped
                self.sock.send(ack(seq + 100, -errno.EIO, request))
            for attrs in replies:
                body = GENLMSGHDR.pack(request[16], 1, 0) + attrs
                self.sock.send(NLMSGHDR.pack(16 + len(body), family, 0, seq, 0) + body)
            self.sock.send(ack(seq, code, request))
        thread = threading.Thread(target=run)
        thread.start()
        return thread


def ack(seq: int, code: int, request: bytes) -> bytes:
    body = struct.pack("=i", code) + request[:NLMSGHDR.size]  # the kernel echoes the header
    return NLMSGHDR.pack(16 + len(body), uapi.NLMSG_ERROR, 0, seq, 0) + body


@pytest.fixture
def nbd_kernel():
    """An NbdKernel whose requests socket is one end of a socket pair: its family is
    not resolved (this kernel has none), the rest is the class as it runs."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    requests = GenlSocket()
    requests.sock.close()
    requests.sock = ours
    k = NbdKernel.__new__(NbdKernel)
    k._requests, k._events, k.family, k.group = requests, None, FAMILY, 5
    yield k, KernelPeer(theirs)
    k.close()
    theirs.close()


def test_reconfigure_message_field_by_field(nbd_kernel):
    k, peer = nbd_kernel
    thread = peer.answer(stale_first=True)
    k.reconfigure(4, [7, 8, 9], BACKEND)
    thread.join(5)
    [data] = peer.requests
    (length, kind, flags, _seq, _pid), (cmd, version, _), body = header(data)
    assert (length, kind, flags) == (len(data), FAMILY, uapi.NLM_F_REQUEST | uapi.NLM_F_ACK)
    assert (cmd, version) == (uapi.NBD_CMD_RECONFIGURE, uapi.NBD_GENL_VERSION)
    index, backend, sockets = walk(body)
    assert index == (uapi.NBD_ATTR_INDEX, 8, struct.pack("=I", 4))
    assert backend == (uapi.NBD_ATTR_BACKEND_IDENTIFIER, 4 + len(BACKEND) + 1,
                       BACKEND.encode() + b"\0")
    check_sockets(sockets[0], sockets[2], [7, 8, 9])


def test_connect_returns_the_index_the_kernel_chose(nbd_kernel):
    k, peer = nbd_kernel
    thread = peer.answer(replies=(genl.u32(uapi.NBD_ATTR_INDEX, 12),))
    assert k.connect([3], SIZE, 0x503, 4096, 60, 0, BACKEND) == 12
    thread.join(5)
    _, (cmd, _, _), body = header(peer.requests[0])
    assert cmd == uapi.NBD_CMD_CONNECT
    assert body == connect_attrs([3], SIZE, 0x503, 4096, 60, 0, BACKEND, None)


def test_a_refusal_carries_its_errno_and_names_the_device(nbd_kernel):
    k, peer = nbd_kernel
    thread = peer.answer(code=-errno.EBUSY)
    with pytest.raises(NetlinkError) as caught:
        k.disconnect(2)
    thread.join(5)
    assert caught.value.errno == errno.EBUSY
    assert str(caught.value) == "disconnect /dev/nbd2: Device or resource busy"
    assert isinstance(caught.value, AttachError)


def test_status_reads_the_nested_device_list(nbd_kernel):
    k, peer = nbd_kernel
    devices = genl.nested(uapi.NBD_ATTR_DEVICE_LIST, *(
        genl.nested(uapi.NBD_DEVICE_ITEM, genl.u32(uapi.NBD_DEVICE_INDEX, i),
                    genl.attr(uapi.NBD_DEVICE_CONNECTED, bytes([up])))
        for i, up in ((0, 1), (1, 0), (15, 1))))
    thread = peer.answer(replies=(devices,))
    assert k.status() == {0: True, 1: False, 15: True}
    thread.join(5)


# -- the real kernel's generic netlink controller --------------------------------------------

def test_resolve_nlctrl_on_the_real_kernel():
    with GenlSocket() as sock:
        family, groups = genl.resolve_family(sock, "nlctrl")
    assert family == 16 == uapi.GENL_ID_CTRL
    assert "notify" in groups and groups["notify"] > 0


def test_the_kernel_has_no_nbd_family_here():
    """This host's kernel has no nbd driver (and no modules to load): ENOENT, by name."""
    with GenlSocket() as sock, pytest.raises(NetlinkError) as caught:
        genl.resolve_family(sock, uapi.NBD_GENL_FAMILY_NAME)
    assert caught.value.errno == errno.ENOENT
    assert "'nbd'" in str(caught.value)


def test_the_real_kernel_refuses_an_unknown_command_with_its_errno():
    with GenlSocket() as sock, pytest.raises(NetlinkError) as caught:
        sock.request(uapi.GENL_ID_CTRL, 200, 1, what="nlctrl command 200")
    assert caught.value.errno == errno.EOPNOTSUPP, caught.value
    assert str(caught.value).startswith("nlctrl command 200: ")


def test_a_second_request_on_one_socket_gets_its_own_answer():
    with GenlSocket() as sock:
        first = genl.resolve_family(sock, "nlctrl")
        assert genl.resolve_family(sock, "nlctrl") == first


def test_events_of_a_joined_group_time_out_empty():
    with GenlSocket() as sock:
        _, groups = genl.resolve_family(sock, "nlctrl")
    with GenlSocket() as events:
        events.join(groups["notify"])
        assert events.events(timeout=0.05) == []


# -- URIs -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "export", "unix", "host", "port"), [
    ("nbd://host", "", None, "host", DEFAULT_PORT),
    ("nbd://host/", "", None, "host", DEFAULT_PORT),
    ("nbd://host:1234/exp", "exp", None, "host", 1234),
    ("nbd://10.0.2.2:10811/a%20b", "a b", None, "10.0.2.2", 10811),
    ("nbd://[::1]:99/x", "x", None, "::1", 99),
    ("nbd+unix:///exp?socket=/p", "exp", "/p", None, DEFAULT_PORT),
    ("nbd+unix:///?socket=/run/a%20b.sock", "", "/run/a b.sock", None, DEFAULT_PORT),
    ("/path", "", "/path", None, DEFAULT_PORT),
])
def test_uri_parse(text, export, unix, host, port):
    assert Uri.parse(text) == Uri(text=text, export=export, unix=unix, host=host, port=port)


@pytest.mark.parametrize(("text", "why"), [
    ("nbds://host/exp", "TLS (nbds) is not supported"),
    ("nbds+unix:///exp?socket=/p", "TLS (nbds) is not supported"),
    ("nbd+unix:///exp", "nbd+unix needs ?socket=/absolute/path"),
    ("nbd+unix:///exp?socket=relative.sock", "nbd+unix needs ?socket=/absolute/path"),
    ("nbd://host:port/exp", "bad port"),
    ("nbd://host:70000/exp", "bad port"),
    ("nbd://host:0/exp", "bad port"),
    ("nbd:///exp", "no host"),
    ("garbage", "not an NBD URI"),
    ("relative/path.sock", "not an NBD URI"),
    ("http://host/exp", "not an NBD URI"),
    ("", "not an NBD URI"),
])
def test_uri_refused_in_one_line(text, why):
    with pytest.raises(AttachError) as caught:
        Uri.parse(text)
    message = str(caught.value)
    assert message.startswith(f"{text}: ") and why in message, message
    assert "\n" not in message


def test_no_nbd_driver_is_one_attach_error_even_without_modprobe():
    """This host's kernel has no nbd family (and may have no modprobe): AttachError."""
    from nbd_verity.attach.kernel import NbdKernel
    from nbd_verity.errors import AttachError
    with pytest.raises(AttachError, match="the kernel has no nbd driver"):
        NbdKernel()
