"""Keys, certificates and signatures made by the real `openssl` command, for signature tests.

Keys come from `openssl genpkey`, self-signed certificates from `openssl req -x509`, and
signatures from `openssl smime -sign` / `openssl cms -sign`, as a user following
docs/trust.md would make them. Only the expired certificate is built with cryptography:
openssl 3.0's `req` cannot date a certificate in the past.
"""

from __future__ import annotations

import datetime
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

ROOT_HEX = "4392712ba01368efdf14b05c76f9e4df0d53664630b5d48632ed17a137f39076"


def openssl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", *args], capture_output=True, check=check)


@dataclass(frozen=True)
class Identity:
    """A private key and its certificate, as files."""

    name: str
    key: Path
    cert: Path

    def fingerprint(self) -> str:
        """`openssl x509 -fingerprint -sha256` as lowercase hex without colons."""
        out = openssl("x509", "-in", str(self.cert), "-noout", "-fingerprint", "-sha256")
        return out.stdout.decode().split("=", 1)[1].strip().replace(":", "").lower()


def make_identity(directory: Path, name: str, kind: str = "rsa") -> Identity:
    """A fresh RSA-2048 or ECDSA P-256 key and a self-signed certificate (CN=name)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    if kind == "rsa":
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
                "-out", str(key))
    else:
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                "-out", str(key))
    openssl("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "30",
            "-subj", f"/CN={name}")
    return Identity(name, key, cert)


def make_expired_identity(directory: Path, name: str) -> Identity:
    """An openssl key with a self-signed certificate that expired in 2020."""
    key = directory / f"{name}.key"
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(key))
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(private.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime(2019, 1, 1))
            .not_valid_after(datetime.datetime(2020, 1, 1))
            .sign(private, hashes.SHA256()))
    path = directory / f"{name}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Identity(name, key, path)


def smime_sign(identity: Identity, content: Path, out: Path, attributes: bool = False,
               certs: bool = False, extra: tuple[str, ...] = ()) -> Path:
    """`openssl smime -sign -binary -outform DER`, by default with -noattr -nocerts."""
    args = ["smime", "-sign", "-binary", "-outform", "DER", "-in", str(content),
            "-inkey", str(identity.key), "-signer", str(identity.cert), "-out", str(out)]
    if not attributes:
        args.append("-noattr")
    if not certs:
        args.append("-nocerts")
    openssl(*args, *extra)
    return out


def cms_sign(identity: Identity, content: Path, out: Path, *extra: str) -> Path:
    """`openssl cms -sign -binary -outform DER -nocerts` with extra options (PSS, keyid)."""
    openssl("cms", "-sign", "-binary", "-outform", "DER", "-nocerts", "-in", str(content),
            "-inkey", str(identity.key), "-signer", str(identity.cert), "-out", str(out),
            *extra)
    return out


def oracle_verify(signature: Path, cert: Path, content: Path, tool: str = "smime") -> bool:
    """The oracle: `openssl smime -verify -binary -inform DER -noverify -nointern
    -certfile CERT -content ROOTHASH` (systemd's PKCS7_verify flags); `cms` for what
    OpenSSL's PKCS7 code cannot read (RSA-PSS, key identifiers)."""
    result = openssl(tool, "-verify", "-binary", "-inform", "DER", "-in", str(signature),
                     "-noverify", "-nointern", "-certfile", str(cert),
                     "-content", str(content), "-out", "/dev/null", check=False)
    return result.returncode == 0
