"""Check a root-hash signature: a detached PKCS#7/CMS SignedData over the root hash text.

What is signed is exactly what the kernel checks (dm-verity-verify-sig.c): the root hash
as lowercase hex, as cryptsetup writes it in the table, with no newline. The rule is
systemd's userspace check, PKCS7_verify(p7, trusted, NULL, content, NULL,
PKCS7_NOINTERN | PKCS7_NOVERIFY):
  - every SignerInfo must name (issuer+serial, or subject key identifier) one of the
    trusted certificates; certificates carried inside the signature are ignored;
  - with signed attributes, the messageDigest attribute must equal H(content) and the
    signature is over the DER of the attributes as a SET (tag 0x31, not the [0] they
    are stored under); without them, over the content itself;
  - no chain is built and no date is checked. An expired certificate is accepted, as
    systemd and the kernel accept it: a root hash is signed once and served for years,
    there is no trusted clock at early boot, and being stricter than the kernel would
    refuse images the kernel opens. The result carries the dates so callers can show them.
Where we are stricter, we follow the kernel's pkcs7 parser: the content must be detached
and of type id-data, signed attributes must carry contentType (id-data) and exactly one
messageDigest, digests must be SHA-2. RSA-PSS and subject-key-identifier signers are
accepted, as the CMS code (`openssl cms -verify`) accepts them, although OpenSSL 3.0's
PKCS7 code that systemd calls (and `openssl smime`) cannot read them.

asn1crypto parses; cryptography checks the signature itself (it has no public PKCS#7
verification).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from asn1crypto import cms
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from ..errors import SignatureError
from .certs import TrustedCert, TrustStore

HASHES = {"sha224": hashes.SHA224, "sha256": hashes.SHA256, "sha384": hashes.SHA384,
          "sha512": hashes.SHA512}
MAX_SIGNATURE_SIZE = 32767  # the kernel's limit on the user key that carries it


@dataclass(frozen=True)
class Signer:
    """Who signed: one trusted certificate and how it signed."""

    subject: str
    fingerprint: str  # SHA-256 of the certificate's DER, lowercase hex
    not_valid_before: datetime
    not_valid_after: datetime
    path: str  # the file the trusted certificate came from
    digest: str  # "sha256"
    algorithm: str  # "rsassa_pkcs1v15", "rsassa_pss" or "ecdsa"

    def expired(self, now: datetime | None = None) -> bool:
        now = now or datetime.now(UTC)
        return not self.not_valid_before <= now <= self.not_valid_after

    def describe(self) -> str:
        """One line for a start-up message: subject and fingerprint."""
        return f"{self.subject} (sha256 {self.fingerprint})"


@dataclass(frozen=True)
class VerifiedSignature:
    """A signature that passed: the root hash text it covers and its signers."""

    root_hex: str
    signers: tuple[Signer, ...]

    @property
    def signer(self) -> Signer:
        return self.signers[0]


def signed_content(root: bytes | str) -> bytes:
    """The bytes a root-hash signature covers: the lowercase hex of the root digest."""
    if isinstance(root, str):
        try:
            root = bytes.fromhex(root.strip())
        except ValueError:
            raise SignatureError(f"root-hash: {root!r} is not a hex string") from None
    return root.hex().encode("ascii")


def check_root_hash_signature(root: bytes | str, signature: bytes, trust: TrustStore,
                              expected_fingerprint: str | None = None) -> VerifiedSignature:
    """Check SIGNATURE (DER) over ROOT (digest bytes or hex text, any case) as the kernel
    would: the content is always the lowercase hex, whatever case the root came in.
    EXPECTED_FINGERPRINT (verity.sig's certificateFingerprint) must name a signer."""
    content = signed_content(root)
    signers = verify_detached(content, signature, trust)
    if expected_fingerprint is not None:
        wanted = expected_fingerprint.replace(":", "").lower()
        if all(s.fingerprint != wanted for s in signers):
            raise SignatureError(f"root-hash-signature: signed by {signers[0].describe()}, "
                                 f"not by the certificate {wanted} it names")
    return VerifiedSignature(content.decode("ascii"), signers)


def verify_detached(content: bytes, signature: bytes, trust: TrustStore) -> tuple[Signer, ...]:
    """PKCS7_verify(NOINTERN | NOVERIFY) of a DER detached signature over CONTENT."""
    signed_data = _load(signature)
    encap = signed_data["encap_content_info"]
    if encap["content_type"].native != "data":
        raise SignatureError(f"root-hash-signature: content type "
                             f"{encap['content_type'].native}, the kernel wants data")
    if encap["content"].native is not None:
        raise SignatureError("root-hash-signature: the signature carries its content; "
                             "dm-verity wants a detached signature")
    infos = list(signed_data["signer_infos"])
    if not infos:
        raise SignatureError("root-hash-signature: no signer in the signature")
    return tuple(_verify_signer(info, content, trust) for info in infos)


def _load(signature: bytes):
    """The SignedData of a DER ContentInfo, fully parsed (asn1crypto parses lazily)."""
    if not signature:
        raise SignatureError("root-hash-signature: empty signature")
    if len(signature) > MAX_SIGNATURE_SIZE:
        raise SignatureError(f"root-hash-signature: {len(signature)} bytes, more than the "
                             f"kernel's {MAX_SIGNATURE_SIZE}")
    try:
        info = cms.ContentInfo.load(signature)
        kind = info["content_type"].native
        if kind != "signed_data":
            raise SignatureError(f"root-hash-signature: a PKCS#7 {kind}, not signed data")
        signed_data = info["content"]
        signed_data.native  # noqa: B018  (force the whole parse: truncation shows here)
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        raise SignatureError(f"root-hash-signature: not a DER PKCS#7 signature "
                             f"({_short(e)})") from None
    return signed_data


def _short(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _verify_signer(info, content: bytes, trust: TrustStore) -> Signer:
    """One SignerInfo: find its trusted certificate, check digests and the signature."""
    cert = _find_signer(info["sid"], trust)
    digest_name = info["digest_algorithm"]["algorithm"].native
    if digest_name not in HASHES:
        raise SignatureError(f"root-hash-signature: digest {digest_name} is not accepted "
                             f"(SHA-2 only: {', '.join(HASHES)})")
    attrs = info["signed_attrs"]
    if attrs.native is None:
        signed = content
    else:
        _check_attributes(attrs, hashlib.new(digest_name, content).digest())
        signed = b"\x31" + attrs.dump()[1:]  # the SET OF, not its [0] IMPLICIT tag
    algorithm = _check_signature(cert, info, digest_name, signed)
    return Signer(subject=cert.subject, fingerprint=cert.fingerprint,
                  not_valid_before=_validity(cert, "before"),
                  not_valid_after=_validity(cert, "after"),
                  path=cert.path, digest=digest_name, algorithm=algorithm)


def _validity(cert: TrustedCert, end: str) -> datetime:
    """not_valid_before/after in UTC (newer cryptography has *_utc and deprecates the rest)."""
    aware = getattr(cert.cert, f"not_valid_{end}_utc", None)
    if aware is not None:
        return aware
    return getattr(cert.cert, f"not_valid_{end}").replace(tzinfo=UTC)


def _find_signer(sid, trust: TrustStore) -> TrustedCert:
    for cert in trust.certs:
        if cert.matches(sid):
            return cert
    if sid.name == "issuer_and_serial_number":
        named = (f"issuer {sid.chosen['issuer'].human_friendly}, "
                 f"serial {sid.chosen['serial_number'].native:x}")
    else:
        named = f"key identifier {sid.chosen.native.hex()}"
    raise SignatureError(f"root-hash-signature: signer ({named}) is not a trusted "
                         f"certificate ({trust.describe()})")


def _check_attributes(attrs, digest: bytes) -> None:
    """Signed attributes as the kernel wants them: one contentType of data, one
    messageDigest equal to the content's digest."""
    found: dict[str, list] = {}
    for attr in attrs:
        found.setdefault(attr["type"].native, []).extend(attr["values"])
    for name in ("content_type", "message_digest"):
        if len(found.get(name, ())) != 1:
            raise SignatureError(f"root-hash-signature: signed attributes need exactly one "
                                 f"{name.replace('_', ' ')}")
    if found["content_type"][0].native != "data":
        raise SignatureError("root-hash-signature: signed content type is not data")
    if found["message_digest"][0].native != digest:
        raise SignatureError("root-hash-signature: message digest does not match the root "
                             "hash (signed for another root hash)")


def _check_signature(cert: TrustedCert, info, digest_name: str, signed: bytes) -> str:
    """Verify the signature bytes with the certificate's key; returns the algorithm."""
    algo = info["signature_algorithm"]
    kind = algo.signature_algo
    key = cert.cert.public_key()
    value = info["signature"].native
    try:
        if kind == "rsassa_pkcs1v15" and isinstance(key, rsa.RSAPublicKey):
            key.verify(value, signed, padding.PKCS1v15(), HASHES[digest_name]())
        elif kind == "rsassa_pss" and isinstance(key, rsa.RSAPublicKey):
            key.verify(value, signed, _pss(algo["parameters"], digest_name),
                       HASHES[digest_name]())
        elif kind == "ecdsa" and isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(value, signed, ec.ECDSA(HASHES[digest_name]()))
        else:
            raise SignatureError(f"root-hash-signature: a {kind} signature cannot come from "
                                 f"the {type(key).__name__.removeprefix('_')} of "
                                 f"{cert.subject}")
    except InvalidSignature:
        raise SignatureError(f"root-hash-signature: signature by {cert.subject} does not "
                             f"match the root hash") from None
    return kind


def _pss(params, digest_name: str) -> padding.PSS:
    """PSS padding from RSASSA-PSS-params; its hashes must be the SignerInfo's digest."""
    hash_name = params["hash_algorithm"]["algorithm"].native
    mgf = params["mask_gen_algorithm"]
    mgf_hash = mgf["parameters"]["algorithm"].native
    if mgf["algorithm"].native != "mgf1" or {hash_name, mgf_hash} != {digest_name}:
        raise SignatureError(f"root-hash-signature: RSA-PSS with {hash_name}/"
                             f"{mgf['algorithm'].native}({mgf_hash}), not {digest_name} "
                             f"throughout")
    return padding.PSS(mgf=padding.MGF1(HASHES[digest_name]()),
                       salt_length=params["salt_length"].native)
