"""The demo's trust steps: sign the root hash, serve from sidecars under
--require-signatures, and watch an unsigned and a wrongly signed copy be refused.

The sidecars are laid out as systemd-dissect looks for them (disk.raw, disk.verity,
disk.roothash, disk.roothash.p7s); the image files are hard links to the demo's image,
so no 64 MiB copy is made. Keys and certificates come from the real openssl, as
docs/trust.md tells a user to make them.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from ..launch import LaunchError, run_to_end
from .serving import served_with, sha256_of, shell
from .walkthrough import StepFailed, Walkthrough

SIGNER = ("demo-signing", "/CN=nbd-verity demo signing key")
STRANGER = ("someone-else", "/CN=someone else")
REFUSAL_TIMEOUT_S = 60  # a refusal comes before nbdkit starts; a hang is a failure


def openssl(w: Walkthrough, *args: str) -> None:
    """openssl ARGS in the work directory, shown as typed."""
    w.say(f"$ openssl {shlex.join(args)}")
    done = run_to_end(["openssl", *args], REFUSAL_TIMEOUT_S, cwd=w.workdir)
    if done.returncode:
        for line in done.stderr.splitlines():
            w.say(f"    {line}")
        raise StepFailed(f"`openssl {args[0]}` exited {done.returncode}")


def make_identity(w: Walkthrough, name: str, subject: str) -> None:
    """An ECDSA P-256 key and its self-signed certificate: NAME.key and NAME.crt."""
    openssl(w, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "3650",
            "-subj", subject)


def lay_out(w: Walkthrough, name: str) -> Path:
    """NAME.raw and NAME.verity: the demo image and its tree under sidecar names."""
    for leftover in (".roothash", ".roothash.p7s"):
        (w.workdir / f"{name}{leftover}").unlink(missing_ok=True)
    for source, suffix in ((w.data, ".raw"), (w.hash, ".verity")):
        target = w.workdir / f"{name}{suffix}"
        target.unlink(missing_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    return w.workdir / f"{name}.raw"


def refused(w: Walkthrough, *args: str) -> str:
    """`nbd-verity serve ARGS` must refuse to start: non-zero, one line; that line."""
    sock = w.workdir / "refused.sock"
    argv = ["serve", *args, "--unix", sock.name]
    w.say(f"$ nbd-verity {shlex.join(argv)}")
    try:
        done = run_to_end([w.cli, *argv], REFUSAL_TIMEOUT_S, cwd=w.workdir)
    except LaunchError:
        raise StepFailed("the server started; it should have refused") from None
    lines = done.stderr.strip().splitlines()
    for line in lines:
        w.say(f"    {line}")
    w.say(f"    (exit status {done.returncode})")
    if done.returncode == 0 or len(lines) != 1:
        raise StepFailed("expected a refusal to start: one line and a non-zero status")
    return lines[0]


def sign_image(w: Walkthrough) -> None:
    """Make a signing key with openssl, then sign the root hash into sidecars."""
    make_identity(w, *SIGNER)
    image = lay_out(w, "disk")
    w.run("sign", "--key", f"{SIGNER[0]}.key", "--cert", f"{SIGNER[0]}.crt", w.root,
          "--sidecars", image.name)
    w.say("the image and its sidecars, where serve, verify and systemd-dissect look:")
    for path in sorted(w.workdir.glob("disk.*")):
        w.say(f"    {path.name:<20}{path.stat().st_size:>10} bytes")
    w.say("and openssl, checking as systemd checks, agrees:")
    openssl(w, "smime", "-verify", "-binary", "-inform", "DER", "-in", "disk.roothash.p7s",
            "-noverify", "-nointern", "-certfile", f"{SIGNER[0]}.crt",
            "-content", "disk.roothash", "-out", "/dev/null")


def serve_signed(w: Walkthrough) -> None:
    """Serve disk.raw from its sidecars alone, signatures required; read it all back."""
    args = ["disk.raw", "--require-signatures", "--trusted-certs", f"{SIGNER[0]}.crt"]
    with served_with(w, "signed", args) as (sock, ctl):
        for line in (w.workdir / "signed.log").read_text().splitlines():
            w.say(f"    {line}")  # the start-up line: the root hash and its signer
        out = w.workdir / "read-back.img"
        shell(w, "nbdcopy", f"nbd+unix:///?socket={sock}", out)
        if sha256_of(out) != sha256_of(w.data):
            raise StepFailed("the bytes served differ from the image")
        w.say("read back over NBD: the same bytes as data.img")
        out.unlink()
        done = w.run("ctl", "--control", ctl.name, "status")
        w.expect_in("signed by CN=nbd-verity demo signing key", done.stdout)


def refuse_unsigned(w: Walkthrough) -> None:
    """An unsigned copy (no .roothash.p7s) is refused under --require-signatures."""
    lay_out(w, "unsigned")
    shutil.copyfile(w.workdir / "disk.roothash", w.workdir / "unsigned.roothash")
    line = refused(w, "unsigned.raw", "--require-signatures",
                   "--trusted-certs", f"{SIGNER[0]}.crt")
    w.expect_in("require-signatures: the root hash is not signed", line)


def refuse_wrongly_signed(w: Walkthrough) -> None:
    """A copy signed by a key we do not trust is refused."""
    make_identity(w, *STRANGER)
    image = lay_out(w, "wrong")
    w.run("sign", "--key", f"{STRANGER[0]}.key", "--cert", f"{STRANGER[0]}.crt", w.root,
          "--sidecars", image.name)
    line = refused(w, "wrong.raw", "--require-signatures",
                   "--trusted-certs", f"{SIGNER[0]}.crt")
    w.expect_in("is not a trusted certificate", line)


STEPS = (sign_image, serve_signed, refuse_unsigned, refuse_wrongly_signed)
