"""What an export file may not do: bring its own trust anchor or signature policy into a
many-export server, name a URL where a path is asked, or keep a secret where every user
reads it. Real nbdkit, real clients (libnbd, nbdinfo), real reloads over the control
socket; signatures made by openssl (tests/pki.py)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import nbd
import pytest

from nbd_verity.demo.remote import Lighttpd

from ..pki import make_identity, smime_sign
from .serverlib import MIB, make_image, random_bytes
from .test_exports import connect, exports, read_all, reload

SIZE = 2 * MIB
PASSWORD = f"pw-{secrets.token_hex(8)}"
TOKEN = f"tok{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """Two images, 'good' signed by key A and 'evil' signed by key B, each with its root
    hash's signature (.p7s) beside it."""
    base = tmp_path_factory.mktemp("exports-trust")
    keys = {"a": make_identity(base, "key-a"), "b": make_identity(base, "key-b")}
    made = {}
    for i, (name, key) in enumerate((("good", "a"), ("evil", "b"))):
        image = make_image(base / name, random_bytes(70 + i, SIZE))
        text = base / f"{name}.roothash"
        text.write_text(image.root)  # the hex text, no newline: what is signed
        image.signature = smime_sign(keys[key], text, base / f"{name}.roothash.p7s")
        made[name] = image
    return keys, made


def write_conf(directory: Path, name: str, image, args: str = "", root: bool = True,
               mode: int = 0o644) -> Path:
    path = directory / f"{name}.conf"
    tmp = directory / f".{name}.tmp"
    tmp.write_text(f"DATA={image.data}\nHASH={image.hash}\n"
                   + (f"ROOT_HASH={image.root}\n" if root else "") + f"ARGS={args}\n")
    tmp.chmod(mode)
    os.replace(tmp, path)
    return path


def listed(server) -> dict[str, str]:
    """Each export's name and description, as `ctl exports` gives them."""
    return {name: item["description"] for name, item in exports(server).items()}


def log_lines(server, word: str) -> list[str]:
    return [line for line in Path(server.log_path).read_text().splitlines() if word in line]


def test_an_export_file_cannot_replace_the_servers_trusted_certs(signed, servers, sockdir,
                                                                 tmp_path):
    """`serve --exports DIR --require-signatures --trusted-certs A.crt`: an export file
    naming B.crt for an image signed by B is refused in one line (the option is the
    server's), at start-up and on reload; the image signed by A serves."""
    keys, images = signed
    directory = tmp_path / "exports"
    directory.mkdir()
    write_conf(directory, "good", images["good"],
               f"--root-hash-signature {images['good'].signature}")
    evil = write_conf(directory, "evil", images["evil"],
                      f"--root-hash-signature {images['evil'].signature} "
                      f"--trusted-certs {keys['b'].cert}")
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control,
                                "--require-signatures", "--trusted-certs",
                                str(keys["a"].cert)])
    server.control = control
    shown = listed(server)
    assert sorted(shown) == ["good"], shown
    assert "signed by CN=key-a" in shown["good"], shown
    assert read_all(connect(server, "good")) == images["good"].expected()
    with pytest.raises(nbd.Error):
        connect(server, "evil")
    refusals = log_lines(server, str(evil))
    assert refusals and all("--trusted-certs is the server's" in line for line in refusals)

    report = reload(server)
    why = report["refused"][str(evil)]
    assert "--trusted-certs is the server's" in why and "\n" not in why, why
    assert report["unchanged"] == ["good"]
    assert sorted(listed(server)) == ["good"]


def test_an_export_file_cannot_set_the_signature_policy(signed, servers, sockdir, tmp_path):
    """--require-signatures is the server's too: a file giving it is refused, whatever
    it asks for (the command line says the policy for every export)."""
    _, images = signed
    directory = tmp_path / "exports"
    directory.mkdir()
    write_conf(directory, "good", images["good"])
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control])
    server.control = control
    policy = write_conf(directory, "policy", images["good"], "--require-signatures")
    report = reload(server)
    assert "--require-signatures is the server's" in report["refused"][str(policy)]
    assert sorted(listed(server)) == ["good"]


def test_an_export_file_served_alone_keeps_its_trust_options(signed, servers, tmp_path):
    """`serve --export-file FILE` (the template units) is one image's own server: its
    file may name the certificates and require signatures, and they are applied."""
    keys, images = signed
    solo = write_conf(tmp_path, "solo", images["good"],
                      f"--root-hash-signature {images['good'].signature} "
                      f"--trusted-certs {keys['a'].cert} --require-signatures")
    server = servers.serve_cli(["--export-file", str(solo)])
    assert read_all(server.connect()) == images["good"].expected()
    started = log_lines(server, "nbd-verity: serving")
    assert len(started) == 1 and "signed by CN=key-a" in started[0], started

    wrong = write_conf(tmp_path, "wrong", images["evil"],
                       f"--root-hash-signature {images['evil'].signature} "
                       f"--trusted-certs {keys['a'].cert} --require-signatures")
    refused = servers.serve_cli(["--export-file", str(wrong)], ready=False)
    assert refused.proc.wait(60) != 0
    text = Path(refused.log_path).read_text()
    assert "is not a trusted certificate" in text and "Traceback" not in text, text


def test_a_url_in_a_path_option_is_refused(servers, sockdir, tmp_path, monkeypatch):
    """--root-hash-file http://... is refused in one line; it is never read as the path
    ./http:/images.example/b.roothash under the server's working directory, where a
    root hash was planted."""
    image = make_image(tmp_path / "b", random_bytes(80, SIZE))
    cwd = tmp_path / "cwd"
    planted = cwd / "http:" / "images.example" / "b.roothash"
    planted.parent.mkdir(parents=True)
    planted.write_text(image.root)
    monkeypatch.chdir(cwd)  # the server's working directory
    directory = tmp_path / "exports"
    directory.mkdir()
    write_conf(directory, "one", image)
    b = write_conf(directory, "b", image, "--root-hash-file http://images.example/b.roothash",
                   root=False)
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control])
    server.control = control
    assert sorted(listed(server)) == ["one"]
    with pytest.raises(nbd.Error):
        connect(server, "b")
    why = reload(server)["refused"][str(b)]
    assert why == f"{b}: ARGS: --root-hash-file takes a path, not a URL", why


@pytest.fixture
def web(tmp_path):
    """lighttpd serving one image on 127.0.0.1 (it ignores the password and the query:
    what matters here is what the export file holds)."""
    image = make_image(tmp_path / "img", random_bytes(90, SIZE))
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(image.data, docroot / "data.img")
    shutil.copyfile(image.hash, docroot / "hash.img")
    server = Lighttpd(docroot, tmp_path / "lighttpd").start()
    server.image = image
    server.secret_url = lambda name: (f"http://reader:{PASSWORD}@127.0.0.1:{server.port}/"
                                      f"{name}?token={TOKEN}")
    yield server
    server.stop()


def write_secret_conf(directory: Path, web, mode: int) -> Path:
    """An export file whose URLs hold a password and a token."""
    path = directory / "secret.conf"
    tmp = directory / ".secret.tmp"
    tmp.write_text(f"DATA={web.secret_url('data.img')}\nHASH={web.secret_url('hash.img')}\n"
                   f"ROOT_HASH={web.image.root}\n")
    tmp.chmod(mode)
    os.replace(tmp, path)
    return path


def assert_one_warning(server, path: Path, before: int = 0) -> None:
    """Exactly one new warning line names path, says how to fix it, and holds no secret."""
    lines = log_lines(server, "holds a secret")[before:]
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "chmod 0600" in lines[0], lines[0]
    assert "LoadCredential=" in lines[0]
    assert PASSWORD not in lines[0] and TOKEN not in lines[0]


def test_a_readable_export_file_with_a_secret_is_one_warning(web, servers, sockdir, tmp_path,
                                                            monkeypatch):
    """A file holding a URL's password and token, readable by others: one warning line
    naming the file, on the reload that reads it; the export serves. Rewritten 0640, it
    is read again without a warning."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)  # the captive upstream's sockets
    directory = tmp_path / "exports"
    directory.mkdir()
    directory.chmod(0o755)
    write_conf(directory, "one", web.image)
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control])
    server.control = control
    assert log_lines(server, "holds a secret") == []

    path = write_secret_conf(directory, web, 0o644)
    assert reload(server)["added"] == ["secret"]
    assert_one_warning(server, path)
    assert read_all(connect(server, "secret")) == web.image.expected()

    write_secret_conf(directory, web, 0o640)
    assert reload(server)["changed"] == ["secret"]
    assert read_all(connect(server, "secret")) == web.image.expected()
    assert len(log_lines(server, "holds a secret")) == 1


def test_a_readable_export_file_served_alone_is_one_warning(web, servers, sockdir,
                                                            tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    tmp_path.chmod(0o755)
    path = write_secret_conf(tmp_path, web, 0o644)
    server = servers.serve_cli(["--export-file", str(path)])
    assert read_all(server.connect()) == web.image.expected()
    assert_one_warning(server, path)
