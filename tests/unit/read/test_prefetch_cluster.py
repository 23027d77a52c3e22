"""The level-0 prefetch cluster as dm-verity computes it (verity_prefetch_io): the
prefetch_cluster bytes over the data block size, rounded down to a power of two."""

from __future__ import annotations

import pytest

from nbd_verity.read.beside import cluster_blocks
from nbd_verity.read.counters import PREFETCH_CLUSTER


@pytest.mark.parametrize(("cluster_bytes", "data_block_size", "blocks"), [
    (PREFETCH_CLUSTER, 4096, 64),  # the kernel's default: 64 hash blocks at 4 KiB
    (PREFETCH_CLUSTER, 512, 512),  # the kernel's quirk: counted in DATA blocks
    (3 * 4096, 4096, 2),  # rounded down to a power of two
    (100 << 10, 4096, 16),
    (4096, 4096, 1),  # one block: no widening
    (2048, 4096, 0),  # less than a block, and 0: no widening (the kernel's 0 disables it)
    (0, 4096, 0),
])
def test_cluster_blocks_as_the_kernel_computes_them(cluster_bytes, data_block_size, blocks):
    assert cluster_blocks(cluster_bytes, data_block_size) == blocks
