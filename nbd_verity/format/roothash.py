"""The trusted root hash: parsed from hex text, or read from a file, in one way.

The CLI (`verify`, `serve`) and the plugin keys (`root-hash`, `root-hash-file`) both come
here, so a root hash given either way is read and checked the same.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..sources.source import read_small_file

# A root hash file holds one hex digest (at most 64 bytes, 128 hex digits) and white
# space: anything this large is not one.
MAX_ROOT_HASH_FILE_SIZE = 4096


def root_bytes(text: str) -> bytes:
    """A root hash given as hex text (any case), as bytes; its length is checked later."""
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"root-hash: {text!r} is not a hex string") from None


def root_digest(text: str, digest_size: int) -> bytes:
    """A root hash given as hex, checked against the algorithm's digest size."""
    root = root_bytes(text)
    if len(root) != digest_size:
        raise ConfigError(f"root-hash: {len(root)} bytes, the algorithm's digest is "
                          f"{digest_size} bytes")
    return root


def read_root_hash_file(path: str) -> str:
    """The hex text of a root hash file (surrounding white space dropped)."""
    blob = read_small_file(path, MAX_ROOT_HASH_FILE_SIZE, ConfigError,
                           label=f"root-hash-file: {path}")
    try:
        return blob.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"root-hash-file: {path}: not a text file") from None


def root_hash_text(root_hash: str | None, root_hash_file: str | None,
                   required: bool = True) -> str | None:
    """The root hash's hex text from exactly one of the two ways of giving it; None when
    neither was given and it is not REQUIRED (it may then be found beside the image)."""
    if root_hash is not None and root_hash_file is not None:
        raise ConfigError("root-hash: give it directly or with root-hash-file, not both")
    if root_hash_file is not None:
        text = read_root_hash_file(root_hash_file)
    elif root_hash is not None:
        text = root_hash.strip()
    elif required:
        raise ConfigError("root-hash: missing (give a root hash or a root-hash-file)")
    else:
        return None
    root_bytes(text)  # not hex: say so now, before anything is opened or looked up
    return text
