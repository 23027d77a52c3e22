"""Hasher.nbd_read_verify (nbd_verity/format/_native.c): a read over NBD, its wait and its
check in one call, against a real nbdkit upstream and the hasher's own verify().

The bytes land in the caller's buffer as the upstream holds them; the verdict is
verify()'s on those bytes (-1, or the first block whose slot differs), from any slot
offset of a leaf; a reply later than the slice leaves the read in flight (its cookie),
for the caller to wait for with the nbd module; a read libnbd refuses or the server
fails comes back as (errno, message), and the connection stays usable; a connection
whose read is still in flight after a failed wait is closed, never kept.
"""

from __future__ import annotations

import errno
import random

import nbd
import pytest

from nbd_verity.errors import ImageIOError
from nbd_verity.format import digest
from nbd_verity.format.digest import Digester, native_nbd_ready
from nbd_verity.sources.remote import NbdSource

from ...conftest import write_image
from ..upstreams import NbdkitFile

pytestmark = pytest.mark.skipif(digest._native is None, reason="the native engine is not "
                                "built, or NBD_VERITY_PURE=1 forces the pure one")
BLOCK = 4096
SIZE = 64 * BLOCK


@pytest.fixture
def image(tmp_path):
    return write_image(tmp_path / "data.img", SIZE, seed=51)


@pytest.fixture
def hasher():
    native = Digester("sha256", bytes(range(32)), 1).native
    assert native is not None and native_nbd_ready()
    return native


def connected(upstream) -> nbd.NBD:
    h = nbd.NBD()
    h.set_pread_initialize(False)
    h.connect_uri(upstream.uri)
    return h


@pytest.mark.parametrize("blocks,first,slot_index", [(1, 0, 0), (1, 9, 9), (8, 16, 0),
                                                     (32, 32, 3), (64, 0, 0)])
def test_reads_the_upstreams_bytes_and_verifies_them_as_verify_does(
        image, hasher, sockdir, upstreams, blocks, first, slot_index):
    upstream = NbdkitFile(image, sockdir, "native-data").start()
    upstreams.append(upstream)
    h = connected(upstream)
    held = image.read_bytes()
    offset = first * BLOCK
    expected = held[offset:offset + blocks * BLOCK]
    slots = hasher.slots(expected, BLOCK)
    leaf = bytes(slot_index * hasher.slot_size) + slots  # the run's slots from an offset
    at = slot_index * hasher.slot_size
    buf = bytearray(blocks * BLOCK)
    assert hasher.nbd_read_verify(h._o, buf, offset, BLOCK, leaf, at, 250) == -1
    assert buf == expected
    bad = random.Random(blocks).randrange(blocks)
    damaged = bytearray(leaf)
    damaged[at + bad * hasher.slot_size] ^= 1
    buf = bytearray(blocks * BLOCK)
    verdict = hasher.nbd_read_verify(h._o, buf, offset, BLOCK, bytes(damaged), at, 250)
    assert verdict == bad == hasher.verify(buf, BLOCK, bytes(damaged)[at:])
    assert buf == expected  # the bytes are the upstream's whatever the verdict
    h.shutdown()


def test_a_reply_later_than_the_slice_is_left_in_flight(image, hasher, sockdir, upstreams):
    upstream = NbdkitFile(image, sockdir, "native-slow", ("delay",), ("rdelay=400ms",)).start()
    upstreams.append(upstream)
    h = connected(upstream)
    held = image.read_bytes()
    slots = hasher.slots(held[:BLOCK], BLOCK)
    buf = bytearray(BLOCK)
    got = hasher.nbd_read_verify(h._o, buf, 0, BLOCK, slots, 0, 20)
    assert isinstance(got, tuple) and len(got) == 1
    cookie = got[0]
    while not h.aio_command_completed(cookie):  # the caller waits with the nbd module
        h.poll(-1)
    assert buf == held[:BLOCK]
    assert hasher.verify(buf, BLOCK, slots) == -1
    h.shutdown()


def test_a_read_libnbd_refuses_or_the_server_fails_is_errno_and_message(
        image, hasher, sockdir, tmp_path, upstreams):
    trigger = tmp_path / "fail"
    upstream = NbdkitFile(image, sockdir, "native-fail", ("error",),
                          ("error-pread=EIO", "error-pread-rate=100%",
                           f"error-pread-file={trigger}")).start()
    upstreams.append(upstream)
    h = connected(upstream)
    held = image.read_bytes()
    slots = hasher.slots(held[:BLOCK], BLOCK)
    beyond = hasher.nbd_read_verify(h._o, bytearray(BLOCK), SIZE, BLOCK, slots, 0, 250)
    assert isinstance(beyond, tuple) and len(beyond) == 2
    assert beyond[0] != 0 and beyond[1]  # libnbd's own check: past the export's end
    trigger.touch()
    failed = hasher.nbd_read_verify(h._o, bytearray(BLOCK), 0, BLOCK, slots, 0, 250)
    assert failed[0] == errno.EIO and failed[1]
    assert not h.aio_is_dead()  # a server's error leaves the connection usable
    trigger.unlink()
    buf = bytearray(BLOCK)
    assert hasher.nbd_read_verify(h._o, buf, 0, BLOCK, slots, 0, 250) == -1
    assert buf == held[:BLOCK]
    h.shutdown()


def test_what_is_not_a_handle_or_a_run_is_refused(image, hasher, sockdir, upstreams):
    upstream = NbdkitFile(image, sockdir, "native-args").start()
    upstreams.append(upstream)
    h = connected(upstream)
    slots = hasher.slots(bytes(BLOCK), BLOCK)
    with pytest.raises(ValueError):
        hasher.nbd_read_verify(object(), bytearray(BLOCK), 0, BLOCK, slots, 0, 250)
    with pytest.raises(ValueError):  # not whole blocks
        hasher.nbd_read_verify(h._o, bytearray(BLOCK + 1), 0, BLOCK, slots, 0, 250)
    with pytest.raises(ValueError):  # fewer slots than blocks
        hasher.nbd_read_verify(h._o, bytearray(2 * BLOCK), 0, BLOCK, slots, 0, 250)
    with pytest.raises(BufferError):  # not writable
        hasher.nbd_read_verify(h._o, bytes(BLOCK), 0, BLOCK, slots, 0, 250)
    held = image.read_bytes()[:BLOCK]  # and the connection still reads
    buf = bytearray(BLOCK)
    assert hasher.nbd_read_verify(h._o, buf, 0, BLOCK, hasher.slots(held, BLOCK), 0, 250) == -1
    assert buf == held
    h.shutdown()


def test_a_connection_whose_read_is_still_in_flight_is_never_given_back(
        image, sockdir, upstreams):
    """A wait that fails (a poll a signal interrupted, say) leaves the read in flight: the
    pool closes that connection rather than keep it idle, where the next read's would
    meet the old reply (written into a buffer that is no longer its reader's). A read
    the server failed has retired, and its connection is kept."""
    upstream = NbdkitFile(image, sockdir, "native-inflight", ("delay",),
                          ("rdelay=500ms",)).start()
    upstreams.append(upstream)
    source = NbdSource(upstream.uri, "data", connections=1)
    try:
        h = source._take()
        buf = bytearray(BLOCK)
        cookie = h.aio_pread(nbd.Buffer.from_buffer(buf), 0)
        assert source._failed(h, ImageIOError("the wait failed")) is True
        while not h.aio_command_completed(cookie):
            h.poll(-1)
        assert source._failed(h, ImageIOError("the server failed it")) is False
        source._give_back(h, False)
        assert buf == image.read_bytes()[:BLOCK]
    finally:
        source.close()
