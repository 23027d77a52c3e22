"""Export files (/etc/nbd-verity/NAME.conf): systemd's EnvironmentFile syntax, and ARGS
read by a table that must agree with `nbd-verity serve`'s own options."""

from __future__ import annotations

import os

import click
import pytest

from nbd_verity.cli.serve import serve_cmd
from nbd_verity.errors import ConfigError
from nbd_verity.prepare.exportfile import (
    LISTEN_OPTIONS,
    OPTIONS,
    PATH_DESTS,
    ExportFile,
    export_name,
    parse_args,
    parse_environment,
    read_export_file,
    secret_warning,
)


def test_environment_file_syntax():
    text = """# a comment
; another
DATA=/var/lib/a.img

HASH = "/var/lib/with space.verity"
ROOT_HASH='abcd'
ARGS=--cache-size 8M \\
  --no-readahead
"""
    assert parse_environment(text, "x.conf") == {
        "DATA": "/var/lib/a.img", "HASH": "/var/lib/with space.verity",
        "ROOT_HASH": "abcd", "ARGS": "--cache-size 8M --no-readahead"}


@pytest.mark.parametrize("text, message", [
    ("DATA", "line 1: not KEY=value"),
    ("FOO=1", "line 1: unknown key FOO"),
    ('DATA="/a', "line 1: unterminated quote"),
    ("\n\n1X=2", "line 3: not KEY=value"),
])
def test_environment_file_refusals(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_environment(text, "x.conf")


def test_args_become_serve_options():
    assert parse_args("--hash sha512 --salt=ab --fec-roots 8 --require-signatures "
                      "--threshold be=4096 --threshold rt=0 --no-readahead", "ARGS") == {
        "algorithm": "sha512", "salt": "ab", "fec_roots": 8, "require_signatures": True,
        "thresholds": ["be=4096", "rt=0"], "readahead": False}


@pytest.mark.parametrize("text, message", [
    ("--unix /x.sock", "--unix is the server's own"),
    ("--bogus", "'--bogus' is not an option an export may give"),
    ("--fec-roots", "--fec-roots needs a value"),
    ("--fec-roots x", "'x' is not an integer"),
    ("--no-superblock=1", "--no-superblock takes no value"),
])
def test_args_refusals(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(text, "ARGS")


def serve_options() -> dict[str, click.Option]:
    """Every spelling of every option of `nbd-verity serve`."""
    spelled = {}
    for param in serve_cmd.params:
        if isinstance(param, click.Option):
            for flag in (*param.opts, *param.secondary_opts):
                spelled[flag] = param
    return spelled


def test_the_table_agrees_with_serve():
    """Every option an export file may give is `serve`'s, with the same destination and
    kind (flag or value), so the two spellings cannot drift; every serve option is in
    the table or is the server's own listening option."""
    spelled = serve_options()
    for flag, option in OPTIONS.items():
        assert flag in spelled, flag
        param = spelled[flag]
        assert param.name == option.dest, flag
        assert (option.flag_value is not None) == (param.is_flag or bool(
            param.secondary_opts)), flag
        assert option.repeat == param.multiple, flag
    for flag in spelled:
        assert flag in OPTIONS or flag in LISTEN_OPTIONS or flag in ("-h", "--help"), flag


def test_export_names():
    assert export_name("/etc/nbd-verity/root-a.conf") == "root-a"
    for bad in ("/e/.conf", "/e/x.txt", "/e/-x.conf", "/e/a b.conf"):
        with pytest.raises(ConfigError, match=r"an export file is NAME\.conf"):
            export_name(bad)


def test_relative_paths_are_beside_the_file(tmp_path):
    conf = tmp_path / "img.conf"
    conf.write_text("DATA=disk.raw\nHASH=../h.verity\nARGS=--fec-device f.fec\n")
    spec = read_export_file(str(conf))
    assert spec.data == os.path.join(tmp_path, "disk.raw")
    assert spec.hash_image == os.path.join(tmp_path, "../h.verity")
    assert spec.options["fec_device"] == os.path.join(tmp_path, "f.fec")


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "f.conf"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_export_file(str(fifo))


# What the server owns, one for all its images (docs/server.md's table says the same).
SERVERS = {"--trusted-certs", "--require-signatures", "--restart-on-corruption",
           "--threshold", "--threshold-preset", "--workers", "--default-class",
           "--serialize", "--parallel", "--thread-model", "--threads", "--log-rate",
           "--allow-class", "--list-exports"}


def test_trust_anchors_and_policy_are_the_servers():
    assert {flag for flag, option in OPTIONS.items() if option.server} == SERVERS
    spec = ExportFile("x.conf", "x", "/d", options=parse_args(
        "--trusted-certs /b.crt --require-signatures --root-hash-signature /s.p7s "
        "--cache-size 1M", "ARGS"))
    assert sorted(spec.server_options()) == ["--require-signatures", "--trusted-certs"]


@pytest.mark.parametrize("flag", sorted(f for f, o in OPTIONS.items() if o.dest in PATH_DESTS))
def test_a_path_option_takes_no_url(flag):
    with pytest.raises(ConfigError, match=f"^ARGS: {flag} takes a path, not a URL$"):
        parse_args(f"{flag} http://images.example/x", "ARGS")
    with pytest.raises(ConfigError, match=f"{flag} takes a path, not a URL"):
        parse_args(f"{flag}=s3://bucket/x", "ARGS")


def test_an_image_with_an_unknown_scheme_is_refused(tmp_path):
    conf = tmp_path / "img.conf"
    conf.write_text("DATA=ftp://alice:pw@host/disk.raw\n")
    with pytest.raises(ConfigError, match=r"DATA: ftp://\*\*\*@host/disk.raw is neither a "
                                          r"path nor a URL"):
        read_export_file(str(conf))
    conf.write_text("DATA=https://host/disk.raw\nHASH=nbd+unix:///?socket=/s\n")
    spec = read_export_file(str(conf))
    assert (spec.data, spec.hash_image) == ("https://host/disk.raw", "nbd+unix:///?socket=/s")


@pytest.mark.parametrize("text, secret", [
    ("DATA=https://alice:pw@host/d.raw\n", True),
    ("DATA=/d.raw\nHASH=https://host/h?X-Amz-Signature=abc\n", True),
    ("DATA=/d.raw\nARGS=--s3-endpoint http://k:s@127.0.0.1:9000\n", True),
    ("DATA=https://alice@host/d.raw\n", False),  # a user name is not a secret
    ("DATA=nbd+unix:///x?socket=/run/s.sock\n", False),  # file names, not secrets
    ("DATA=/d.raw\nHASH=/h?x\n", False),  # a path
])
def test_a_secret_readable_by_others_is_one_warning(tmp_path, text, secret):
    tmp_path.chmod(0o755)
    conf = tmp_path / "s.conf"
    conf.write_text(text)
    conf.chmod(0o644)
    warning = secret_warning(str(conf), parse_environment(text, str(conf)))
    if not secret:
        assert warning is None
        return
    assert warning.startswith(f"warning: {conf}: holds a secret") and "chmod 0600" in warning
    assert "pw" not in warning and "abc" not in warning and ":s@" not in warning
    conf.chmod(0o640)  # a group the admin chose: no warning
    assert secret_warning(str(conf), parse_environment(text, str(conf))) is None
    conf.chmod(0o644)
    tmp_path.chmod(0o750)  # others cannot reach it
    assert secret_warning(str(conf), parse_environment(text, str(conf))) is None


def test_the_warning_goes_to_warn_and_the_file_is_still_read(tmp_path):
    tmp_path.chmod(0o755)
    conf = tmp_path / "s.conf"
    conf.write_text("DATA=https://alice:pw@host/d.raw\n")
    conf.chmod(0o604)
    said: list[str] = []
    spec = read_export_file(str(conf), warn=said.append)
    assert spec.data == "https://alice:pw@host/d.raw" and len(said) == 1
