"""A captive upstream's nbdkit plugin for an http(s) URL that carries a query string
(`nbdkit python httpread.py url-file=PATH`): ranged GETs with the standard library.

Why not nbdkit's curl plugin: curl takes the URL only as `url=URL` on its command line,
and /proc/PID/cmdline is readable by every user, so a presigned URL's token or signature
(`?X-Amz-Signature=...`, `?token=...`) would be public. nbdkit 1.32 has no way to read a
plugin key from a file except the password keys (`password=+FILE`). This plugin reads the
whole URL (query and user name and password included) from a 0600 file at config time;
upstream.py writes the file in the captive's private 0700 directory and removes it once
this server is ready. Everything it reads is untrusted, like curl's bytes: the verifying
server above checks every block.

What it does as curl does there: http and https only, redirects followed (at most
MAX_REDIRECTS, never to another scheme), the server's certificate verified. One HTTP
connection per NBD connection (the thread model serialises each connection's requests;
the multi-conn filter above opens several), reopened after any failure. A read that
fails is EIO; the retry filter above reopens and retries. Messages show the URL without
its user part and its query (remote.redact).

Memory is bounded whatever the server says: a read takes at most the bytes asked for and
one more (a longer body is a lie, seen without reading the rest), and the body of a
redirect or of the size probe at most BODY_LIMIT; a connection left with unread bytes
is closed, never drained.
"""

import errno
import http.client
import pathlib
import ssl
import traceback
import urllib.parse

import nbdkit

from nbd_verity.sources.remote import basic_auth, redact

API_VERSION = 2
MAX_REDIRECTS = 5
TIMEOUT_S = 60.0  # a request taking longer fails (as the verifying source's own bound)
REDIRECTS = (301, 302, 303, 307, 308)
BODY_LIMIT = 64 << 10  # of a body read only to reuse the connection (redirect, size probe)

_url = None  # the URL from url-file (with its secrets: never in a message)
_size = None  # found at config_complete, so a bad URL stops the server before it is ready


class HttpError(Exception):
    """A request that failed; the message names the URL redacted."""


_format_exception = traceback.format_exception


def _one_line(exc, value=None, tb=None, **kwargs):
    """nbdkit prints a callback's exception with traceback.format_exception: ours as
    its one-line message (as serve/callbacks.py does), anything else in full."""
    error = value if value is not None else exc
    if isinstance(error, HttpError):
        return [str(error)]
    return _format_exception(exc, value, tb, **kwargs)


traceback.format_exception = _one_line


def config(key, value):
    global _url
    if key != "url-file":
        raise HttpError(f"unknown parameter: {key}")
    try:
        _url = pathlib.Path(value).read_text(encoding="utf-8").strip()  # (open: a callback)
    except OSError as e:
        raise HttpError(f"url-file: {value}: {e.strerror}") from None
    if urllib.parse.urlsplit(_url).scheme not in ("http", "https"):
        raise HttpError(f"url-file: {redact(_url)}: not an http(s) URL")


def config_complete():
    global _size
    if _url is None:
        raise HttpError("url-file: missing")
    connection = Connection()
    try:
        _size = connection.size()
    finally:
        connection.close()


def thread_model():
    return nbdkit.THREAD_MODEL_SERIALIZE_REQUESTS


def open(readonly):
    return Connection()


def close(h):
    h.close()


def get_size(h):
    return _size


def can_write(h):
    return False


def pread(h, buf, offset, flags):
    try:
        h.read_into(buf, offset)
    except (HttpError, OSError, http.client.HTTPException) as e:
        h.close()  # the next request opens a new connection
        nbdkit.set_error(errno.EIO)
        raise HttpError(f"{redact(_url)}: read at byte {offset}: {e}") from None


class Connection:
    """One HTTP(S) connection to the URL's host (or a redirect's), opened on first use."""

    def __init__(self) -> None:
        self._conn = None
        self._origin = None  # (scheme, netloc) of _conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._origin = None

    def size(self) -> int:
        """The file's size, from the Content-Range of a one-byte ranged GET (or the
        Content-Length of a server that ignores Range, whose body is not read)."""
        response = self._get("bytes=0-0")
        if response.status == 200:
            total = response.getheader("Content-Length", "")
            self.close()
        else:
            self._discard(response)
            total = response.getheader("Content-Range", "").rpartition("/")[2]
        if not total.isdigit():
            raise HttpError(f"{redact(_url)}: the server gave no size")
        return int(total)

    def read_into(self, buf, offset: int) -> None:
        """buf from the range at offset; a body longer or shorter than buf fails, and
        no more than len(buf) + 1 bytes of it are read (pread closes the connection)."""
        response = self._get(f"bytes={offset}-{offset + len(buf) - 1}")
        if response.status != 206:  # a whole file instead of the range: not read
            raise HttpError(f"HTTP {response.status} instead of 206 for a range")
        body = response.read(len(buf) + 1)
        if len(body) > len(buf):
            raise HttpError(f"more than the {len(buf)} bytes asked for")
        if len(body) != len(buf):
            raise HttpError(f"{len(body)} of {len(buf)} bytes")
        buf[:] = body

    def _discard(self, response) -> None:
        """Read a body nobody needs, up to BODY_LIMIT; close the connection if more."""
        if len(response.read(BODY_LIMIT + 1)) > BODY_LIMIT:
            self.close()

    def _get(self, byte_range: str):
        """The response to a ranged GET of the URL, after any redirects (body unread)."""
        url = _url
        for _ in range(MAX_REDIRECTS + 1):
            response = self._request(url, byte_range)
            if response.status not in REDIRECTS:
                break
            self._discard(response)
            url = urllib.parse.urljoin(url, response.getheader("Location", ""))
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise HttpError(f"{redact(_url)}: redirected to {redact(url)}")
        else:
            raise HttpError(f"{redact(_url)}: more than {MAX_REDIRECTS} redirects")
        if response.status not in (200, 206):
            self.close()
            raise HttpError(f"{redact(_url)}: HTTP {response.status} {response.reason}")
        return response

    def _request(self, url: str, byte_range: str):
        """One GET on this connection (a new one for another origin); credentials only
        as the URL gives them, so a redirect elsewhere gets none (curl's default). A
        kept-alive connection the server has closed meanwhile is reopened once."""
        parts = urllib.parse.urlsplit(url)
        headers = {"Range": byte_range, **basic_auth(url)}  # curl's for user:password@
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        reused = self._open(parts)
        try:
            self._conn.request("GET", target, headers=headers)
            return self._conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError):
            if not reused:
                raise
        self.close()
        self._open(parts)
        self._conn.request("GET", target, headers=headers)
        return self._conn.getresponse()

    def _open(self, parts) -> bool:
        """Connect to the origin of parts unless connected; whether it was kept alive."""
        origin = (parts.scheme, parts.hostname, parts.port)
        if origin == self._origin:
            return True
        self.close()
        if parts.scheme == "https":
            self._conn = http.client.HTTPSConnection(parts.hostname, parts.port,
                                                     timeout=TIMEOUT_S,
                                                     context=ssl.create_default_context())
        else:
            self._conn = http.client.HTTPConnection(parts.hostname, parts.port,
                                                    timeout=TIMEOUT_S)
        self._origin = origin
        return False
