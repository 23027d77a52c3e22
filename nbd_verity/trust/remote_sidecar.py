"""Sidecars beside an image named by an http(s) or s3:// URL: URL.verity, URL.roothash and
URL.roothash.p7s, found by the same rules as for a local file (sidecar.find_sidecars),
read over HTTP, or from the same bucket (sources/s3.py), instead of from the file system.

`serve https://host/disk.raw` with no HASH or ROOT_HASH calls discover() before it
starts its captive upstreams: the hash image stays a URL (upstream.attach serves it like
the data), the root hash becomes its hex, and a signature is put in an anonymous memory
file the exec'd nbdkit inherits, handed to the plugin as root-hash-signature, so it is
checked exactly as a local one and no file of it is left behind. For s3://BUCKET/KEY
the sidecars are the objects KEY.verity, KEY.roothash and KEY.roothash.p7s in the same
bucket, read with the same endpoint and credentials
(the caller passes sources.s3.sidecar_reader as read and exists).

Nothing fetched here is trusted: a root hash is only as good as its signature, which the
plugin checks against the trusted certificates (and requires with require-signatures).
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from ..errors import SidecarError
from ..sources.remote import REMOTE_SCHEMES, basic_auth, redact, redacted
from ..sources.source import read_capped
from .sidecar import find_sidecars

MAX_REMOTE_SIDECAR = 1 << 20  # a root hash or a PKCS#7 signature is far smaller
TIMEOUT = 10.0  # seconds per request
ABSENT = (404, 410)


def is_http(text: str) -> bool:
    return urllib.parse.urlsplit(text).scheme in ("http", "https")


def has_remote_sidecars(text: str) -> bool:
    """An image URL whose sidecars discover() can look for (http, https, s3)."""
    return urllib.parse.urlsplit(text).scheme in REMOTE_SCHEMES


def _open(url: str, method: str = "GET", headers: dict | None = None):
    """The response, None when the server says the file is absent; else one clear error.
    A user part goes as HTTP basic auth, as curl sends it, and only to URL's own server:
    a header no redirect carries (urllib would send a user part nowhere: it names no
    host it can resolve)."""
    request = urllib.request.Request(redacted(url), method=method, headers=headers or {})
    for name, value in basic_auth(url).items():
        request.add_unredirected_header(name, value)
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in ABSENT:
            return None
        raise SidecarError(f"{redact(url)}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise SidecarError(f"{redact(url)}: {e.reason}") from None
    except (OSError, ValueError) as e:
        raise SidecarError(f"{redact(url)}: {e}") from None


def http_read(url: str) -> bytes | None:
    """A small file's bytes (at most 1 MiB), or None when the server has none."""
    response = _open(url)
    if response is None:
        return None
    with response:
        length = response.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > MAX_REMOTE_SIDECAR:
            raise SidecarError(f"{redact(url)}: larger than {MAX_REMOTE_SIDECAR} bytes")
        return read_capped(response, MAX_REMOTE_SIDECAR, redact(url), SidecarError)


def http_head(url: str, size: int) -> bytes:
    """The first SIZE bytes of URL (a ranged GET; fewer if it is shorter), b"" when the
    server has no such file: enough to see whether an image starts with a GPT."""
    response = _open(url, headers={"Range": f"bytes=0-{size - 1}"})
    if response is None:
        return b""
    with response:
        try:
            return response.read(size)
        except OSError as e:
            raise SidecarError(f"{redact(url)}: {e}") from None


def http_exists(url: str) -> bool:
    """Whether the server has URL: HEAD, or a one-byte ranged GET where HEAD is refused."""
    try:
        response = _open(url, "HEAD")
    except SidecarError:
        response = _open(url, headers={"Range": "bytes=0-0"})
    if response is None:
        return False
    response.close()
    return True


@dataclass(frozen=True)
class RemoteSidecars:
    """What discover() fills in; None where the caller's value stays."""

    hash_image: str | None = None  # URL.verity
    root_hash: str | None = None  # lowercase hex from URL.roothash
    signature: bytes | None = None  # URL.roothash.p7s (DER, unchecked): see write_private
    found: tuple[str, ...] = ()  # the URLs used, for messages


def discover(data: str, hash_image: str | None, root_hash_given: bool,
             signature_given: bool, read=http_read, exists=http_exists) -> RemoteSidecars:
    """Look beside the URL DATA for what was not given (see the module docstring).
    read and exists reach DATA's store: HTTP here, sources.s3.sidecar_reader for s3://
    (passed in by the caller: trust/ imports nothing below the top of the package)."""
    found = find_sidecars(data, read=read, exists=exists, xattr=None,
                          root_hash_given=root_hash_given)
    used: list[str] = []
    new_hash = None
    if hash_image is None and found.hash_image is not None:
        new_hash = found.hash_image
        used.append(new_hash)
    if found.root_hash is not None:
        used.append(found.root_hash_source)
    signature = None
    if not signature_given and found.signature is not None:
        signature = found.signature
        used.append(found.signature_path)
    return RemoteSidecars(new_hash, found.root_hash, signature, tuple(used))


def write_private(blob: bytes, name: str) -> str:
    """BLOB in an anonymous memory file (memfd) that the exec'd nbdkit inherits, as the
    path its plugin reads it from (/proc/self/fd/N): no file is left anywhere to clean
    up, and nobody else can open it. name (the URL) is what messages show for it."""
    fd = os.memfd_create(name[:240], 0)  # no MFD_CLOEXEC: it must survive the exec
    os.write(fd, blob)
    return f"/proc/self/fd/{fd}"


def private_label(path: str) -> str:
    """What messages call a file write_private made: the name it was given."""
    if not path.startswith("/proc/self/fd/"):
        return path
    try:
        target = os.readlink(path)
    except OSError:
        return path
    if target.startswith("/memfd:"):
        return target.removeprefix("/memfd:").removesuffix(" (deleted)")
    return path


def close_private(path: str | None) -> None:
    """Close the memory file write_private made for path, once it has been read (or
    the image it came with was refused); any other path is left alone."""
    if path and path.startswith("/proc/self/fd/"):
        with contextlib.suppress(ValueError, OSError):
            os.close(int(path.rsplit("/", 1)[1]))
