"""FEC in the server, in process: the keys, and what a Device does on the error path."""

from __future__ import annotations

import os
import random

import pytest

from nbd_verity.errors import ConfigError, DataCorruption, ImageIOError
from nbd_verity.fec import image as fec_image
from nbd_verity.format import digest
from nbd_verity.format.params import VerityParams
from nbd_verity.prepare.config import config_from_pairs, plugin_pairs
from nbd_verity.serve.device import Connection, Device

BS = 4096
BLOCKS = 768  # with roots 2: 4 rounds, so blocks 5, 9, 13 share a codeword group


def read_general(conn, buf, offset):
    """The general path, as the callbacks' pread takes it after the fast path."""
    conn.device.dispatcher.read(buf, offset, conn)


def test_serve_options_become_fec_keys(tmp_path):
    pairs = plugin_pairs({"fec_device": "p.fec", "fec_roots": 4, "fec_offset": 0})
    assert pairs == [("fec-device", os.path.abspath("p.fec")), ("fec-roots", "4")]
    assert plugin_pairs({"fec_device": None, "fec_roots": None, "fec_offset": None}) == []
    config = config_from_pairs([("data", "d"), ("fec-device", "f"), ("fec-roots", "3"),
                                ("fec-offset", "8K")])
    assert (config.fec_roots, config.fec_offset) == (3, 8192)


@pytest.fixture
def image(tmp_path):
    content = bytearray(random.Random(4).randbytes(BLOCKS * BS))
    content[13 * BS:14 * BS] = bytes(BS)  # a zero block
    (tmp_path / "data").write_bytes(content)
    params = VerityParams(data_blocks=BLOCKS, salt=b"\x01" * 32)
    root, _ = fec_image.format_with_fec(str(tmp_path / "data"), str(tmp_path / "hash"),
                                        str(tmp_path / "fec"), params, 2)
    return tmp_path, root.hex(), bytes(content)


def device(tmp_path, root: str, **keys) -> Device:
    pairs = [("data", str(tmp_path / "data")), ("hash", str(tmp_path / "hash")),
             ("root-hash", root), ("fec-device", str(tmp_path / "fec"))]
    return Device(config_from_pairs(pairs + [(k.replace("_", "-"), v)
                                             for k, v in keys.items()]))


def spoil(tmp_path, *blocks: int) -> None:
    with open(tmp_path / "data", "r+b") as f:
        for b in blocks:
            f.seek(b * BS)
            f.write(random.Random(b).randbytes(BS))


def read(dev: Device, block: int, count: int = 1) -> bytes:
    buf = bytearray(count * BS)
    read_general(Connection(dev), memoryview(buf), block * BS)
    return bytes(buf)


def test_a_repaired_block_is_not_marked_checked(image):
    """check-at-most-once: the disk still holds the bad block, so every read repairs it."""
    tmp_path, root, content = image
    spoil(tmp_path, 5)
    dev = device(tmp_path, root, check_at_most_once="true", readahead="false")
    try:
        for _ in range(2):
            assert read(dev, 5) == content[5 * BS:6 * BS]
        counts = dev.verifier.counters.snapshot()
        assert counts["fec_corrected"] == 2 and dev.verifier.counters.status == "V"
    finally:
        dev.close()


def test_zero_blocks_count_as_zeros_under_ignore_zero_blocks(image):
    """Three bad blocks of a group exceed roots 2, unless one is a known zero block."""
    tmp_path, root, content = image
    spoil(tmp_path, 5, 9, 13)
    for keys, repaired in (({}, False), ({"ignore_zero_blocks": "true"}, True)):
        dev = device(tmp_path, root, **keys)
        try:
            if repaired:
                assert read(dev, 5) == content[5 * BS:6 * BS]
            else:
                with pytest.raises(DataCorruption):
                    read(dev, 5)
                assert dev.verifier.counters.snapshot()["fec_failed"] == 1
        finally:
            dev.close()


def test_fec_is_not_reentered(image):
    """Inside a repair, a nested failure is not repaired (the kernel's recursion guard)."""
    tmp_path, root, content = image
    spoil(tmp_path, 5)
    dev = device(tmp_path, root)
    try:
        fec = dev.verifier.fec
        fec._local.busy = True
        with pytest.raises(DataCorruption):
            read(dev, 5)
        fec._local.busy = False
        assert read(dev, 5) == content[5 * BS:6 * BS]
    finally:
        dev.close()


@pytest.mark.skipif(digest._native is None, reason="the native read path is the one under "
                    "test: not built, or NBD_VERITY_PURE=1")
def test_blocks_past_a_truncated_end_are_rebuilt(image):
    """A local data image cut inside block 766: the native read of an aligned run fails,
    the run is read again block by block, and 766 and 767 (each in its own group) are
    rebuilt from their groups; without FEC the read fails as before."""
    tmp_path, root, content = image
    dev = device(tmp_path, root, readahead="false")
    plain = Device(config_from_pairs([("data", str(tmp_path / "data")),
                                      ("hash", str(tmp_path / "hash")), ("root-hash", root)]))
    try:
        assert dev.verifier._reads_native  # the native path is the one under test
        os.truncate(tmp_path / "data", 766 * BS + 100)
        assert read(dev, 760, 8) == content[760 * BS:768 * BS]
        counts = dev.verifier.counters.snapshot()
        assert counts["fec_corrected"] == counts["io_errors_repaired"] == 2
        assert counts["io_errors"] == 0 and dev.verifier.counters.status == "V"
        with pytest.raises(ImageIOError, match="truncated"):
            read(plain, 760, 8)
        assert plain.verifier.counters.snapshot()["io_errors"] == 1
    finally:
        dev.close()
        plain.close()


def test_fec_settings_without_a_device_are_refused(image):
    tmp_path, root, _ = image
    pairs = [("data", str(tmp_path / "data")), ("hash", str(tmp_path / "hash")),
             ("root-hash", root), ("fec-roots", "4")]
    with pytest.raises(ConfigError, match="without fec-device"):
        Device(config_from_pairs(pairs))
