"""Salted digests for verity formats 0 and 1, with the salted state computed once.

Format 1 (veritysetup's default) hashes salt ‖ block; format 0 (Chrome OS) hashes
block ‖ salt [cryptsetup lib/verity/verity_hash.c verify_hash_block, kernel verity_hash].
For format 1 the salted prefix is absorbed once and the state copied per block, as the
kernel does with its pre-salted initial state; hashlib releases the GIL while it hashes
inputs of 2 KiB and more, so several threads hash blocks in parallel.

Two engines compute the same bytes. The native one (nbd_verity.format._native, C on OpenSSL's
EVP API) hashes a whole run of blocks in one call and releases the GIL once per run when
the run is long enough to pay; it is used for every algorithm OpenSSL can compute. For
sha256 on a CPU with the x86 SHA extensions it hashes two blocks at a time, interleaved
(sha256x.c: "SHA-NI x2"), unless NBD_VERITY_NO_SHANI=1 keeps it on EVP. The
pure-Python one (hashlib) is the reference, and the fallback: for an algorithm OpenSSL
lacks, where the extension was not built, and when NBD_VERITY_PURE=1 forces it.
"""

from __future__ import annotations

import functools
import hashlib
import os

from ..errors import ConfigError
from ..limits import salt_size_problem

PURE_ENV = "NBD_VERITY_PURE"  # set to 1 to force the pure-Python engine
NO_SHANI_ENV = "NBD_VERITY_NO_SHANI"  # set to 1: sha256 on EVP, as on a CPU without SHA-NI
# Bytes from which a run is hashed with the GIL released (default: DEFAULT_RELEASE_SIZE);
# for measuring that threshold (bench/native_gil.py), not a setting.
RELEASE_ENV = "NBD_VERITY_RELEASE_SIZE"
# Runs of at least this many bytes are hashed with the GIL released, by either engine:
# _native.c's DEFAULT_RELEASE_SIZE, where the measurement is written down.
DEFAULT_RELEASE_SIZE = 64 << 10


def _load_native():
    """The compiled module, or None (not built, or the pure engine forced)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from . import _native
    except ImportError:
        return None
    return _native


_native = _load_native()
# read_verify's verdict when its read failed or ended early (the caller reads again).
READ_FAILED = _native.READ_FAILED if _native is not None else None
# 0: an image read over NBD is read and verified with separate calls (read_idle, verify),
# for measuring the one native call against them (bench/storage.py), not a setting.
NATIVE_NBD_ENV = "NBD_VERITY_NATIVE_NBD"


def native_nbd_ready() -> bool:
    """Whether Hasher.nbd_read_verify runs here: the native engine is built and finds
    libnbd's functions in the copy Python's nbd module loaded (import nbd first: an NBD
    source has), and the environment does not turn it off."""
    return (_native is not None and os.environ.get(NATIVE_NBD_ENV, "") != "0"
            and _native.nbd_ready())

# veritysetup's algorithm names mapped to hashlib's, for those hashlib has.
_HASHLIB_NAMES = {
    "md5": "md5",
    "sha1": "sha1",
    "sha224": "sha224",
    "sha256": "sha256",
    "sha384": "sha384",
    "sha512": "sha512",
    "sha3-224": "sha3_224",
    "sha3-256": "sha3_256",
    "sha3-384": "sha3_384",
    "sha3-512": "sha3_512",
    "blake2b-512": "blake2b",
    "blake2s-256": "blake2s",
    "ripemd160": "ripemd160",
    "sm3": "sm3",
}

# OpenSSL's names where they differ from veritysetup's (the others are spelt alike).
_OPENSSL_NAMES = {"blake2b-512": "BLAKE2B-512", "blake2s-256": "BLAKE2S-256"}


def supported_algorithms() -> list[str]:
    """The veritysetup algorithm names this Python's hashlib can compute."""
    names = []
    for name, lib_name in _HASHLIB_NAMES.items():
        try:
            hashlib.new(lib_name)
        except ValueError:
            continue
        names.append(name)
    return names


def normalize_algorithm(name: str) -> str:
    """Lower-case an algorithm name as veritysetup does, and check hashlib has it."""
    lowered = name.lower()
    if lowered not in _HASHLIB_NAMES or lowered not in supported_algorithms():
        known = ", ".join(supported_algorithms())
        raise ConfigError(f"hash: unsupported algorithm {name!r} (supported: {known})")
    return lowered


# Digester engines by name, and the sha256 streams each asks the native Hasher for:
# -1 its default (SHA-NI x2 where it runs, else EVP), 0 OpenSSL's EVP, 1-3 SHA-NI streams.
ENGINES = {"auto": -1, "evp": 0, "sha-ni x1": 1, "sha-ni x2": 2, "sha-ni x3": 3}


def native_hasher(algorithm: str, salt: bytes, hash_type: int, lanes: int = -1):
    """A native Hasher for a normalized algorithm name, or None when the pure-Python
    engine must do (forced, not built, an algorithm OpenSSL cannot compute, or SHA-NI
    streams asked for where they cannot run)."""
    if _native is None:
        return None
    try:
        return _native.Hasher(_OPENSSL_NAMES.get(algorithm, algorithm), salt, hash_type,
                              lanes=lanes)
    except ValueError:
        return None


def engines_present(algorithm: str) -> list[str]:
    """The Digester engines that can hash this algorithm here, "python" first: the
    equality tests compare every one of them with it."""
    names = ["python"]
    for name, lanes in ENGINES.items():
        if name != "auto" and native_hasher(algorithm, b"", 1, lanes) is not None:
            names.append(name)
    return names


def _lanes_name(lanes: int) -> str:
    """What hashes sha256 for a Hasher's lanes: 'SHA-NI x2', or 'EVP' for 0."""
    return f"SHA-NI x{lanes}" if lanes else "EVP"


def engine_name(algorithm: str | None = None) -> str:
    """Which engine hashes (for an algorithm, or in general), as --version and serve's
    start-up line say it: 'native (OpenSSL 3.0.x, sha256: SHA-NI x2)', 'native (OpenSSL
    3.0.x)' for another algorithm, or 'python'."""
    if _native is None:
        return "python"
    if algorithm is not None and native_hasher(normalize_algorithm(algorithm), b"", 1) is None:
        return "python"
    openssl = " ".join(_native.openssl_version().split()[:2])
    if algorithm is not None and normalize_algorithm(algorithm) != "sha256":
        return f"native ({openssl})"
    return f"native ({openssl}, sha256: {_lanes_name(_native.sha256_default_lanes())})"


def parse_salt(text: str) -> bytes:
    """Decode a salt given as hex; '-' or '' means no salt (veritysetup's spelling)."""
    if text in ("-", ""):
        return b""
    try:
        salt = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"salt: {text!r} is not a hex string") from None
    problem = salt_size_problem(len(salt))
    if problem:
        raise ConfigError(problem)
    return salt


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (format 1 pads each digest to it)."""
    return 1 << (n - 1).bit_length()


class Digester:
    """Computes salted digests of blocks for one (algorithm, salt, format) triple.

    With the native engine, `native` is its Hasher and the public methods are the
    Hasher's own (bound once here, so a call costs no Python frame); the verifier's hot
    path calls `native.read_verify` directly. Without it, `native` is None and the
    methods below run on hashlib. engine="python" asks for hashlib whatever is built,
    "evp" for the native engine on OpenSSL's EVP even for sha256, "sha-ni x1".."x3" for
    that many SHA-NI streams (ValueError where they cannot run): the equality tests
    compare them all in one process.

    The parameters are those VerityParams.check() accepted: the one place that validates
    them (hash type, salt size; the algorithm is only mapped to hashlib's name here).
    Both engines release the GIL for a run of at least release_size bytes and hold it
    for a shorter one."""

    def __init__(self, algorithm: str, salt: bytes, hash_type: int,
                 engine: str = "auto") -> None:
        self.algorithm = normalize_algorithm(algorithm)
        self.salt = bytes(salt)
        self.hash_type = hash_type
        self._base = hashlib.new(_HASHLIB_NAMES[self.algorithm])
        self.digest_size = self._base.digest_size
        # Slot size inside a hash block: padded to a power of two in format 1, packed in 0.
        self.slot_size = next_pow2(self.digest_size) if hash_type == 1 else self.digest_size
        self._pad = bytes(self.slot_size - self.digest_size)
        if hash_type == 1:
            self._base.update(self.salt)
        if engine != "python" and engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: not 'python' or one of {', '.join(ENGINES)}")
        self.native = (native_hasher(self.algorithm, self.salt, hash_type, ENGINES[engine])
                       if engine != "python" else None)
        if self.native is None and engine.startswith("sha-ni"):
            raise ValueError(f"engine {engine!r}: SHA-NI cannot hash {self.algorithm} here")
        if self.native is not None and self.native.digest_size != self.digest_size:
            self.native = None  # never trust an engine that disagrees on the digest size
        self.release_size = int(os.environ.get(RELEASE_ENV) or DEFAULT_RELEASE_SIZE)
        if self.native is not None:
            self.native.release_size = self.release_size
            self.digest = self.native.digest
            self.slots_of = self.slots_of_held = self.native.slots
            self.verify = self.native.verify  # releases the GIL by run length itself

    @property
    def engine(self) -> str:
        """'native' or 'python': the engine this digester runs on."""
        return "python" if self.native is None else "native"

    @property
    def implementation(self) -> str:
        """What computes this digester's runs: 'SHA-NI x2', 'OpenSSL EVP' or 'hashlib'."""
        if self.native is None:
            return "hashlib"
        return _lanes_name(self.native.lanes) if self.native.lanes else "OpenSSL EVP"

    def digest(self, block) -> bytes:
        """The salted digest of one block (any bytes-like object)."""
        h = self._base.copy()
        h.update(block)
        if self.hash_type == 0:
            h.update(self.salt)
        return h.digest()

    def stored(self, hash_block, offset: int) -> bytes:
        """The digest held in the slot at offset of a hash block: its first digest_size
        bytes (format 1's padding is not part of it; the kernel compares digest_size)."""
        return bytes(hash_block[offset:offset + self.digest_size])

    def differing_slots(self, ours, theirs):
        """Indices of the slots of ours whose digest differs from the same slot of
        theirs, in order: the one home of "compare only the digest's bytes"."""
        size, step = self.digest_size, self.slot_size
        for i, at in enumerate(range(0, len(ours), step)):
            if ours[at:at + size] != theirs[at:at + size]:
                yield i

    def slots_of(self, buf, block_size: int) -> bytes:
        """Slots of every whole block in buf, a contiguous run of blocks; hot loop."""
        mv = memoryview(buf)
        base, salt, pad, v0 = self._base, self.salt, self._pad, self.hash_type == 0
        out = []
        append = out.append
        for off in range(0, len(mv) - block_size + 1, block_size):
            h = base.copy()
            h.update(mv[off : off + block_size])
            if v0:
                h.update(salt)
            append(h.digest())
            if pad:
                append(pad)
        return b"".join(out)

    def slots_of_held(self, buf, block_size: int) -> bytes:
        """slots_of, hashing with the GIL held: each block is fed in pieces below
        hashlib's 2048-byte threshold for releasing the GIL (multiples of 64 bytes, the
        SHA block). Many threads then hash one after another instead of handing the GIL
        over at every block, which costs more than it gains when many nbdkit threads
        contend for it (and releasing allocates a lock per hash object)."""
        mv = memoryview(buf)
        base, salt, pad, v0 = self._base, self.salt, self._pad, self.hash_type == 0
        cuts = _held_cuts(block_size)
        out = []
        append = out.append
        for off in range(0, len(mv) - block_size + 1, block_size):
            h = base.copy()
            update = h.update
            for start, stop in cuts:
                update(mv[off + start:off + stop])
            if v0:
                update(salt)
            append(h.digest())
            if pad:
                append(pad)
        return b"".join(out)

    def verify(self, buf, block_size: int, expected) -> int:
        """-1 if every block of buf (a whole number of blocks) has the digest held at the
        start of its slot in expected, else the index of the first block that differs.
        Padding is not compared (the kernel compares digest_size bytes)."""
        _check_run(len(buf), block_size, len(expected), self.slot_size)
        hash_run = self.slots_of if len(buf) >= self.release_size else self.slots_of_held
        slots = hash_run(buf, block_size)
        expected = bytes(expected)
        if slots == expected[:len(slots)]:
            return -1
        return next(self.differing_slots(slots, expected), -1)



def _check_run(size: int, block_size: int, expected_size: int, slot_size: int) -> None:
    """The argument checks of the native verify(), so both engines reject alike."""
    if block_size <= 0:
        raise ValueError(f"block_size {block_size}: not positive")
    if size % block_size:
        raise ValueError(f"buffer of {size} bytes is not a multiple of {block_size}")
    if expected_size < size // block_size * slot_size:
        raise ValueError(f"{size // block_size} blocks need {size // block_size * slot_size} "
                         f"bytes of slots, {expected_size} given")


HELD_PIECE = 1984  # 31 * 64: under hashlib's GIL-release threshold (2048), whole SHA blocks


@functools.lru_cache(maxsize=16)
def _held_cuts(block_size: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) pieces of a block, each at most HELD_PIECE bytes."""
    return tuple((start, min(start + HELD_PIECE, block_size))
                 for start in range(0, block_size, HELD_PIECE))
