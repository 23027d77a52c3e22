"""Tree geometry: levels, their places on disk, and where each digest lives
(cryptsetup's hash_levels)."""

from __future__ import annotations

import pytest

from nbd_verity.errors import ConfigError, FormatError
from nbd_verity.format.geometry import TreeGeometry, hash_start_block
from nbd_verity.format.params import VerityParams


def geometry(data_blocks, dbs=4096, hbs=4096, digest_size=32, slot_size=32, start=0):
    return TreeGeometry.from_params(data_blocks, dbs, hbs, digest_size, slot_size, start)


def test_spec_example_3mib_4096_512_sha256():
    # hash_levels: 3 MiB, dbs 4096, hbs 512, sha256 → N = 768, hpb = 16, sizes [48, 3, 1]
    # starting at [5, 2, 1]; the file is 53 * 512 bytes; veritysetup says "Hash blocks: 52".
    params = VerityParams(data_blocks=(3 << 20) // 4096, data_block_size=4096,
                          hash_block_size=512, algorithm="sha256")
    geo = params.geometry()
    assert geo.data_blocks == 768
    assert geo.hashes_per_block == 16
    assert geo.levels == 3
    assert geo.level_blocks == (48, 3, 1)
    assert geo.level_start == (5, 2, 1)
    assert geo.hash_start_block == 1
    assert geo.hash_blocks == 52
    assert geo.hash_image_size == 53 * 512


@pytest.mark.parametrize(("hash_offset", "hbs", "superblock", "start"), [
    (0, 512, True, 1),          # veritysetup's VERITY_hash_offset_block
    (8192, 1024, True, 9),
    (1536, 4096, True, 1),      # byte 4096: the superblock ends at 2048, rounded up
    (0, 4096, False, 0),
    (8192, 1024, False, 8),
    (0, 4096, True, 1),
])
def test_hash_start_block(hash_offset, hbs, superblock, start):
    assert hash_start_block(hash_offset, hbs, superblock) == start


@pytest.mark.parametrize(("fields", "message"), [
    ({"hash_type": 2}, r"format: unsupported hash type 2 \(0 or 1\)"),
    ({"hash_type": -1}, r"format: unsupported hash type -1 \(0 or 1\)"),
    ({"algorithm": "whirlpool"}, "hash: unsupported algorithm 'whirlpool'"),
    ({"data_block_size": 1000}, "data-block-size: 1000 is not a power of two from 512"),
    ({"data_block_size": 256}, "data-block-size: 256 is not a power of two"),
    ({"hash_block_size": 1 << 20}, "hash-block-size: 1048576 is not a power of two"),
    ({"salt": bytes(257)}, "salt: 257 bytes exceeds the maximum of 256"),
    ({"hash_offset": 100}, "hash-offset: 100 is not a multiple of 512"),
    ({"hash_offset": -512}, "hash-offset: -512 is not a multiple of 512"),
])
def test_params_check_is_the_one_entry_that_refuses_each_field(fields, message):
    """One test per rejected parameter, at the one place that validates them."""
    with pytest.raises(ConfigError, match=message):
        VerityParams(data_blocks=10, **fields).check()


@pytest.mark.parametrize(("child", "parent", "offset"), [
    (0, 0, 0), (1, 0, 32), (127, 0, 127 * 32), (128, 1, 0), (300, 2, 44 * 32),
])
def test_parent_slot(child, parent, offset):
    geo = geometry(1000)  # 4096-byte hash blocks of 32-byte slots: 128 per block
    assert geo.parent_slot(child) == (parent, offset)
    assert geo.slot_of(0, child) == (geo.level_start[0] + parent, offset)
    assert geo.first_child(parent) == child - offset // 32


@pytest.mark.parametrize(("first", "count", "run"), [
    (0, 1, 1), (0, 128, 128), (0, 129, 128), (127, 5, 1), (130, 200, 126), (5, 0, 0),
])
def test_run_under_parent(first, count, run):
    assert geometry(1000).run_under_parent(first, count) == run


def test_single_data_block_has_no_levels():
    geo = geometry(1, start=1)
    assert geo.levels == 0
    assert geo.hash_blocks == 0
    assert geo.hash_image_size == 4096  # the superblock's block only


@pytest.mark.parametrize(("digest_size", "hbs", "hpb"), [
    (20, 512, 16),   # sha1: 25 would fit, but the count is a power of two (as hash_levels)
    (32, 512, 16),
    (32, 4096, 128),
    (64, 512, 8),
    (16, 4096, 256),
    (28, 4096, 128),  # sha224: 146 would fit
])
def test_hashes_per_block_is_a_power_of_two(digest_size, hbs, hpb):
    geo = geometry(1000, hbs=hbs, digest_size=digest_size, slot_size=digest_size)
    assert geo.hashes_per_block == hpb


@pytest.mark.parametrize(("data_blocks", "sizes"), [
    (2, (1,)),
    (128, (1,)),
    (129, (2, 1)),                     # one block past a full hash block
    (128 * 128, (128, 1)),
    (128 * 128 + 1, (129, 2, 1)),      # one block past a full two-level tree
    (262144, (2048, 16, 1)),           # 1 GiB of 4 KiB blocks
])
def test_level_sizes(data_blocks, sizes):
    assert geometry(data_blocks).level_blocks == sizes


def test_levels_are_stored_root_most_first_and_contiguous():
    geo = geometry(128 * 128 + 1, start=3)
    assert geo.level_start == (3 + 2 + 1, 3 + 1, 3)
    assert geo.hash_end_block == 3 + 129 + 2 + 1


def test_slot_of_follows_the_kernels_verity_hash_at_level():
    geo = geometry(768, hbs=512, start=1)  # sizes [48, 3, 1] at [5, 2, 1], hpb 16
    assert geo.slot_of(0, 0) == (5, 0)
    assert geo.slot_of(0, 17) == (6, 32)
    assert geo.slot_of(0, 767) == (5 + 47, 15 * 32)
    assert geo.slot_of(1, 47) == (2 + 2, 15 * 32)
    assert geo.slot_of(2, 2) == (1, 2 * 32)


def test_slot_size_is_packed_in_format_0_and_padded_in_format_1():
    v1 = VerityParams(data_blocks=100, algorithm="sha1", hash_type=1).geometry()
    v0 = VerityParams(data_blocks=100, algorithm="sha1", hash_type=0).geometry()
    assert v1.slot_of(0, 3)[1] == 3 * 32
    assert v0.slot_of(0, 3)[1] == 3 * 20


def test_level_of_block_and_index_in_level():
    geo = geometry(768, hbs=512, start=1)
    assert geo.index_in_level(1) == (2, 0)
    assert geo.index_in_level(4) == (1, 2)
    assert geo.index_in_level(52) == (0, 47)
    for outside in (0, 53):
        with pytest.raises(ValueError, match=f"hash block {outside} is outside the tree"):
            geo.level_of_block(outside)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data_blocks": 0}, "data-blocks: 0 .at least one block is needed"),
    ({"data_blocks": -5}, "data-blocks: -5 .at least one block is needed"),
    ({"data_blocks": 1 << 51}, "end past the largest file offset"),  # exactly 2**63 bytes
    ({"data_blocks": 1 << 54, "dbs": 512}, "end past the largest file offset"),
    ({"data_blocks": 10, "hbs": 512, "digest_size": 512}, "too small for 512-byte digests"),
    ({"data_blocks": 10, "start": 1 << 51}, "the tree would end past the largest file offset"),
])
def test_impossible_geometries_are_refused(kwargs, message):
    with pytest.raises(FormatError, match=message):
        geometry(**kwargs)


def test_deepest_possible_tree_stays_under_63_levels():
    # 2 digests per block (hbs = 2 * digest) is the worst case: one level per bit.
    geo = geometry((1 << 40) + 1, dbs=512, hbs=512, digest_size=256, slot_size=256)
    assert geo.hashes_per_block == 2
    assert geo.levels == 41
    assert geo.level_blocks[-1] == 1
