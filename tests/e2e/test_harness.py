"""The harness itself: a failing guest fails the test loudly, with the guest's console."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import GuestFailed, boot_guest
from .images import level0_hash_block


def test_failing_scenario_raises_with_console_log(e2e_host, tmp_path: Path):
    with pytest.raises(GuestFailed) as failed:
        boot_guest("echo scenario-marker-42\nfalse\necho never-here\n", [], tmp_path)
    message = str(failed.value)
    assert "failed with status 1" in message
    assert "scenario-marker-42" in message
    assert "never-here" not in message


@pytest.mark.parametrize(("data_blocks", "k", "expected"), [
    # 64 MiB: levels [128, 1]; superblock block, 1 level-1 block, then level 0.
    (16384, 0, (2, 0, 128)),
    (16384, 127, (129, 16256, 128)),
    # A partial last level-0 block covers only what is left.
    (1000, 7, (9, 896, 104)),
    # Three levels: 128*128+1 blocks -> [129, 2, 1].
    (16385, 128, (1 + 1 + 2 + 128, 16384, 1)),
])
def test_level0_hash_block(data_blocks, k, expected):
    block = level0_hash_block(data_blocks, k)
    assert (block.hash_block_index, block.first_data_block, block.data_blocks) == expected


def test_level0_hash_block_rejects_a_tree_without_level0():
    with pytest.raises(ValueError, match="no hash blocks"):
        level0_hash_block(1, 0)
