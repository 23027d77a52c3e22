"""cryptsetup's verity-compat-test known answers: 8 MiB of zeros, the root hash of each
geometry. Shared by the unit tests (our builder) and the oracle tests (veritysetup).
"""

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
