"""Objects in an S3 store, named `s3://BUCKET/KEY`: where the endpoint and the credentials
come from, the start-up check of an object, and small reads for its sidecars.

The image itself is read by nbdkit's S3 plugin in a captive upstream (upstream.py); this
module gives that plugin its keys and environment, and reads through boto3 itself only
what start-up needs: whether the object is there and readable (so a missing key or wrong
credentials are one line before anything starts), and the sidecars beside it
(KEY.verity, KEY.roothash, KEY.roothash.p7s, found by trust/remote_sidecar.py).

Credentials follow boto3's own chain (environment, shared credentials file, profile,
instance role), in this process and in the captive nbdkit, which inherits our
environment. Secrets never go on a command line: nbdkit's S3 plugin takes `access-key=`
and `secret-key=`, but /proc/PID/cmdline is readable by every user. `--s3-profile` and
`--s3-credentials` become AWS_PROFILE and AWS_SHARED_CREDENTIALS_FILE for both; the
endpoint (not a secret) is the plugin's `endpoint-url=`.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.parse
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass

from ..errors import ConfigError, SidecarError
from .source import read_capped

MAX_SIDECAR = 1 << 20  # a root hash or a PKCS#7 signature is far smaller
TIMEOUT_S = 10.0  # connect and read timeout of start-up's own requests
ABSENT = ("NoSuchKey", "404")  # a HEAD has no body: its code is the HTTP status
# What a refusal says for the codes S3 (and S3-compatible stores) answer.
REASONS = {
    "NoSuchKey": "no such key",
    "NoSuchBucket": "no such bucket",
    "404": "no such bucket or key",
    "InvalidAccessKeyId": "the access key is unknown to the store (check the credentials)",
    "SignatureDoesNotMatch": "the secret key does not match the access key "
                             "(check the credentials)",
    "AccessDenied": "access denied (check the credentials and the bucket policy)",
    "403": "access denied (check the credentials)",
    "InvalidRange": "the object is empty",
}


@dataclass(frozen=True)
class S3Options:
    """Where s3:// URLs are read from and as whom (None: boto3's default)."""

    endpoint_url: str | None = None  # e.g. http://127.0.0.1:9000 for MinIO or moto
    profile: str | None = None  # a profile of the shared credentials file
    credentials_file: str | None = None  # an AWS shared credentials file

    def environment(self, base: Mapping | None = None) -> dict:
        """base (default os.environ) with the profile and credentials file set."""
        env = dict(os.environ if base is None else base)
        if self.profile:
            env["AWS_PROFILE"] = self.profile
        if self.credentials_file:
            env["AWS_SHARED_CREDENTIALS_FILE"] = os.path.abspath(self.credentials_file)
        return env


def is_s3(text: str) -> bool:
    return urllib.parse.urlsplit(text).scheme == "s3"


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of s3://BUCKET/KEY; a user part is refused (credentials in a URL
    would reach the S3 plugin's bucket= on its command line)."""
    from .remote import redact
    parts = urllib.parse.urlsplit(url)
    bucket, key = parts.netloc, parts.path.lstrip("/")
    if "@" in bucket:
        raise ConfigError(f"{redact(url)}: an S3 URL holds no credentials (give them in "
                          f"the environment or --s3-credentials)")
    if parts.scheme != "s3" or not bucket or not key or parts.query or parts.fragment:
        raise ConfigError(f"{redact(url)}: an S3 URL is s3://BUCKET/KEY")
    return bucket, key


def check_boto3(url: str) -> None:
    """nbdkit's S3 plugin (and this module) need boto3."""
    if importlib.util.find_spec("boto3") is None:
        raise ConfigError(f"{url}: nbdkit's S3 plugin needs boto3, which this Python "
                          f"cannot import (Debian: apt-get install python3-boto3)")


def plugin_args(url: str, options: S3Options) -> list[str]:
    """nbdkit's S3 plugin and its keys for one URL (credentials: see the docstring)."""
    bucket, key = split_url(url)
    check_boto3(url)
    args = ["S3", f"bucket={bucket}", f"key={key}"]
    if options.endpoint_url:
        args.append(f"endpoint-url={options.endpoint_url}")
    return args


def client(options: S3Options):
    """A boto3 S3 client as the captive plugin will make one (same chain, same endpoint)."""
    import boto3
    import botocore.session
    from botocore.config import Config
    core = botocore.session.Session()
    if options.credentials_file:  # what AWS_SHARED_CREDENTIALS_FILE sets
        core.set_config_variable("credentials_file",
                                 os.path.abspath(options.credentials_file))
    session = boto3.session.Session(botocore_session=core, profile_name=options.profile)
    config = Config(connect_timeout=TIMEOUT_S, read_timeout=TIMEOUT_S,
                    retries={"max_attempts": 2, "mode": "standard"})
    return session.client("s3", endpoint_url=options.endpoint_url, config=config)


def _get(s3, url: str, byte_range: str | None = None):
    """GetObject (of a range); None when the key is absent; else one clear error."""
    from botocore.exceptions import BotoCoreError, ClientError
    bucket, key = split_url(url)
    ranged = {"Range": byte_range} if byte_range else {}
    try:
        return s3.get_object(Bucket=bucket, Key=key, **ranged)
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ABSENT:
            return None
        reason = REASONS.get(code) or e.response.get("Error", {}).get("Message") or code
        raise ConfigError(f"{url}: {reason}") from None
    except BotoCoreError as e:  # no credentials, endpoint unreachable, a timeout
        raise ConfigError(f"{url}: {e}") from None


def check_object(url: str, options: S3Options, s3=None) -> int:
    """The object's size, read as the captive plugin will read it; a missing key, a
    missing bucket, wrong credentials or an unreachable endpoint is one ConfigError."""
    check_boto3(url)
    size = _size(s3 or _new_client(url, options), url)
    if size is None:
        raise ConfigError(f"{url}: no such key")
    return size


def head(url: str, options: S3Options, size: int) -> bytes:
    """The object's first size bytes (fewer if it is shorter; b"" if it is absent):
    enough to see whether it starts with a GPT."""
    response = _get(_new_client(url, options), url, f"bytes=0-{size - 1}")
    if response is None:
        return b""
    from botocore.exceptions import BotoCoreError
    try:
        with closing(response["Body"]) as body:  # a store that ignores Range sends all
            return body.read(size)
    except (BotoCoreError, OSError) as e:
        raise ConfigError(f"{url}: {e}") from None


def _size(s3, url: str) -> int | None:
    """The object's size from a one-byte GET (its Content-Range), None if it is absent."""
    response = _get(s3, url, "bytes=0-0")
    if response is None:
        return None
    response["Body"].close()  # one byte asked; a store that ignores Range sends it all
    total = response.get("ContentRange", "").rpartition("/")[2]
    if not total.isdigit() and response.get("ContentRange") is None:
        total = str(response.get("ContentLength", ""))  # a 200: the whole object's size
    if not total.isdigit():
        raise ConfigError(f"{url}: the store gave no size (Content-Range "
                          f"{response.get('ContentRange')!r})")
    return int(total)


def _new_client(url: str, options: S3Options):
    from botocore.exceptions import BotoCoreError
    try:
        return client(options)
    except BotoCoreError as e:  # an unknown profile, a malformed credentials file
        raise ConfigError(f"{url}: {e}") from None


def sidecar_reader(options: S3Options):
    """(read, exists) for trust.sidecar.find_sidecars over s3:// URLs; one client."""
    s3 = None

    def shared(url: str):
        nonlocal s3
        s3 = s3 or _new_client(url, options)
        return s3

    def read(url: str) -> bytes | None:
        """A small object's bytes (at most 1 MiB), or None when there is none."""
        response = _get(shared(url), url)  # whole: a range of an empty object fails
        if response is None:
            return None
        if response.get("ContentLength", 0) > MAX_SIDECAR:
            response["Body"].close()
            raise SidecarError(f"{url}: larger than {MAX_SIDECAR} bytes")
        from botocore.exceptions import BotoCoreError
        try:
            with closing(response["Body"]) as body:
                return read_capped(body, MAX_SIDECAR, url, SidecarError)
        except BotoCoreError as e:  # the stream broke off or timed out
            raise SidecarError(f"{url}: {e}") from None

    def exists(url: str) -> bool:
        return _size(shared(url), url) is not None

    return read, exists
