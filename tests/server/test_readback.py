"""The served device equals the data image, for every geometry veritysetup can make."""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .serverlib import (
    ENGINES,
    MIB,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    raw_connect,
    raw_read_reply,
    raw_read_request,
)

# name -> (content size, veritysetup options, make_image keywords; "omit": keys not passed)
GEOMETRIES = {
    "default-4096-sha256": (1 * MIB, (), {}),
    "512-byte-blocks-3-levels": (256 << 10, ("--data-block-size=512",
                                             "--hash-block-size=512"), {}),
    "format0-sha1": (1 * MIB, ("--format=0", "--hash=sha1"), {}),
    "no-superblock": (1 * MIB, ("--no-superblock",), {"geometry_keys": True}),
    "hash-offset-same-file": (1 * MIB, ("--data-blocks=256",),
                              {"hash_offset": 1 * MIB, "same_file": True}),
    "data-blocks-below-file-size": (1 * MIB + 1000, ("--data-blocks=100",), {}),
    "single-data-block": (4096, (), {}),
    "hash-4096-data-1024-sha512": (600 << 10, ("--data-block-size=1024", "--hash=sha512"), {}),
    "no-salt": (1 * MIB, ("--salt=-",), {}),
    "superblock-at-1536": (1 * MIB, (), {"hash_offset": 1536}),
    # veritysetup rounds a header-less hash offset down to a hash block: the tree is at 0.
    "no-superblock-offset-1536": (1 * MIB, ("--no-superblock",),
                                  {"hash_offset": 1536, "geometry_keys": True}),
    "no-superblock-blocks-from-size": (1 * MIB, ("--no-superblock",),
                                       {"geometry_keys": True, "omit": ("data-blocks",)}),
}


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def geometry_image(request, tmp_path_factory):
    size, options, keywords = GEOMETRIES[request.param]
    keywords = dict(keywords)
    omit = keywords.pop("omit", ())
    directory = tmp_path_factory.mktemp(request.param)
    image = make_image(directory, random_bytes(zlib.crc32(request.param.encode()), size),
                       *options, **keywords)
    for key in omit:
        del image.keys[key]
    return image


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_whole_device_reads_back(geometry_image, servers):
    image = geometry_image
    h = servers.start(image).connect()
    assert h.get_size() == image.size
    assert h.pread(image.size, 0) == image.expected()


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_every_geometry_detects_a_flipped_byte(geometry_image, servers, tmp_path):
    """Reading back proves nothing if nothing is checked: the last block must fail."""
    image = geometry_image.copy(tmp_path / "copy")
    dbs = image.data_block_size
    last = image.data_blocks - 1
    flip_byte(image.data, last * dbs + dbs // 2)
    if image.data_blocks == 1:  # no tree: the data block is the top, checked at start-up
        server = servers.start(image, ready=False)
        assert server.wait() != 0
        assert "data block 0 is corrupted" in server.log()
        return
    h = servers.start(image).connect()
    expect_eio(h, dbs, last * dbs)
    if last:
        assert h.pread(dbs, (last - 1) * dbs) == image.expected((last - 1) * dbs, dbs)


def test_captive_server_reads_back(default_image, captive):
    """libnbd's own pattern: connect_command with `nbdkit -s --exit-with-parent`."""
    h = captive(default_image)
    assert h.get_size() == default_image.size
    assert h.pread(default_image.size, 0) == default_image.expected()


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("which", ["default_image", "small_block_image"])
def test_random_unaligned_reads(which, request, servers):
    image = request.getfixturevalue(which)
    expected = image.expected()
    dbs = image.data_block_size
    rng = random.Random(20240611)
    h = servers.start(image, readahead="false" if which == "small_block_image" else "true")
    h = h.connect()
    cases = [(0, 1), (image.size - 1, 1), (dbs - 1, 2), (dbs + 1, dbs - 2),
             (image.size - dbs - 3, dbs + 3)]
    for _ in range(300):
        offset = rng.randrange(image.size)
        length = rng.randint(1, min(4 * dbs + 17, image.size - offset))
        cases.append((offset, length))
    for offset, length in cases:
        assert h.pread(length, offset) == expected[offset:offset + length], (offset, length)


def test_a_read_past_the_end_is_an_error_and_the_connection_goes_on(default_image, servers):
    """libnbd refuses such a request itself, so a raw client sends it."""
    server = servers.start(default_image)
    sock, size = raw_connect(server.socket)
    with sock:
        assert size == default_image.size
        raw_read_request(sock, 1, size - 1, 2)
        error, _ = raw_read_reply(sock, 1, 2)
        assert error != 0
        raw_read_request(sock, 2, size - 3, 3)
        assert raw_read_reply(sock, 2, 3) == (0, default_image.expected(size - 3, 3))


@st.composite
def ranges(draw, size: int = 4 * MIB, block: int = 4096):
    """Offsets and lengths that favour block edges (where head/body/tail split)."""
    offset = draw(st.one_of(st.integers(0, size - 1),
                            st.builds(lambda b, d: min(size - 1, max(0, b * block + d)),
                                      st.integers(0, size // block), st.integers(-3, 3))))
    length = draw(st.one_of(st.integers(1, 3 * block),
                            st.sampled_from([block - 1, block, block + 1, 2 * block])))
    return offset, min(length, size - offset)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ranges())
def test_any_range_reads_back(shared_server, default_image, request_range):
    offset, length = request_range
    h = shared_server.handles[0] if shared_server.handles else shared_server.connect()
    assert h.pread(length, offset) == default_image.expected(offset, length)
