"""Known-answer vectors from cryptsetup's tests/verity-compat-test.

8 MiB of zeros, data and hash blocks of the same size; the golden root hashes are those
checked in by cryptsetup (and copied into containerd/go-dmverity's verity-compat.sh).
tests/oracle/test_veritysetup.py checks the same vectors against the installed veritysetup.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbd_verity.format.builder import build_tree, verify_image
from nbd_verity.format.params import VerityParams

from ...golden import DATA_SIZE, GOLDEN, IDS


@pytest.fixture(scope="module")
def zeros(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("golden") / "zeros.img"
    with open(path, "wb") as f:
        f.truncate(DATA_SIZE)
    return path


def params_for(block_size, salt, hash_type, algorithm, **kw) -> VerityParams:
    return VerityParams(data_blocks=DATA_SIZE // block_size, hash_type=hash_type,
                        algorithm=algorithm, data_block_size=block_size,
                        hash_block_size=block_size,
                        salt=b"" if salt == "-" else bytes.fromhex(salt), **kw)


@pytest.mark.parametrize(("block_size", "salt", "hash_type", "algorithm", "root"), GOLDEN,
                         ids=IDS)
@pytest.mark.parametrize("superblock", [True, False], ids=["sb", "no-sb"])
def test_golden_root_hash(zeros, tmp_path, block_size, salt, hash_type, algorithm, root,
                          superblock):
    params = params_for(block_size, salt, hash_type, algorithm, superblock=superblock)
    hash_path = tmp_path / "hash.img"
    assert build_tree(str(zeros), str(hash_path), params).hex() == root
    assert verify_image(str(zeros), str(hash_path), params, bytes.fromhex(root)).ok


@pytest.mark.parametrize(("block_size", "salt", "hash_type", "algorithm", "root"), GOLDEN,
                         ids=IDS)
def test_golden_root_hash_one_device_offset(tmp_path, block_size, salt, hash_type, algorithm,
                                            root):
    # verity-compat-test's "one device offset" run: the tree follows the data in one file.
    image = tmp_path / "one.img"
    with open(image, "wb") as f:
        f.truncate(DATA_SIZE + (1 << 20))
    params = params_for(block_size, salt, hash_type, algorithm, hash_offset=DATA_SIZE)
    assert build_tree(str(image), str(image), params).hex() == root
    with open(image, "rb") as f:
        assert f.read(DATA_SIZE) == bytes(DATA_SIZE)  # the data area is untouched
