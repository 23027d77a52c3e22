"""Find a root hash, its signature and the hash image beside a data image, as systemd does.

Mirrors systemd-dissect (dissect-image.c, verity_settings_load()): for IMAGE (with a
`.raw` suffix dropped, build_auxiliary_path()) it looks at
  - the root hash: the `user.verity.roothash` xattr of IMAGE, else `IMAGE.roothash`;
    failing both, the `/usr` pair `user.verity.usrhash` / `IMAGE.usrhash`;
  - its signature, only once a root hash is known: `IMAGE.roothash.p7s` (DER) for a root
    hash found as "root", `IMAGE.usrhash.p7s` for one found as "usr";
  - the hash image: `IMAGE.verity`.
A root hash file is read like read_one_line_file() + unhexmem(): the first line only,
white space anywhere ignored, upper or lower case, at least 16 bytes. Upper case is
accepted because systemd decodes the hex to bytes and re-encodes it in lower case
before checking the signature: the signed text is always the lower-case hex.
An empty signature file is refused, as systemd refuses it.

verity.sig is the Discoverable Partitions' signature partition as a JSON object
(`rootHash` hex, `signature` base64 DER, optional `certificateFingerprint`), NUL-padded
to its partition size; a NUL followed by anything else is refused, as systemd does.

Every function takes paths as strings and reads through a `read` function (path ->
bytes, or None when absent), so that images named by URL can be served later by passing
another reader. Nothing here checks a signature: see signature.py.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SidecarError
from ..files import write_atomically
from ..sources.remote import REMOTE_SCHEMES
from ..sources.source import read_small_file

MAX_SIDECAR_SIZE = 4 << 20  # systemd refuses a verity signature partition larger than 4 MiB
MIN_ROOT_HASH_SIZE = 16  # systemd: shorter than an sd_id128_t is not a root hash
WHITESPACE = " \t\n\r"

Reader = Callable[[str], "bytes | None"]


def read_local(path: str) -> bytes | None:
    """A local file's bytes, or None when it does not exist."""
    return read_small_file(path, MAX_SIDECAR_SIZE, SidecarError, missing_ok=True)


def xattr_local(path: str, name: str) -> bytes | None:
    """An extended attribute of a local file, or None where there is none (or no xattrs)."""
    try:
        return os.getxattr(path, name)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOENT, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise SidecarError(f"{path}: xattr {name}: {e.strerror}") from None


def exists_local(path: str) -> bool:
    return os.path.exists(path)


def auxiliary_path(image: str, suffix: str) -> str:
    """IMAGE with SUFFIX appended, a `.raw` suffix dropped first (build_auxiliary_path).
    For an http(s) or s3 URL, to its path: its query (a token the store asks of every
    object) stays as it is, and goes with the sidecar's URL too."""
    parts = urllib.parse.urlsplit(image)
    if parts.scheme in REMOTE_SCHEMES and "://" in image:
        path = parts.path.removesuffix(".raw") + suffix
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
    return image.removesuffix(".raw") + suffix


def parse_root_hash_text(blob: bytes | str, source: str) -> str:
    """A root hash file's text as systemd reads it; returns the lowercase hex."""
    text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
    for end in "\n\r\0":  # read_line() stops at any of these
        text = text.split(end, 1)[0]
    return parse_hex(text, source, "root hash")


def parse_hex(text: str, source: str, what: str) -> str:
    """unhexmem(): hex digits of either case, white space anywhere ignored."""
    digits = "".join(c for c in text if c not in WHITESPACE)
    if len(digits) % 2:
        raise SidecarError(f"{source}: {what} has an odd number of hex digits")
    try:
        value = bytes.fromhex(digits)
    except ValueError:
        raise SidecarError(f"{source}: {what} {text.strip()[:80]!r} is not hex") from None
    if len(value) < MIN_ROOT_HASH_SIZE:
        raise SidecarError(f"{source}: {what} of {len(value)} bytes is too short "
                           f"(at least {MIN_ROOT_HASH_SIZE})")
    return value.hex()


@dataclass(frozen=True)
class Sidecars:
    """What was found beside an image; None where nothing was."""

    image: str
    root_hash: str | None = None  # lowercase hex
    root_hash_source: str | None = None  # the file, or "IMAGE (xattr user.verity.roothash)"
    partition: str | None = None  # "root" or "usr": which pair of names matched
    signature: bytes | None = None  # DER, not yet checked
    signature_path: str | None = None
    hash_image: str | None = None


def find_root_hash(image: str, read: Reader = read_local,
                   xattr: Callable[[str, str], bytes | None] | None = xattr_local
                   ) -> tuple[str, str, str] | None:
    """(hex, source, partition) of the first root hash found for IMAGE, else None."""
    for partition, name in (("root", "roothash"), ("usr", "usrhash")):
        attr = f"user.verity.{name}"
        value = xattr(image, attr) if xattr is not None else None
        source = f"{image} (xattr {attr})"
        if value is None:
            source = auxiliary_path(image, f".{name}")
            value = read(source)
        if value is not None:
            return parse_root_hash_text(value, source), source, partition
    return None


def find_sidecars(image: str, read: Reader = read_local,
                  exists: Callable[[str], bool] = exists_local,
                  xattr: Callable[[str, str], bytes | None] | None = xattr_local,
                  root_hash_given: bool = False) -> Sidecars:
    """Everything systemd-dissect would find beside IMAGE. With ROOT_HASH_GIVEN the root
    hash is not looked up (the caller has one), but its signature still is: first as
    "root", then as "usr", as systemd does when it does not know which it is."""
    root_hash = source = partition = None
    if not root_hash_given:
        found = find_root_hash(image, read, xattr)
        if found is not None:
            root_hash, source, partition = found
    signature = signature_path = None
    if root_hash_given or root_hash is not None:
        signature, signature_path, partition = _find_signature(image, read, partition)
    hash_image = auxiliary_path(image, ".verity")
    return Sidecars(image=image, root_hash=root_hash, root_hash_source=source,
                    partition=partition, signature=signature,
                    signature_path=signature_path,
                    hash_image=hash_image if exists(hash_image) else None)


def _find_signature(image: str, read: Reader, partition: str | None):
    """(DER, path, partition) of the first signature file found, else (None, None, partition)."""
    for candidate_partition in (partition,) if partition else ("root", "usr"):
        name = "roothash" if candidate_partition == "root" else "usrhash"
        path = auxiliary_path(image, f".{name}.p7s")
        signature = read(path)
        if signature is not None:
            if not signature:
                raise SidecarError(f"{path}: empty signature file")
            return signature, path, candidate_partition
    return None, None, partition


@dataclass(frozen=True)
class VeritySig:
    """The content of a verity.sig JSON object."""

    root_hash: str  # lowercase hex
    signature: bytes  # DER
    certificate_fingerprint: str | None = None  # lowercase hex SHA-256, when given


def parse_verity_sig(blob: bytes, source: str) -> VeritySig:
    """A verity.sig object, NUL padding allowed after it (and nothing else after a NUL)."""
    if len(blob) > MAX_SIDECAR_SIZE:
        raise SidecarError(f"{source}: larger than {MAX_SIDECAR_SIZE} bytes")
    end = blob.find(b"\0")
    if end >= 0:
        if blob[end:].strip(b"\0"):
            raise SidecarError(f"{source}: data after the NUL padding")
        blob = blob[:end]
    try:
        value = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SidecarError(f"{source}: not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise SidecarError(f"{source}: not a JSON object")
    root_hash = parse_hex(_string(value, "rootHash", source), source, "rootHash")
    try:
        signature = base64.b64decode(_string(value, "signature", source).translate(
            {ord(c): None for c in WHITESPACE}), validate=True)
    except binascii.Error:
        raise SidecarError(f"{source}: signature is not base64") from None
    if not signature:
        raise SidecarError(f"{source}: empty signature")
    fingerprint = None
    if "certificateFingerprint" in value:
        fingerprint = _string(value, "certificateFingerprint", source).replace(":", "").lower()
        if len(fingerprint) != 64 or any(c not in "0123456789abcdef" for c in fingerprint):
            raise SidecarError(f"{source}: certificateFingerprint is not a SHA-256 in hex")
    return VeritySig(root_hash, signature, fingerprint)


def _string(value: dict, key: str, source: str) -> str:
    if key not in value:
        raise SidecarError(f"{source}: no '{key}' field")
    if not isinstance(value[key], str):
        raise SidecarError(f"{source}: '{key}' is not a string")
    return value[key]


def read_signature_file(path: str, read: Reader = read_local) -> tuple[bytes, VeritySig | None]:
    """A signature given by name: DER (`.p7s`), or a verity.sig JSON object (it starts
    with '{'). Returns the DER and, for JSON, the whole object (its rootHash too)."""
    blob = read(path)
    if blob is None:
        raise SidecarError(f"{path}: no such file")
    if not blob:
        raise SidecarError(f"{path}: empty signature file")
    if blob.lstrip(WHITESPACE.encode()).startswith(b"{"):
        sig = parse_verity_sig(blob, path)
        return sig.signature, sig
    return blob, None


def write_file(path: str, payload: bytes) -> None:
    """Write payload to path whole: a file made by mkstemp beside it, renamed over it."""
    write_atomically(path, payload)


def write_sidecars(image: str, root_hex: str, signature: bytes) -> tuple[str, str]:
    """Write IMAGE.roothash (the hex, no newline: the signed bytes) and IMAGE.roothash.p7s
    where find_sidecars (and systemd-dissect) look; return their paths."""
    roothash, p7s = auxiliary_path(image, ".roothash"), auxiliary_path(image, ".roothash.p7s")
    write_file(roothash, root_hex.encode("ascii"))
    write_file(p7s, signature)
    return roothash, p7s
