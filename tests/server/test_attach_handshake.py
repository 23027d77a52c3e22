"""attach's half of the NBD handshake against real servers: `nbd-verity serve` (one image
and --exports), a plain `nbdkit file`, and `ctl stop` as a connected client sees it.

negotiate() must hand back a socket in the transmission phase (a raw NBD read on it gets
the image's bytes) with what the server said: size, flags, block sizes and the root hash
in its description; Identity.refuses() must turn away every server that is not the
device's image. `ctl stop` must end a reading client's connection between two requests
(never with an NBD error reply), report it drained, and let the server exit by itself.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time

import nbd
import pytest

from nbd_verity.attach import uapi
from nbd_verity.attach.handshake import Uri, negotiate
from nbd_verity.attach.identity import Identity
from nbd_verity.errors import AttachError
from nbd_verity.launch import run_to_end
from nbd_verity.limits import MAX_REQUEST_SIZE

from .serverlib import (
    NBD_VERITY,
    NBDKIT,
    Server,
    error_number,
    make_image,
    raw_read_reply,
    raw_read_request,
    wait_for,
)

# How a libnbd read sees a connection the server ended (a send into a closed socket, or
# the end read where a reply was due); an NBD error reply (ESHUTDOWN, EIO) is not one.
CONNECTION_ENDED = {errno.ENOTCONN, errno.EPIPE, errno.ECONNRESET}
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def other_tree(default_image, images_dir):
    """default_image's bytes under another tree (another salt): another root hash."""
    return make_image(images_dir / "attach-other-salt", default_image.expected(),
                      "--salt=" + "cd" * 32)


def serve(servers, image, *args: str) -> Server:
    return servers.serve_cli([str(image.data), str(image.hash), image.root, *args])


@pytest.fixture
def plain_nbdkit(sockdir, tmp_path, default_image):
    """`nbdkit file` of default_image's data: the same bytes, nothing verified."""
    sock, pid = os.path.join(sockdir, "plain.sock"), os.path.join(sockdir, "plain.pid")
    server = Server([NBDKIT, "-f", "-r", "--exit-with-parent", "-U", sock, "-P", pid, "file",
                     str(default_image.data)], sock, pid, tmp_path / "plain.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def negotiated():
    """negotiate(), its sockets closed (NBD_CMD_DISC) when the test ends."""
    links = []

    def go(uri: str):
        link = negotiate(Uri.parse(uri))
        links.append(link)
        return link

    yield go
    for link in links:
        link.close()


@pytest.mark.parametrize("which", ["default_image", "small_block_image"])
def test_negotiate_reports_the_export_and_leaves_a_transmission_socket(
        request, servers, negotiated, which):
    image = request.getfixturevalue(which)
    server = serve(servers, image)
    link = negotiated(server.uri)
    assert link.size == image.size
    for flag in (uapi.NBD_FLAG_HAS_FLAGS, uapi.NBD_FLAG_READ_ONLY,
                 uapi.NBD_FLAG_CAN_MULTI_CONN):
        assert link.flags & flag, f"flags {link.flags:#x} lack {flag:#x}"
    assert link.multi_conn
    assert link.block_sizes == (1, image.data_block_size, MAX_REQUEST_SIZE)
    assert link.root_hash == image.root, link.description
    assert Identity(image.root, image.size).refuses(link) is None
    # blocking, as the kernel takes it, and already in the transmission phase
    assert link.sock.gettimeout() is None
    link.sock.settimeout(10)  # only so that a broken server fails this test, not hangs it
    offset = image.size - image.data_block_size
    raw_read_request(link.sock, 0x51, offset, image.data_block_size)
    assert raw_read_reply(link.sock, 0x51, image.data_block_size) == (
        0, image.expected(offset, image.data_block_size))


def test_a_server_of_another_tree_is_refused(servers, negotiated, default_image, other_tree):
    link = negotiated(serve(servers, other_tree).uri)
    assert link.size == default_image.size and link.root_hash == other_tree.root
    why = Identity(default_image.root, default_image.size).refuses(link)
    assert why == f"it serves another image (root hash {other_tree.root[:16]}...)"


def test_a_plain_nbdkit_of_the_same_bytes_is_refused(plain_nbdkit, negotiated, default_image):
    link = negotiated(f"nbd+unix:///?socket={plain_nbdkit.socket}")
    assert link.size == default_image.size and link.root_hash is None
    why = Identity(default_image.root, default_image.size).refuses(link)
    assert why == "it names no root hash (not an nbd-verity server)"


def test_a_server_of_another_size_is_refused(servers, negotiated, default_image):
    link = negotiated(serve(servers, default_image).uri)
    why = Identity(default_image.root, default_image.size + 4096).refuses(link)
    assert why == (f"its export has {default_image.size} bytes, the device "
                   f"{default_image.size + 4096}")


def test_an_unknown_export_is_named_in_the_error(servers, negotiated, tmp_path,
                                                 default_image):
    directory = tmp_path / "exports"
    directory.mkdir()
    (directory / "one.conf").write_text(f"DATA={default_image.data}\nHASH={default_image.hash}"
                                        f"\nROOT_HASH={default_image.root}\n")
    server = servers.serve_cli(["--exports", str(directory)])
    assert negotiated(f"nbd+unix:///one?socket={server.socket}").root_hash == \
        default_image.root
    uri = f"nbd+unix:///nope?socket={server.socket}"
    with pytest.raises(AttachError) as caught:
        negotiate(Uri.parse(uri))
    assert str(caught.value).startswith(f"{uri}: export 'nope': no such export"), caught.value
    assert "\n" not in str(caught.value)


def test_an_unreachable_server_is_named_in_the_error(sockdir):
    path = os.path.join(sockdir, "nobody.sock")
    with pytest.raises(AttachError, match=f"^{re.escape(path)}: No such file or directory$"):
        negotiate(Uri.parse(path))


def test_close_sends_nbd_cmd_disc(servers, default_image):
    """nbdkit -v names how each connection ended: NBD_CMD_DISC after close(), the bare
    end of the socket otherwise (which shows the log can tell them apart)."""
    server = serve(servers, default_image, "--verbose")
    negotiate(Uri.parse(server.uri)).close()
    wait_for(lambda: "client sent NBD_CMD_DISC, closing connection" in server.log(),
             "the server to log NBD_CMD_DISC", timeout=10)
    rude = negotiate(Uri.parse(server.uri))
    rude.sock.close()
    wait_for(lambda: "client closed input socket" in server.log(),
             "the server to log the bare close", timeout=10)
    log = server.log()
    assert log.count("client sent NBD_CMD_DISC") == 1, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert not errors and "Traceback" not in log, errors


def test_ctl_stop_ends_a_reading_client_between_requests(servers, sockdir, default_image):
    control = os.path.join(sockdir, "ctl.sock")
    server = serve(servers, default_image, "--control", control)
    h = server.connect()
    expected = default_image.expected()
    seen = {"ok": 0, "wrong": [], "ended": None}

    def reader() -> None:
        while True:
            for offset in range(0, len(expected), CHUNK):
                try:
                    got = h.pread(CHUNK, offset)
                except nbd.Error as e:
                    seen["ended"] = e
                    return
                if got != expected[offset:offset + CHUNK]:
                    seen["wrong"].append(offset)
                seen["ok"] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_for(lambda: seen["ok"] >= 20 or not thread.is_alive(), "reads before the stop",
                 timeout=10)
        assert seen["ended"] is None, f"a read failed before the stop: {seen['ended']}"
        stop = run_to_end([NBD_VERITY, "ctl", "--control", control, "stop", "--json"], 20)
        began = time.monotonic()
    finally:
        thread.join(10)
    assert stop.returncode == 0, stop.stderr
    reply = json.loads(stop.stdout)
    assert reply["ok"] and reply["drained"] >= 1 and reply["cut"] == 0, reply
    assert not thread.is_alive(), "the reader's connection did not end"
    ended = seen["ended"]
    assert ended is not None
    number = error_number(ended)
    assert number not in (errno.ESHUTDOWN, errno.EIO), f"an NBD error reply: {ended}"
    assert number in CONNECTION_ENDED or "disconnected" in str(ended), ended
    assert seen["ok"] >= 20 and not seen["wrong"], seen
    status = server.wait(timeout=max(0.1, 5 - (time.monotonic() - began)))
    assert status == 0, f"the server exited with {status}:\n{server.log()}"
    # a reader always has a request coming: its connection is shut behind a reply
    assert reply["behind_reply"] == 1, reply
    assert "stop: 1 connection(s) drained (1 behind a reply), 0 cut" in server.log()
