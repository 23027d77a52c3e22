"""The format's and the server's limits, in one place (as go-dmverity's params.go).

Every module that checks a field against a limit imports the rule from here; messages
quote the same numbers. VerityParams.check() is the one entry that applies them to a
device's parameters (as fsverity-utils validates at libfsverity_compute_digest); the
superblock applies the same rules to what it read, in veritysetup's wording. The on-disk
limits are veritysetup's [cryptsetup lib/verity/verity.c, VERITY_BLOCK_SIZE_OK,
VERITY_MAX_LEVELS]; the request limit is the NBD one we advertise to nbdkit.
"""

from __future__ import annotations

import os

MIN_BLOCK_SIZE = 512  # bytes, data and hash blocks alike
MAX_BLOCK_SIZE = 512 * 1024
MAX_SALT_SIZE = 256  # bytes: the superblock's salt field
MAX_LEVELS = 63  # the kernel's DM_VERITY_MAX_LEVELS
# Offsets and sizes are 64-bit in the format (cryptsetup checks against 2**64), but no file
# or device can reach past 2**63 - 1.
MAX_OFFSET = (1 << 63) - 1
HASH_OFFSET_ALIGN = 512  # --hash-offset must be a multiple of this
# The largest NBD request: what we advertise (block_size maximum), what NBD servers
# (nbdkit included) accept from us, and the step of tune's NBD_CMD_CACHE warm-up.
MAX_REQUEST_SIZE = 32 << 20
HASH_TYPES = (0, 1)  # format 0 (Chrome OS) and 1 (veritysetup's default)

BLOCK_SIZE_RULE = f"a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}"


def block_size_ok(size: int) -> bool:
    """veritysetup's VERITY_BLOCK_SIZE_OK: a power of two from 512 B to 512 KiB."""
    return MIN_BLOCK_SIZE <= size <= MAX_BLOCK_SIZE and size & (size - 1) == 0


def block_size_problem(name: str, size: int) -> str | None:
    """The message for a bad block size (None when it is fine), the same everywhere."""
    return None if block_size_ok(size) else f"{name}: {size} is not {BLOCK_SIZE_RULE}"


def hash_type_ok(hash_type: int) -> bool:
    return hash_type in HASH_TYPES


def salt_size_ok(size: int) -> bool:
    return 0 <= size <= MAX_SALT_SIZE


def hash_offset_ok(offset: int) -> bool:
    """veritysetup's rule: the superblock or tree starts on a 512-byte boundary."""
    return offset >= 0 and not offset % HASH_OFFSET_ALIGN


def salt_size_problem(size: int) -> str | None:
    """The message for a salt too long (None when it fits)."""
    return None if salt_size_ok(size) else (f"salt: {size} bytes exceeds the maximum of "
                                            f"{MAX_SALT_SIZE}")


def switched_off(env: str) -> bool:
    """Whether an on/off switch of the environment (NBD_VERITY_FAST_PATH and the like,
    for tests and measurements; none is a setting) is off: 0, false, no or off."""
    return os.environ.get(env, "").strip().lower() in ("0", "false", "no", "off")
