"""The native engine (nbd_verity.format._native) against the pure-Python reference (digest.py).

Identical slots, digests and verdicts (the first block that differs) on random
algorithms, formats, salts, block sizes, run lengths and corruption positions; the read
path (read_verify) fills the buffer as preadv would and reports a failed read so that
Python can name it. NBD_VERITY_PURE=1 keeps the compiled module out.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbd_verity.format import digest
from nbd_verity.format.digest import (
    Digester,
    engine_name,
    engines_present,
    native_hasher,
    supported_algorithms,
)

_native = digest._native
pytestmark = pytest.mark.skipif(_native is None, reason="the native engine is not built, or "
                                "NBD_VERITY_PURE=1 forces the pure one")

ALGORITHMS = [a for a in supported_algorithms() if native_hasher(a, b"", 1) is not None]
BLOCK_SIZES = [512, 1024, 4096, 8192]


def engines(algorithm: str, salt: bytes, hash_type: int) -> tuple[Digester, Digester]:
    native = Digester(algorithm, salt, hash_type)
    pure = Digester(algorithm, salt, hash_type, engine="python")
    assert native.engine == "native" and pure.engine == "python"
    return native, pure


def every_native(algorithm: str, salt: bytes, hash_type: int) -> list[Digester]:
    """A native Digester on every engine present for the algorithm (OpenSSL's EVP, and
    for sha256 on a CPU with the SHA extensions one to three interleaved streams)."""
    natives = [Digester(algorithm, salt, hash_type, engine=name)
               for name in engines_present(algorithm) if name != "python"]
    assert natives and all(d.engine == "native" for d in natives)
    return natives


@st.composite
def runs(draw):
    """(algorithm, hash_type, salt, block_size, data of 0..12 blocks)."""
    algorithm = draw(st.sampled_from(ALGORITHMS or ["sha256"]))
    hash_type = draw(st.sampled_from([0, 1]))
    salt = draw(st.binary(max_size=256))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    blocks = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    data = bytearray(random.Random(seed).randbytes(blocks * block_size))
    return algorithm, hash_type, salt, block_size, data


def test_every_algorithm_hashlib_has_runs_natively():
    """OpenSSL computes every veritysetup algorithm this Python's hashlib does."""
    assert supported_algorithms() == ALGORITHMS


@settings(max_examples=300, deadline=None)
@given(runs())
def test_slots_and_digests_are_identical(run):
    algorithm, hash_type, salt, block_size, data = run
    pure = Digester(algorithm, salt, hash_type, engine="python")
    slots = pure.slots_of(data, block_size)
    assert pure.slots_of_held(data, block_size) == slots
    for native in every_native(algorithm, salt, hash_type):
        assert (native.slot_size, native.digest_size) == (pure.slot_size, pure.digest_size)
        assert native.slots_of(data, block_size) == slots, native.implementation
        assert native.slots_of_held(memoryview(data), block_size) == slots
        assert native.digest(data) == pure.digest(data)
        if slots:  # a slot's digest is its first digest_size bytes
            assert native.stored(slots, 0) == pure.digest(data[:block_size])


@settings(max_examples=300, deadline=None)
@given(runs(), st.lists(st.integers(0, 11), max_size=3), st.sampled_from(["data", "slot"]),
       st.integers(0, 2**16))
def test_verdicts_are_identical(run, damaged, where, at):
    """Damage some blocks (or their slots); both engines name the same first block."""
    algorithm, hash_type, salt, block_size, data = run
    natives = every_native(algorithm, salt, hash_type)
    native, pure = natives[0], Digester(algorithm, salt, hash_type, engine="python")
    blocks = len(data) // block_size
    expected = bytearray(pure.slots_of(data, block_size))
    damaged = sorted({d for d in damaged if d < blocks})
    for block in damaged:
        if where == "data":
            data[block * block_size + at % block_size] ^= 0x5A
        else:
            expected[block * native.slot_size + at % native.digest_size] ^= 0x5A
    first = damaged[0] if damaged else -1
    expected = bytes(expected)
    assert pure.verify(data, block_size, expected) == first
    pure.release_size = 0  # every run hashed with the GIL released
    assert pure.verify(data, block_size, expected) == first
    for native in natives:
        assert native.verify(data, block_size, expected) == first, native.implementation
        assert native.native.verify(data, block_size, expected) == first


@settings(max_examples=100, deadline=None)
@given(runs(), st.lists(st.integers(0, 11), max_size=2), st.integers(0, 3))
def test_read_verify_reads_then_verifies_like_verify(tmp_path_factory, run, damaged, lead):
    """read_verify fills buf with the file's bytes at offset and gives verify's verdict,
    with the GIL held (short runs) or released (long runs)."""
    algorithm, hash_type, salt, block_size, data = run
    pure = Digester(algorithm, salt, hash_type, engine="python")
    expected = pure.slots_of(data, block_size)
    for block in {d for d in damaged if d < len(data) // block_size}:
        data[block * block_size] ^= 1
    offset = lead * block_size
    path = tmp_path_factory.mktemp("rv") / "image"
    path.write_bytes(bytes(offset) + bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        for native, release_size in itertools.product(
                every_native(algorithm, salt, hash_type), (1 << 62, 0)):
            native.native.release_size = release_size
            buf = bytearray(len(data))
            verdict = native.native.read_verify(fd, buf, offset, block_size, expected)
            assert buf == data
            assert verdict == pure.verify(data, block_size, expected), native.implementation
    finally:
        os.close(fd)


def test_read_verify_reports_a_short_read_and_a_bad_fd(tmp_path):
    hasher = Digester("sha256", b"salt", 1).native
    path = tmp_path / "image"
    path.write_bytes(bytes(3 * 4096))
    want = hasher.slots(bytes(4096), 4096) * 4
    fd = os.open(path, os.O_RDONLY)
    try:
        assert hasher.read_verify(fd, bytearray(4096), 2 * 4096, 4096, want) == -1
        assert hasher.read_verify(fd, bytearray(4096), 3 * 4096, 4096, want) == _native.READ_FAILED
        assert hasher.read_verify(fd, bytearray(8192), 2 * 4096, 4096, want) == _native.READ_FAILED
    finally:
        os.close(fd)
    assert hasher.read_verify(fd, bytearray(4096), 0, 4096, want) == _native.READ_FAILED
    with pytest.raises(BufferError):
        hasher.read_verify(0, b"read-only buffer", 0, 16, want)


@pytest.mark.parametrize("slot_index", [0, 1, 5, 7])
def test_read_verify_takes_its_slots_at_an_offset_of_the_whole_leaf(tmp_path, slot_index):
    """slot_offset reads the slots from there on, as the slice leaf[slot_offset:] would,
    and is checked against the leaf's length."""
    hasher = Digester("sha256", b"salt", 1).native
    blocks = [random.Random(i).randbytes(4096) for i in range(8)]
    leaf = b"".join(hasher.slots(b, 4096) for b in blocks)
    path = tmp_path / "image"
    path.write_bytes(b"".join(blocks))
    fd = os.open(path, os.O_RDONLY)
    try:
        at, run = slot_index * hasher.slot_size, 8 - slot_index
        buf = bytearray(run * 4096)
        assert hasher.read_verify(fd, buf, slot_index * 4096, 4096, leaf, at) == -1
        assert buf == b"".join(blocks[slot_index:])
        if slot_index:  # the same bytes checked against the wrong slots: the first differs
            assert hasher.read_verify(fd, buf, slot_index * 4096, 4096, leaf, 0) == 0
        with pytest.raises(ValueError, match="bytes of slots"):
            hasher.read_verify(fd, bytearray((run + 1) * 4096), 0, 4096, leaf, at)
        for outside in (-1, len(leaf) + 1):
            with pytest.raises(ValueError, match="slot_offset"):
                hasher.read_verify(fd, bytearray(4096), 0, 4096, leaf, outside)
        with pytest.raises(TypeError, match="takes 5 arguments"):
            hasher.read_verify(fd, buf, 0, 4096)
    finally:
        os.close(fd)


def test_digests_on_many_threads_share_no_context():
    """One digest context per thread (never one per Hasher): threads hashing with one
    Hasher at once each get the right digests."""
    d = Digester("sha256", b"salt", 1)
    blocks = [random.Random(i).randbytes(4096) for i in range(64)]
    want = [d.native.slots(b, 4096)[:32] for b in blocks]
    wrong = []

    def work():
        for _ in range(50):
            for b, w in zip(blocks, want, strict=True):
                if d.native.digest(b) != w or d.native.verify(b, 4096, w) != -1:
                    wrong.append(b)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


@pytest.mark.parametrize("engine", ["auto", "python"])
@pytest.mark.parametrize(("size", "block_size", "slots", "message"), [
    (4096, 0, 32, "block_size 0: not positive"),
    (4097, 4096, 64, "not a multiple of 4096"),
    (8192, 4096, 63, "2 blocks need 64 bytes of slots, 63 given"),
])
def test_both_engines_reject_the_same_runs(engine, size, block_size, slots, message):
    d = Digester("sha256", b"", 1, engine=engine)
    with pytest.raises(ValueError, match=message):
        d.verify(bytes(size), block_size, bytes(slots))


def test_openssl_names_and_unknown_algorithms():
    assert native_hasher("blake2b-512", b"", 1).digest_size == 64
    assert native_hasher("sha3-256", b"", 0).slot_size == 32
    assert native_hasher("no-such-digest", b"", 1) is None  # Python's engine then
    with pytest.raises(ValueError, match="salt of 257 bytes"):
        _native.Hasher("sha256", bytes(257), 1)
    with pytest.raises(ValueError, match="hash_type 2"):
        _native.Hasher("sha256", b"", 2)


def test_a_failed_init_leaves_the_hasher_not_ready():
    """Each refused __init__ sets nothing: the object still fails check_ready, and a
    later good __init__ makes it whole."""
    hasher = _native.Hasher.__new__(_native.Hasher)
    for args in (("no-such-digest", b"", 1), ("sha256", bytes(257), 1), ("sha256", b"", 2)):
        with pytest.raises(ValueError):
            hasher.__init__(*args)
        for call in (lambda: hasher.digest(b"x"), lambda: hasher.slots(bytes(512), 512),
                     lambda: hasher.verify(bytes(512), 512, bytes(32))):
            with pytest.raises(RuntimeError, match="Hasher is not initialised"):
                call()
        assert hasher.digest_size == 0
    hasher.__init__("sha256", b"salt", 1)
    assert hasher.digest(b"x") == Digester("sha256", b"salt", 1, engine="python").digest(b"x")
    with pytest.raises(RuntimeError, match="already initialised"):
        hasher.__init__("sha256", b"", 1)


def test_module_constants():
    assert _native.READ_FAILED == -2 and digest.READ_FAILED == _native.READ_FAILED
    assert _native.DEFAULT_RELEASE_SIZE == digest.DEFAULT_RELEASE_SIZE == 64 * 1024
    native, pure = engines("sha256", b"", 1)
    assert native.native.release_size == pure.release_size == digest.DEFAULT_RELEASE_SIZE
    assert _native.Hasher.__module__ == "nbd_verity.format._native"


def test_engine_name_says_native_and_which_openssl():
    assert engine_name() == engine_name("sha256")
    assert engine_name().startswith("native (OpenSSL 3.")
    assert engine_name().endswith(", sha256: SHA-NI x2)" if _native.sha256_default_lanes()
                                  else ", sha256: EVP)")


def test_nbd_verity_pure_forces_the_python_engine():
    code = ("import sys; from nbd_verity.format import digest; "
            "print(digest.engine_name(), digest.Digester('sha256', b'', 1).engine, "
            "'nbd_verity.format._native' in sys.modules)")
    env = dict(os.environ, NBD_VERITY_PURE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["python", "python", "False"]


def test_fast_read_refuses_what_it_cannot_serve_and_hands_on_what_is_not_its():
    """FastRead (serve/fastpath.py's native frame) checks its geometry once, refuses to
    read before it is initialised and to be initialised twice, leaves a request over
    the threshold to beyond() and declines (None) an unaligned one or one whose leaf is
    not cached; the common request's bytes and counts are compared with the general
    path's through a real device (tests/server/serve/test_fastpath.py)."""
    from collections import OrderedDict, deque
    from types import SimpleNamespace

    fresh = _native.FastRead.__new__(_native.FastRead)
    with pytest.raises(RuntimeError, match="FastRead is not initialised"):
        fresh.read(bytearray(4096), 0)
    leaves = OrderedDict()
    args = dict(hasher=Digester("sha256", b"", 1).native, fd=0, block_size=4096,
                hpb_bits=7, slot_size=32, leaf_start=1, leaves=leaves,
                dispatcher=SimpleNamespace(table=(4096,) * 4), io_class=1, slot=2,
                latency=deque(maxlen=8), rows_of={}, rows=lambda: ("not", "rows"),
                sample_every=64, beyond=lambda buf, offset: ("beyond", len(buf), offset))
    for key, bad in (("block_size", 4095), ("sample_every", 3), ("hpb_bits", -1)):
        with pytest.raises(ValueError, match="out of range"):
            _native.FastRead(**{**args, key: bad})
    with pytest.raises(ValueError, match="not a file descriptor"):
        _native.FastRead(**{**args, "fd": -1})
    with pytest.raises(TypeError):
        _native.FastRead(**{**args, "leaves": []})
    fast = _native.FastRead(**args)
    assert fast.read(bytearray(8192), 4096) == ("beyond", 8192, 4096)
    assert fast.read(bytearray(4096), 1) is None and fast.read(bytearray(100), 0) is None
    assert fast.read(bytearray(4096), 0) is None  # leaf 1 is not cached
    leaves[1] = bytes(128 * 32)
    with pytest.raises(TypeError, match="rows"):  # cached: the thread's rows are asked for
        fast.read(bytearray(4096), 0)
    with pytest.raises(RuntimeError, match="already initialised"):
        fast.__init__(**args)
