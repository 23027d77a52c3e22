"""SHA-256 on the x86 SHA extensions (format/sha256x.c) is SHA-256, and it is what runs.

Known answers first (FIPS 180-4's examples, cryptsetup's verity vectors on every engine),
then equality with hashlib and with OpenSSL's EVP (the native Hasher with lanes=0) over
every block size veritysetup accepts and random lengths, random salts of 0 to 256 bytes
(either side of the 64-byte boundaries that decide the pre-salted state), both formats,
odd counts of blocks (the last block through one stream) and unaligned buffers. Last, the
counters prove the SHA-extension code hashed the blocks where the CPU has it, so that a
silent fallback to EVP cannot pass, and NBD_VERITY_NO_SHANI=1 keeps it out entirely.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from unittest import mock

import pytest

from nbd_verity.format import digest
from nbd_verity.format.builder import build_tree, verify_image
from nbd_verity.format.digest import Digester, engines_present
from nbd_verity.format.params import VerityParams
from nbd_verity.limits import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE

from ...golden import DATA_SIZE, GOLDEN, IDS

_native = digest._native
SHANI = _native is not None and _native.sha256_default_lanes() > 0
LANES = [1, 2, 3]
needs_shani = pytest.mark.skipif(not SHANI, reason="no SHA extensions here, the native "
                                 "engine is not built, or NBD_VERITY_NO_SHANI/PURE is set")
POWERS = [1 << k for k in range(MIN_BLOCK_SIZE.bit_length() - 1, MAX_BLOCK_SIZE.bit_length())]
# Salt sizes around the 64-byte blocks: none, a partial head, exactly whole, whole + head.
EDGE_SALTS = [0, 1, 32, 55, 56, 63, 64, 65, 119, 120, 127, 128, 192, 255, 256]

# FIPS 180-4 (and its example documents) B.1, B.2, B.3.
FIPS = [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]


def reference(salt: bytes, hash_type: int, block: bytes) -> bytes:
    """The salted digest by its definition, on hashlib."""
    return hashlib.sha256(salt + block if hash_type == 1 else block + salt).digest()


def unaligned(data: bytes, rng: random.Random) -> memoryview:
    """data at an odd address: a view 1 to 63 bytes into a larger buffer."""
    lead = rng.randrange(1, 64)
    return memoryview(bytearray(lead) + data)[lead:]


@needs_shani
@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize(("message", "want"), FIPS, ids=["abc", "448-bit", "million-a"])
def test_fips_180_4_examples(lanes, message, want):
    """Each message alone, and as lanes copies of it hashed together (no salt: a block
    of format 0 with an empty salt is the message itself)."""
    hasher = _native.Hasher("sha256", b"", 0, lanes=lanes)
    assert hasher.lanes == lanes
    for copies in range(1, lanes + 1):
        assert hasher.slots(message * copies, len(message)) == bytes.fromhex(want) * copies


@pytest.mark.parametrize("engine", engines_present("sha256"))
@pytest.mark.parametrize(("block_size", "salt", "hash_type", "algorithm", "root"),
                         [g for g in GOLDEN if g[3] == "sha256"],
                         ids=[i for i, g in zip(IDS, GOLDEN, strict=True) if g[3] == "sha256"])
def test_cryptsetup_vectors_on_every_engine(tmp_path, engine, block_size, salt, hash_type,
                                            algorithm, root):
    zeros = tmp_path / "zeros.img"
    with open(zeros, "wb") as f:
        f.truncate(DATA_SIZE)
    params = VerityParams(data_blocks=DATA_SIZE // block_size, hash_type=hash_type,
                          algorithm=algorithm, data_block_size=block_size,
                          hash_block_size=block_size,
                          salt=b"" if salt == "-" else bytes.fromhex(salt))
    on_engine = Digester(algorithm, params.salt, hash_type, engine=engine)
    with mock.patch.object(VerityParams, "digester", lambda self: on_engine):
        assert build_tree(str(zeros), str(tmp_path / "hash.img"), params).hex() == root
        assert verify_image(str(zeros), str(tmp_path / "hash.img"), params,
                            bytes.fromhex(root)).ok


def check_run(lanes: int, salt: bytes, hash_type: int, block_size: int, count: int,
              rng: random.Random) -> None:
    """slots and verify on `lanes` streams equal hashlib and OpenSSL's EVP on one run."""
    data = rng.randbytes(block_size * count)
    ours = _native.Hasher("sha256", salt, hash_type, lanes=lanes)
    evp = _native.Hasher("sha256", salt, hash_type, lanes=0)
    want = b"".join(reference(salt, hash_type, data[i * block_size:(i + 1) * block_size])
                    for i in range(count))
    view = unaligned(data, rng)
    assert ours.slots(view, block_size) == want
    assert evp.slots(data, block_size) == want
    assert ours.verify(view, block_size, want) == -1
    bad = rng.randrange(count)
    damaged = bytearray(data)
    damaged[bad * block_size + rng.randrange(block_size)] ^= 1 << rng.randrange(8)
    assert ours.verify(unaligned(bytes(damaged), rng), block_size, want) == bad
    assert evp.verify(bytes(damaged), block_size, want) == bad


@needs_shani
@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("hash_type", [0, 1])
@pytest.mark.parametrize("block_size", POWERS)
def test_every_block_size_equals_hashlib_and_evp(lanes, hash_type, block_size):
    rng = random.Random(block_size * 10 + hash_type * 3 + lanes)
    count = rng.choice([1, 2, 3, 5, 7]) if block_size <= 65536 else rng.choice([1, 3])
    check_run(lanes, rng.randbytes(rng.randrange(257)), hash_type, block_size, count, rng)


@needs_shani
@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("hash_type", [0, 1])
@pytest.mark.parametrize("salt_size", EDGE_SALTS)
def test_every_salt_edge_equals_hashlib_and_evp(lanes, hash_type, salt_size):
    rng = random.Random(salt_size * 7 + hash_type + 100 * lanes)
    for block_size in (512, 4096):
        check_run(lanes, rng.randbytes(salt_size), hash_type, block_size, 2 * lanes + 1, rng)


@needs_shani
@pytest.mark.parametrize("seed", range(40))
def test_random_lengths_and_salts_equal_hashlib_and_evp(seed):
    """Lengths 512 B to 64 KiB that are not powers of two (any block of any length runs
    through the same head, body and tail code), salts of 0 to 256 bytes, 1 to 9 blocks."""
    rng = random.Random(seed)
    for _ in range(4):
        check_run(rng.choice(LANES), rng.randbytes(rng.randrange(257)), rng.randrange(2),
                  rng.randrange(512, 65537), rng.randrange(1, 10), rng)


@needs_shani
@pytest.mark.parametrize("lanes", LANES)
def test_short_messages_where_the_head_and_block_share_the_last_block(lanes):
    """Blocks shorter than what a salt's head leaves of 64 bytes (not a verity block,
    but the code path exists): the head goes to the padded tail."""
    rng = random.Random(lanes)
    for size in (1, 7, 8, 9, 31, 55, 56, 63, 64, 65, 128):
        for salt_size in (0, 8, 33, 63, 64, 100):
            salt = rng.randbytes(salt_size)
            for hash_type in (0, 1):
                data = rng.randbytes(size * 3)
                want = b"".join(reference(salt, hash_type, data[i * size:(i + 1) * size])
                                for i in range(3))
                assert _native.Hasher("sha256", salt, hash_type, lanes=lanes).slots(
                    data, size) == want


@pytest.fixture
def counting():
    """The SHA-extension calls counted for this test (off otherwise, as in a server)."""
    _native.sha256x_count(True)
    yield
    _native.sha256x_count(False)


@needs_shani
def test_nothing_is_counted_unless_asked():
    before = _native.sha256x_counts()
    Digester("sha256", os.urandom(32), 1).slots_of(bytes(9 * 4096), 4096)
    assert _native.sha256x_counts() == before


@needs_shani
def test_the_sha_extensions_hashed_the_blocks(counting):
    """The default sha256 Hasher runs SHA-NI x2: pairs count as x2, an odd last block as
    x1; the builder's data level goes through it too. Proof that no silent fallback ran."""
    assert Digester("sha256", b"salt", 1).native.lanes == 2
    assert Digester("sha256", b"salt", 1).implementation == "SHA-NI x2"
    before = _native.sha256x_counts()
    Digester("sha256", os.urandom(32), 1).slots_of(bytes(9 * 4096), 4096)
    after = _native.sha256x_counts()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 8, 0)
    assert Digester("sha256", b"", 0).verify(bytes(4096 * 2), 4096, bytes(64)) == 0
    assert _native.sha256x_counts()[1] == after[1] + 2


def test_other_algorithms_and_evp_do_not_touch_the_sha_extensions(request):
    if _native is None:
        pytest.skip("the native engine is not built, or NBD_VERITY_PURE=1")
    request.getfixturevalue("counting")
    before = _native.sha256x_counts()
    Digester("sha1", b"salt", 1).slots_of(bytes(8 * 4096), 4096)
    Digester("sha256", b"salt", 1, engine="evp").slots_of(bytes(8 * 4096), 4096)
    assert _native.sha256x_counts() == before
    assert Digester("sha1", b"", 1).native.lanes == 0
    assert Digester("sha256", b"", 1, engine="evp").implementation == "OpenSSL EVP"
    with pytest.raises(ValueError, match="lanes 2: no SHA-extension path for sha1"):
        _native.Hasher("sha1", b"", 1, lanes=2)
    with pytest.raises(ValueError, match="SHA-NI cannot hash sha1"):
        Digester("sha1", b"", 1, engine="sha-ni x2")


def test_engines_present_name_what_can_run():
    present = engines_present("sha256")
    assert present[0] == "python"
    if _native is not None:
        assert "evp" in present
    assert ("sha-ni x2" in present) == SHANI
    assert engines_present("sha1") == (["python", "evp"] if _native is not None else ["python"])


def test_no_shani_keeps_the_sha_extensions_out():
    """NBD_VERITY_NO_SHANI=1 behaves as a CPU without them: sha256 on EVP, no SHA-NI
    Hasher can be asked for, nothing counted, and the engine's name says EVP."""
    if _native is None:
        pytest.skip("the native engine is not built, or NBD_VERITY_PURE=1")
    code = ("from nbd_verity.format import digest as d, _native as n\n"
            "n.sha256x_count(True)\n"
            "x = d.Digester('sha256', b'salt', 1)\n"
            "x.slots_of(bytes(8 * 4096), 4096)\n"
            "print(n.sha256_default_lanes(), x.native.lanes, x.implementation.replace(' ', '_'),"
            " n.sha256x_counts() == (0, 0, 0), d.engines_present('sha256'), sep='|')\n"
            "print(d.engine_name())\n"
            "n.Hasher('sha256', b'', 1, lanes=2)\n")
    env = dict(os.environ, NBD_VERITY_NO_SHANI="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=False)
    lines = done.stdout.splitlines()
    assert lines[0] == "0|0|OpenSSL_EVP|True|['python', 'evp']"
    assert lines[1].startswith("native (OpenSSL ") and lines[1].endswith(", sha256: EVP)")
    assert "ValueError: lanes 2: no SHA-extension path for sha256" in done.stderr


@needs_shani
def test_engine_name_says_sha_ni_x2():
    assert digest.engine_name().endswith(", sha256: SHA-NI x2)")
    assert digest.engine_name("sha256") == digest.engine_name()
    assert digest.engine_name("sha1").startswith("native (OpenSSL ")
    assert "sha256" not in digest.engine_name("sha1")


def test_cpu_has_sha_matches_proc_cpuinfo():
    if _native is None:
        pytest.skip("the native engine is not built, or NBD_VERITY_PURE=1")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    assert _native.cpu_has_sha() == ("sha_ni" in flags and "sse4_1" in flags)
