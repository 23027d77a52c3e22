"""Trusted certificates for root-hash signatures: where they are found and how they load.

Mirrors systemd's userspace check (dissect-image.c, validate_signature_userspace()):
the trusted certificates are the `*.crt` files of the `verity.d` directories, looked up
as conf_files_list(CONF_FILES_REGULAR|CONF_FILES_FILTER_MASKED) does: a file name in an
earlier directory hides the same name in later ones, an empty file or a symlink to
/dev/null masks the name, hidden files and non-regular files are skipped, the result is
sorted by file name. systemd reads only the first PEM certificate of each file
(PEM_read_X509) and skips a file it cannot open or parse; so do we, but we keep the
reason so that the caller can log it.

An explicit `--trusted-certs FILE` is a PEM bundle: every certificate in it is trusted,
and a file without one is an error (it was named on purpose). An explicit directory is
read with systemd's rules above.

No dates, key usage or chain are checked here or later: see signature.py.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from asn1crypto import pem
from asn1crypto import x509 as asn1_x509
from cryptography import x509

from ..errors import NoTrustedCertificates, SignatureError
from ..sources.source import read_small_file

# systemd's CONF_PATHS_NULSTR("verity.d"), in priority order
DEFAULT_SEARCH_PATH = ("/etc/verity.d", "/run/verity.d", "/usr/local/lib/verity.d",
                       "/usr/lib/verity.d")
MAX_CERT_FILE_SIZE = 1 << 20  # a certificate file larger than this is not one


@dataclass(frozen=True)
class TrustedCert:
    """One trusted certificate, parsed twice: asn1crypto matches signers, cryptography
    holds the public key."""

    cert: x509.Certificate
    asn1: asn1_x509.Certificate
    path: str

    @property
    def subject(self) -> str:
        return self.cert.subject.rfc4514_string()

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the DER certificate, lowercase hex (`openssl x509 -fingerprint`)."""
        return hashlib.sha256(self.asn1.dump()).hexdigest()

    def matches(self, sid) -> bool:
        """Whether a SignerInfo's sid (issuer+serial or subject key identifier) names us."""
        if sid.name == "issuer_and_serial_number":
            ias = sid.chosen
            return (ias["serial_number"].native == self.asn1.serial_number
                    and ias["issuer"] == self.asn1.issuer)
        if sid.name == "subject_key_identifier":
            return self.asn1.key_identifier == sid.chosen.native
        return False


@dataclass(frozen=True)
class TrustStore:
    """The trusted certificates, where they were looked for, and files skipped (with why)."""

    certs: tuple[TrustedCert, ...]
    searched: tuple[str, ...]
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{len(self.certs)} trusted certificate(s) from {', '.join(self.searched)}"


def parse_pem_certificates(blob: bytes, source: str, first_only: bool = False
                           ) -> list[TrustedCert]:
    """The CERTIFICATE blocks of a PEM text; other blocks (keys, CRLs) are passed over."""
    if not pem.detect(blob):
        raise SignatureError(f"{source}: not a PEM file (no '-----BEGIN' line)")
    found = []
    try:
        for kind, _headers, der in pem.unarmor(blob, multiple=True):
            if kind not in ("CERTIFICATE", "X509 CERTIFICATE"):
                continue
            found.append(_load_der(der, source))
            if first_only:
                break
    except ValueError as e:
        raise SignatureError(f"{source}: malformed PEM ({e})") from None
    if not found:
        raise SignatureError(f"{source}: no certificate in this PEM file")
    return found


def _load_der(der: bytes, source: str) -> TrustedCert:
    try:
        cert = x509.load_der_x509_certificate(der)
        parsed = asn1_x509.Certificate.load(der)
        parsed.native  # noqa: B018  (asn1crypto parses lazily: force it here)
    except ValueError as e:
        raise SignatureError(f"{source}: not a valid X.509 certificate ({e})") from None
    return TrustedCert(cert=cert, asn1=parsed, path=source)


def _read(path: str) -> bytes:
    return read_small_file(path, MAX_CERT_FILE_SIZE, SignatureError)


def _masked(path: str) -> bool:
    """systemd's mask: a symlink to /dev/null or an empty regular file."""
    if os.path.islink(path) and os.path.realpath(path) == "/dev/null":
        return True
    try:
        return os.path.isfile(path) and os.path.getsize(path) == 0
    except OSError:
        return False


def certificate_files(directories) -> list[str]:
    """The `*.crt` files of directories, chosen and ordered as conf_files_list does."""
    chosen: dict[str, str | None] = {}  # name -> path, None when masked
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue  # a missing directory is simply not there
        for name in names:
            if name.startswith(".") or not name.endswith(".crt") or name in chosen:
                continue
            path = os.path.join(directory, name)
            if _masked(path):
                chosen[name] = None
            elif os.path.isfile(path):
                chosen[name] = path
    return [chosen[name] for name in sorted(chosen) if chosen[name] is not None]


def load_directories(directories) -> TrustStore:
    """Certificates from verity.d-style directories: the first one of each `*.crt` file;
    a file that cannot be read or parsed is skipped (as systemd does) and reported."""
    certs, skipped = [], []
    for path in certificate_files(directories):
        try:
            certs.extend(parse_pem_certificates(_read(path), path, first_only=True))
        except SignatureError as e:
            skipped.append(str(e))
    return TrustStore(tuple(certs), tuple(directories), tuple(skipped))


def load_trusted_certs(path: str | None = None, search_path=DEFAULT_SEARCH_PATH
                       ) -> TrustStore:
    """The trusted certificates: from PATH (a PEM file or a directory of `*.crt`), or from
    systemd's verity.d search path. Raises NoTrustedCertificates when none is found."""
    if path is None:
        store = load_directories(search_path)
    elif os.path.isdir(path):
        store = load_directories([path])
    else:
        store = TrustStore(tuple(parse_pem_certificates(_read(path), path)), (path,))
    if not store.certs:
        where = ", ".join(store.searched)
        detail = f" ({'; '.join(store.skipped)})" if store.skipped else ""
        raise NoTrustedCertificates(f"trusted-certs: no certificate found in {where}{detail}")
    return store
