"""Sign a root hash: the DER detached PKCS#7 the kernel and systemd check.

The output is byte for byte what `openssl smime -sign -nocerts -noattr -binary -outform
der -in ROOTHASH -inkey KEY -signer CERT` writes for an RSA key (PKCS#1 v1.5 signatures
are deterministic; ECDSA ones are not, but have the same layout): cryptography's
PKCS7SignatureBuilder drives the same OpenSSL code. The signed content is the lowercase
hex root hash with no newline (signature.signed_content), never the binary digest.
Each signature is checked with our own checker before it is returned.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import pkcs7

from ..errors import SignatureError
from ..sources.source import read_small_file
from .certs import TrustStore, parse_pem_certificates
from .signature import HASHES, signed_content, verify_detached

MAX_PEM_FILE_SIZE = 1 << 20  # a key or certificate file: far larger than any real one


def _read(path: str, what: str) -> bytes:
    return read_small_file(path, MAX_PEM_FILE_SIZE, SignatureError, label=f"{what}: {path}")


def load_signing_key(key_pem_path: str, password: bytes | None = None):
    """An RSA or EC private key from a PEM file."""
    try:
        key = serialization.load_pem_private_key(_read(key_pem_path, "sign-key"), password)
    except (ValueError, TypeError) as e:
        raise SignatureError(f"sign-key: {key_pem_path}: not a usable PEM private key "
                             f"({e})") from None
    if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        raise SignatureError(f"sign-key: {key_pem_path}: a {type(key).__name__}; "
                             f"RSA or EC keys only")
    return key


def sign_root_hash(root_hex: str, key_pem_path: str, cert_pem_path: str, *,
                   digest: str = "sha256", signed_attributes: bool = False,
                   embed_certificate: bool = False, password: bytes | None = None) -> bytes:
    """A DER detached signature of ROOT_HEX (any case; the lowercase hex is signed) by the
    key and certificate given. The defaults match `openssl smime -sign -nocerts -noattr`."""
    if digest not in HASHES:
        raise SignatureError(f"digest: {digest!r} is not one of {', '.join(HASHES)}")
    content = signed_content(root_hex)
    key = load_signing_key(key_pem_path, password)
    trusted = parse_pem_certificates(_read(cert_pem_path, "sign-cert"), cert_pem_path,
                                     first_only=True)
    cert = trusted[0].cert
    if _public_der(cert.public_key()) != _public_der(key.public_key()):
        raise SignatureError(f"sign-cert: {cert_pem_path} is not the certificate of "
                             f"{key_pem_path}")
    options = [pkcs7.PKCS7Options.DetachedSignature, pkcs7.PKCS7Options.Binary]
    if not signed_attributes:
        options.append(pkcs7.PKCS7Options.NoAttributes)
    if not embed_certificate:
        options.append(pkcs7.PKCS7Options.NoCerts)
    der = (pkcs7.PKCS7SignatureBuilder().set_data(content)
           .add_signer(cert, key, HASHES[digest]())
           .sign(serialization.Encoding.DER, options))
    verify_detached(content, der, TrustStore(tuple(trusted), (cert_pem_path,)))
    return der


def _public_der(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)

