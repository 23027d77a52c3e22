"""The one exception root of nbd-verity and its tree.

    VerityError                 anything nbd-verity refuses, with a one-line message
     ├── ConfigError            a bad option, plugin key or control value ("KEY: problem")
     │    ├── SidecarError      a malformed IMAGE.roothash, IMAGE.roothash.p7s or verity.sig
     │    └── SignatureError    a root-hash signature we refuse (malformed, untrusted, mismatch)
     │         └── NoTrustedCertificates   no certificate to check a signature against
     ├── FormatError            an image that is not a valid verity layout
     │    ├── SuperblockError   a superblock defect (magic, version, hash type, sizes)
     │    └── PartitionTableError  a GPT that is missing, damaged, or holds no verity triple
     ├── ImageIOError           an image that cannot be opened or read (missing, truncated)
     ├── AttachError            attach: a server or the kernel's NBD driver refused a step
     └── CorruptionError        a block whose digest does not match the trusted tree
          ├── DataCorruption    a data block (the kernel's "data block N is corrupted")
          └── HashCorruption    a hash block ("metadata block N is corrupted")

The library raises these; only the edges (CLI, nbdkit plugin, control socket) translate
them into exit codes, errno values or error replies.
"""


class VerityError(Exception):
    """Root of every error nbd-verity reports to a user."""


class AttachError(VerityError):
    """attach/detach: a server that cannot be used (unreachable, another image) or a
    request the kernel's NBD driver refused."""


class ConfigError(VerityError):
    """An option, plugin key or control value that is missing or malformed."""


class SidecarError(ConfigError):
    """A file found beside an image (root hash, signature, verity.sig) that is malformed."""


class SignatureError(ConfigError):
    """A root-hash signature that is malformed, not from a trusted signer, or not over the
    root hash: always a refusal to start, never a warning."""


class NoTrustedCertificates(SignatureError):
    """No trusted certificate was found where we looked, so no signature can be accepted."""


class FormatError(VerityError):
    """A hash image or geometry that is not a valid verity layout."""


class SuperblockError(FormatError):
    """A verity superblock that fails one of veritysetup's checks."""


class PartitionTableError(FormatError):
    """A disk image whose GUID partition table is missing or damaged, or that holds no
    Discoverable Partitions verity triple to serve."""


class ImageIOError(VerityError):
    """An image that cannot be opened, or that is shorter than its geometry needs."""


class CorruptionError(VerityError):
    """A block whose digest does not match the trusted tree."""

    kind = "block"

    def __init__(self, block_index: int, detail: str = "") -> None:
        self.block_index = block_index
        self.detail = detail
        super().__init__(self.describe())

    def describe(self) -> str:
        """The kernel's wording: '<kind> block N is corrupted'."""
        text = f"{self.kind} block {self.block_index} is corrupted"
        return f"{text} ({self.detail})" if self.detail else text


class DataCorruption(CorruptionError):
    """A data block whose digest differs from its verified level-0 slot."""

    kind = "data"


class HashCorruption(CorruptionError):
    """A hash block whose digest differs from its verified parent slot (or the root)."""

    kind = "metadata"

    def __init__(self, block_index: int, level: int, detail: str = "") -> None:
        self.level = level
        super().__init__(block_index, detail or f"level {level}")
