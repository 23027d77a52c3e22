"""Small parsers shared by the CLI and the server."""

from __future__ import annotations

from .errors import ConfigError


def root_digest(text: str, digest_size: int) -> bytes:
    """A root hash given as hex, checked against the algorithm's digest size."""
    try:
        root = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"root-hash: {text!r} is not a hex string") from None
    if len(root) != digest_size:
        raise ConfigError(f"root-hash: {len(root)} bytes, the algorithm's digest is "
                          f"{digest_size} bytes")
    return root
