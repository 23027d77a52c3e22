"""Known-answer vectors from cryptsetup's tests/verity-compat-test.

8 MiB of zeros, data and hash blocks of the same size; the golden root hashes are those
checked in by cryptsetup (and copied into containerd/go-dmverity's verity-compat.sh).
tests/oracle/test_veritysetup.py checks the same vectors against the installed veritysetup.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbd_verity.builder import build_tree, verify_image
from nbd_verity.params import VerityParams

SALT = "e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d"
DATA_SIZE = 8 << 20

# (block size, salt, format, algorithm, root hash), in cryptsetup's order.
GOLDEN = [
    (512, SALT, 1, "sha256", "9de18652fe74edfb9b805aaed72ae2aa48f94333f1ba5c452ac33b1c39325174"),
    (1024, SALT, 1, "sha256", "54d92778750495d1f80832b486ebd007617d746271511bbf0e295e143da2b3df"),
    (4096, SALT, 1, "sha256", "e522df0f97da4febb882ac40f30b37dc0b444bf6df418929463fa25280f09d5c"),
    (4096, SALT, 0, "sha256", "cbbf4ebd004ef65e29b935bb635a39cf754d677f3fa10b0126da725bbdf10f7d"),
    (4096, "-", 1, "sha256", "ef29c902d87350f1da4bfa536e16cebc162a909bf89abe448b81ec500d4fb9bf"),
    (1024, SALT, 1, "sha1", "d0e9163ca8844aaa2e88fe5265a8c5d9ee494a99"),
    (1024, "dadada", 1, "sha1", "73509e8e868be6b8ac939817a98a3d35121413b2"),
]
IDS = [f"{bs}-v{fmt}-{alg}-{'nosalt' if s == '-' else s[:6]}" for bs, s, fmt, alg, _ in GOLDEN]


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
