"""Which image a device shows, and whether a server may serve it.

A device shows one image for its whole life: the root hash and size the first server
named in its handshake (or --root-hash). It is kept in the device's backend identifier,
"nbd-verity:ROOT_HASH:SIZE", where a later attach finds it to adopt the device, and the
kernel refuses a reconfigure that does not repeat it. A server that names another root
hash, another size or none at all (not an nbd-verity server) is never handed over.
"""

from __future__ import annotations

from dataclasses import dataclass

from .handshake import Negotiated

BACKEND_PREFIX = "nbd-verity:"


@dataclass(frozen=True)
class Identity:
    """The image a device shows: its root hash and size. No server of another is used."""

    root_hash: str
    size: int

    @property
    def backend(self) -> str:
        return f"{BACKEND_PREFIX}{self.root_hash}:{self.size}"

    @classmethod
    def from_backend(cls, text: str | None) -> Identity | None:
        if not text or not text.startswith(BACKEND_PREFIX):
            return None
        root, _, size = text[len(BACKEND_PREFIX):].rpartition(":")
        return cls(root, int(size)) if root and size.isdigit() else None

    def refuses(self, got: Negotiated) -> str | None:
        """Why a negotiated server cannot serve this device, None if it can."""
        if got.root_hash is None:
            return "it names no root hash (not an nbd-verity server)"
        if got.root_hash != self.root_hash:
            return f"it serves another image (root hash {got.root_hash[:16]}...)"
        if got.size != self.size:
            return f"its export has {got.size} bytes, the device {self.size}"
        return None


class FirstServer:
    """What the first server must show: a root hash (--root-hash's, if given), any size."""

    def __init__(self, root_hash: str | None) -> None:
        self.root_hash = root_hash.lower() if root_hash else None

    def refuses(self, got: Negotiated) -> str | None:
        if got.root_hash is None:
            return "it names no root hash (not an nbd-verity server)"
        if self.root_hash is not None and got.root_hash != self.root_hash:
            return f"it serves another image (root hash {got.root_hash[:16]}...)"
        return None
