"""What commands write: never through a planted symlink, never over one of their own
inputs, and never half a file (a failed command leaves no partial output behind).

The rule "no output may be an input" is checked over every command that writes a file
(format's hash image, FEC device, root-hash file and signed sidecars; sign's -o and
sidecars): each output named as each input, through the same path, a symlink and a hard
link. The inputs are digested before and after: a refused run changes no byte of them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from ..pki import make_identity

MIB = 1 << 20


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return make_identity(tmp_path_factory.mktemp("keys"), "outputs-signer")


@pytest.fixture
def work(tmp_path, tools, signer):
    """A directory with a data image, its tree and root hash, a key and a certificate."""
    data = tools.write_image(tmp_path / "d.img", MIB, seed=7)
    hashes = tmp_path / "h.img"
    run = tools.ours("format", data, hashes)
    assert run.returncode == 0, run.stderr
    root_file = tmp_path / "root.txt"
    root_file.write_text(tools.root_hash(run.stdout))
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_bytes(signer.key.read_bytes())
    cert.write_bytes(signer.cert.read_bytes())
    return {"data": data, "hash": hashes, "root": root_file, "key": key, "cert": cert,
            "root_hex": tools.root_hash(run.stdout)}


def alias(path: Path, how: str) -> Path:
    """path itself, or a symlink or hard link to it beside it."""
    if how == "path":
        return path
    link = path.with_name(f"{how}-{path.name}")
    if how == "symlink":
        link.symlink_to(path)
    else:
        os.link(path, link)
    return link


def signing(w) -> list:
    return ["--sign-key", w["key"], "--sign-cert", w["cert"]]


# Each writer with the output under test set to `out`; every other file it names is an
# input of the same run (data, key, certificate, root-hash file), or for format's
# --root-hash-file the hash image it writes.
WRITERS = {
    "format --root-hash-file": lambda w, out: ["format", w["data"], w["hash"],
                                               "--root-hash-file", out, *signing(w)],
    "format HASH": lambda w, out: ["format", w["data"], out, "--root-hash-file", w["root"],
                                   *signing(w)],
    "format --fec-device": lambda w, out: ["format", w["data"], w["hash"], "--fec-device",
                                           out, "--root-hash-file", w["root"], *signing(w)],
    "sign -o": lambda w, out: ["sign", "--root-hash-file", w["root"], "--key", w["key"],
                               "--cert", w["cert"], "-o", out],
}
# the files each output must not be (the hash image and FEC device may share the data
# image's device as areas: that rule is tests/oracle/test_overlap.py's)
INPUTS = {"format --root-hash-file": ["data", "hash", "key", "cert"],
          "format HASH": ["key", "cert", "root"],
          "format --fec-device": ["key", "cert", "root"],
          "sign -o": ["key", "cert", "root"]}
CASES = [(writer, role, how) for writer, roles in INPUTS.items() for role in roles
         for how in ("path", "symlink", "hardlink")]


@pytest.mark.parametrize("writer, role, how", CASES)
def test_no_output_is_an_input(tools, work, writer, role, how):
    argv = WRITERS[writer](work, alias(work[role], how))
    before = {name: digest(work[name]) for name in ("data", "hash", "root", "key", "cert")}
    files = sorted(p.name for p in work["data"].parent.iterdir())
    run = tools.ours(*argv)
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "an output may not be an input" in lines[0], run.stderr
    assert {name: digest(work[name]) for name in before} == before
    assert sorted(p.name for p in work["data"].parent.iterdir()) == files


@pytest.mark.parametrize("how", ["path", "symlink", "hardlink"])
def test_signed_sidecars_are_never_the_image(tools, work, how):
    """format --sign-key and sign --sidecars write DATA.roothash(.p7s): refused when
    either is the data image itself (a link planted under that name)."""
    data = work["data"]
    planted = data.with_name(data.name + ".roothash.p7s") if how != "path" else None
    if how == "symlink":
        planted.symlink_to(data)
    elif how == "hardlink":
        os.link(data, planted)
    before = digest(data)
    for argv in (["format", data, work["hash"].with_name("n.verity"), "--sign-key",
                  work["key"], "--sign-cert", work["cert"]],
                 ["sign", work["root_hex"], "--key", work["key"], "--cert", work["cert"],
                  "--sidecars", data]):
        if how == "path":  # the image named as its own sidecar: -o DATA
            argv = ["sign", work["root_hex"], "--key", work["key"], "--cert", work["cert"],
                    "--sidecars", data, "-o", data]
        run = tools.ours(*argv)
        assert run.returncode == 2 and "an output may not be an input" in run.stderr, run
        assert digest(data) == before
        assert not data.with_name("n.verity").exists()


@pytest.mark.parametrize("command", ["sign --sidecars", "sign -o", "format --sign-key",
                                     "format --root-hash-file"])
def test_a_planted_symlink_at_a_temporary_name_redirects_nothing(tools, work, command):
    """Every fixed name a writer might use beside its output (NAME.partial, NAME.tmp) is
    a symlink to a victim file: the victim keeps its bytes, and the output is a regular
    file of its own (not a symlink)."""
    victim = work["data"].with_name("victim.txt")
    victim.write_text("precious\n")
    data = work["data"]
    if command == "sign --sidecars":
        argv = ["sign", work["root_hex"], "--key", work["key"], "--cert", work["cert"],
                "--sidecars", data]
        outputs = [data.with_name("d.img.roothash"), data.with_name("d.img.roothash.p7s")]
    elif command == "sign -o":
        outputs = [data.with_name("out.p7s")]
        argv = ["sign", work["root_hex"], "--key", work["key"], "--cert", work["cert"],
                "-o", outputs[0]]
    elif command == "format --sign-key":
        argv = ["format", data, data.with_name("n.verity"), "--sign-key", work["key"],
                "--sign-cert", work["cert"]]
        outputs = [data.with_name("d.img.roothash"), data.with_name("d.img.roothash.p7s")]
    else:
        outputs = [data.with_name("r.txt")]
        argv = ["format", data, data.with_name("n.verity"), "--root-hash-file", outputs[0]]
    for out in outputs:
        for suffix in (".partial", ".tmp", ".new", "~"):
            out.with_name(out.name + suffix).symlink_to(victim)
    run = tools.ours(*argv)
    assert run.returncode == 0, run.stderr
    assert victim.read_text() == "precious\n"
    for out in outputs:
        assert out.is_file() and not out.is_symlink(), out
        assert out.stat().st_size > 0
    leftovers = [p.name for p in data.parent.iterdir() if p.name.endswith(".tmp")
                 and not p.is_symlink()]
    assert leftovers == []


def test_a_dangling_symlink_as_the_hash_image_is_refused(tools, work, tmp_path):
    """format does not follow a symlink to a missing file to create its target."""
    target = tmp_path / "elsewhere" / "created-by-format"
    target.parent.mkdir()
    link = tmp_path / "new.verity"
    link.symlink_to(target)
    run = tools.ours("format", work["data"], link)
    assert run.returncode == 2 and "symlink to a missing file" in run.stderr, run
    assert not target.exists()


def run_limited(argv: list[str], file_blocks: int) -> subprocess.CompletedProcess:
    """argv under `ulimit -f` (blocks of 1024 bytes) in a subshell."""
    script = f'ulimit -f {file_blocks} && exec "$@"'
    return subprocess.run(["bash", "-c", script, "bash", *map(str, argv)],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("layout", ["separate", "in-hash-image"])
def test_a_failed_fec_write_leaves_no_partial_output(tools, work, tmp_path, layout):
    """ulimit -f 40: the hash image fits, the parity does not. format exits 2 naming the
    file, and neither the partial parity nor the hash image it created is left."""
    data = tools.write_image(tmp_path / "f4.img", 4 * MIB, seed=4)
    hashes, fec = tmp_path / "f4.verity", tmp_path / "f4.fec"
    extra = ["--fec-device", fec] if layout == "separate" else \
        ["--fec-device", hashes, "--fec-offset", "40960"]
    run = run_limited([tools.nbd_verity_path, "format", data, hashes, "--fec-roots", "8",
                       *extra], 40)
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0], run.stderr
    assert str(fec if layout == "separate" else hashes) in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("f4")) == \
        ["f4.img"]


def test_a_failed_hash_write_leaves_no_partial_output(tools, tmp_path):
    data = tools.write_image(tmp_path / "big.img", 64 * MIB, seed=5)
    run = run_limited([tools.nbd_verity_path, "format", data, tmp_path / "big.verity"], 40)
    assert run.returncode == 2 and "File too large" in run.stderr, run
    assert str(tmp_path / "big.verity") in run.stderr
    assert not (tmp_path / "big.verity").exists()
