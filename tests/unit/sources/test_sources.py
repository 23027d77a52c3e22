"""NBD URIs and captive upstreams, without servers: which text is a URI, how keys are
checked and rendered, and the captive nbdkit's command line."""

from __future__ import annotations

import pytest

from nbd_verity.errors import ConfigError
from nbd_verity.prepare.config import config_from_pairs, plugin_pairs
from nbd_verity.sources import s3, upstream
from nbd_verity.sources.remote import check_uri, is_uri, redacted

ROOT = "ab" * 32


@pytest.mark.parametrize(("text", "uri"), [
    ("nbd://host/export", True), ("nbds://host:10809/", True),
    ("nbd+unix:///?socket=/run/x.sock", True), ("nbds+unix:///e?socket=/s", True),
    ("/var/images/disk.raw", False), ("disk.raw", False), ("nbd:/relative", True),
    ("https://host/disk.raw", False), ("file:///disk.raw", False),
])
def test_is_uri(text, uri):
    assert is_uri(text) is uri


def test_unix_uri_needs_a_socket():
    with pytest.raises(ConfigError, match=r"^data: .* names no socket"):
        check_uri("data", "nbd+unix:///export")


def test_keys_keep_uris_and_make_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_from_pairs([("data", "nbd://h/d"), ("hash", "hash.img"),
                                ("root-hash", ROOT)])
    assert config.data == "nbd://h/d" and config.hash == str(tmp_path / "hash.img")
    pairs = plugin_pairs({"data": "nbd+unix:///?socket=/s", "hash_image": "h.img",
                          "root_hash": ROOT})
    assert pairs[:2] == [("data", "nbd+unix:///?socket=/s"), ("hash", str(tmp_path / "h.img"))]


def test_redacted_drops_the_user():
    assert redacted("nbds://alice@host/e?tls-psk-file=/k") == "nbds://host/e?tls-psk-file=/k"


@pytest.mark.parametrize(("text", "remote"), [
    ("https://host/disk.raw", True), ("http://h/x", True), ("s3://bucket/key", True),
    ("nbd://host/", False), ("/srv/disk.raw", False), ("ftp://host/disk.raw", False),
])
def test_is_remote(text, remote):
    assert upstream.is_remote(text) is remote


def test_upstream_argv_http_with_cache():
    argv = upstream.upstream_argv("https://h/disk.raw", "/d/s.sock", "/d/s.pid",
                                  upstream.UpstreamOptions(cache=True, cache_size="1G"))
    assert argv[1:9] == ["-f", "-r", "--exit-with-parent", "-U", "/d/s.sock", "-P", "/d/s.pid",
                         "--filter=multi-conn"]
    # filters nearest the client first: the cache sits above the retry filter
    assert argv.index("--filter=cache") < argv.index("--filter=retry") < argv.index("curl")
    assert {"url=https://h/disk.raw", "protocols=http,https", "cache-on-read=true",
            "cache-max-size=1G", "multi-conn-mode=unsafe", "retries=3"} <= set(argv)


def test_upstream_argv_s3(monkeypatch):
    monkeypatch.setattr(s3.importlib.util, "find_spec", lambda name: object())
    argv = upstream.upstream_argv("s3://bucket/dir/disk.raw", "/s", "/p",
                                  upstream.UpstreamOptions())
    assert argv[-6:-3] == ["S3", "bucket=bucket", "key=dir/disk.raw"]
    assert "--filter=cache" not in argv
    assert not any(a.startswith("endpoint-url=") for a in argv)


def test_upstream_argv_s3_endpoint_and_no_secrets(monkeypatch):
    """The endpoint is a plugin key; credentials are never on the command line."""
    monkeypatch.setattr(s3.importlib.util, "find_spec", lambda name: object())
    options = upstream.UpstreamOptions(s3=s3.S3Options(
        endpoint_url="http://127.0.0.1:9000", profile="images", credentials_file="/k/aws"))
    argv = upstream.upstream_argv("s3://bucket/disk.raw", "/s", "/p", options)
    assert "endpoint-url=http://127.0.0.1:9000" in argv
    assert not any(a.split("=")[0] in ("access-key", "secret-key", "session-token")
                   for a in argv)
    env = options.s3.environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "AWS_PROFILE": "images",
                   "AWS_SHARED_CREDENTIALS_FILE": "/k/aws"}


def test_s3_without_boto3_is_refused(monkeypatch):
    monkeypatch.setattr(s3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs boto3"):
        upstream.plugin_args("s3://bucket/disk.raw")


@pytest.mark.parametrize("url", ["s3://bucket", "s3://bucket/", "s3:///key",
                                 "s3://bucket/key?versionId=1"])
def test_malformed_s3_urls_are_refused(url):
    with pytest.raises(ConfigError, match=r"s3://BUCKET/KEY"):
        upstream.plugin_args(url)


def test_attach_passes_local_and_nbd_through():
    images = {"data": "/srv/disk.raw", "hash_image": "nbd://h/"}
    assert upstream.attach(images, upstream.UpstreamOptions()) == images
