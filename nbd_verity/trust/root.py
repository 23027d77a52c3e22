"""Where the trusted root comes from: given, found beside the image, and signed or not.

One function, resolve_root(), is meant for both front ends (the plugin's start-up and the
CLI's `serve`/`verify`), so a root hash is found and its signature checked the same way
everywhere. Given values win over found ones, as in systemd's verity_settings_load()
("only fill in what isn't already filled in"). The root hash's length against the
algorithm is checked later, by the caller that knows the algorithm.

The certificate and signature modules (asn1crypto, cryptography) are imported only when
there is a signature to check: an unsigned root hash is served without them, as nbdkit's
embedded Python may lack them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, SignatureError
from ..sources.remote import is_url
from .remote_sidecar import private_label
from .sidecar import (
    Sidecars,
    exists_local,
    find_sidecars,
    parse_hex,
    parse_verity_sig,
    read_local,
    read_signature_file,
    xattr_local,
)

if TYPE_CHECKING:
    from .signature import VerifiedSignature


@dataclass(frozen=True)
class TrustedRoot:
    """The root hash to serve, the hash image, and what vouches for the root hash."""

    hash_image: str
    root_hex: str
    root_hash_source: str  # "given", or the file / xattr it was read from
    signature: VerifiedSignature | None = None
    signature_source: str | None = None
    warnings: tuple[str, ...] = ()  # trusted-certificate files skipped, expired signer

    def describe(self) -> str:
        """The start-up line's trust part."""
        if self.signature is None:
            return f"root hash {self.root_hex} unsigned ({self.root_hash_source})"
        return (f"root hash {self.root_hex} signed by {self.signature.signer.describe()} "
                f"({self.signature_source})")

    def status(self) -> dict:
        """The `trust` object of `ctl status` and `stats`."""
        if self.signature is None:
            return {"signed": False, "root_hash": self.root_hex,
                    "root_hash_source": self.root_hash_source}
        signer = self.signature.signer
        return {"signed": True, "root_hash": self.root_hex,
                "root_hash_source": self.root_hash_source,
                "signature": self.signature_source, "subject": signer.subject,
                "fingerprint": signer.fingerprint, "certificate": signer.path,
                "not_after": signer.not_valid_after.isoformat(), "expired": signer.expired()}


def resolve_root(data: str, hash_image: str | None = None, root_hash: str | None = None,
                 signature_path: str | None = None, trusted_certs: str | None = None,
                 require_signatures: bool = False, search_path=None,
                 read=read_local, exists=exists_local, xattr=xattr_local) -> TrustedRoot:
    """Fill in what was not given from DATA's sidecars, then check the signature, if any:
    a present signature must verify; with REQUIRE_SIGNATURES one must be present.

    Sidecars are looked up beside a local DATA only. For an image named by a URL, they
    come from that same source or not at all (serve looks beside http(s) and s3 URLs
    before it starts, trust/remote_sidecar.py); a local path made of a URL's text
    (`nbd+unix:///?socket=/s.roothash`) would let whoever can write the current
    directory choose the root hash."""
    if is_url(data):
        found = Sidecars(image=data)
    else:
        found = find_sidecars(data, read, exists, xattr,
                              root_hash_given=root_hash is not None)
    source = "given"
    if root_hash is not None:
        root_hash = parse_hex(root_hash, "root-hash", "root hash")
    elif found.root_hash is not None:
        root_hash, source = found.root_hash, found.root_hash_source
    der, sig_source, fingerprint = found.signature, found.signature_path, None
    if signature_path is not None:
        der, verity_sig = read_signature_file(signature_path, read)
        sig_source = private_label(signature_path)  # a fetched one: its URL
        if verity_sig is not None:
            fingerprint = verity_sig.certificate_fingerprint
            root_hash, source = _signed_root(root_hash, source, verity_sig, signature_path)
    hash_image = hash_image or found.hash_image
    if hash_image is None:
        raise ConfigError("hash: missing (give the hash image" + (
            ")" if is_url(data) else f", or put {data.removesuffix('.raw')}.verity beside "
            f"the image)"))
    if root_hash is None:
        raise ConfigError("root-hash: missing (give a root hash or a root-hash-file" + (
            ")" if is_url(data) else f", or put {data.removesuffix('.raw')}.roothash "
            f"beside the image)"))
    if der is None and require_signatures:
        raise SignatureError("require-signatures: the root hash is not signed (give "
                             "root-hash-signature" + (")" if is_url(data) else
                                                      ", or put IMAGE.roothash.p7s beside it)"))
    return _settle(hash_image, root_hash, source, der, sig_source, fingerprint,
                   trusted_certs, search_path)


def _signed_root(root_hash: str | None, source: str, verity_sig,
                 sig_source: str) -> tuple[str, str]:
    """The root hash and where it came from, given a verity.sig object: its rootHash
    when none was given, else the given one, which it must equal."""
    if root_hash is None:
        return verity_sig.root_hash, sig_source
    if root_hash != verity_sig.root_hash:
        raise SignatureError(f"root-hash-signature: {sig_source} is for root hash "
                             f"{verity_sig.root_hash}, not {root_hash}")
    return root_hash, source


def resolve_ddi_root(image: str, hash_image: str, root_hash: str | None,
                     signature_blob: bytes | None, signature_partition: str | None,
                     signature_path: str | None = None, trusted_certs: str | None = None,
                     require_signatures: bool = False, search_path=None,
                     read=read_local) -> TrustedRoot:
    """The root of a Discoverable Disk Image: given, or the rootHash of its verity
    signature partition (SIGNATURE_BLOB, a NUL-padded verity.sig JSON object), whose
    signature is then checked by the same rules as a verity.sig file. A signature file
    given (SIGNATURE_PATH) is used instead of the partition."""
    if root_hash is not None:
        root_hash = parse_hex(root_hash, "root-hash", "root hash")
    der = verity_sig = None
    sig_source = signature_path or signature_partition
    if signature_path is not None:
        der, verity_sig = read_signature_file(signature_path, read)
    elif signature_blob is not None:
        verity_sig = parse_verity_sig(signature_blob, signature_partition)
        der = verity_sig.signature
    source = "given"
    if verity_sig is not None:
        root_hash, source = _signed_root(root_hash, source, verity_sig, sig_source)
    if root_hash is None:
        raise ConfigError(f"root-hash: missing ({image} has no verity signature partition: "
                          f"give the root hash)")
    if der is None and require_signatures:
        raise SignatureError(f"require-signatures: the root hash is not signed ({image} has "
                             f"no verity signature partition)")
    return _settle(hash_image, root_hash, source, der, sig_source,
                   verity_sig.certificate_fingerprint if verity_sig else None,
                   trusted_certs, search_path)


def _settle(hash_image: str, root_hash: str, source: str, der: bytes | None,
            sig_source: str | None, fingerprint: str | None, trusted_certs: str | None,
            search_path) -> TrustedRoot:
    """The TrustedRoot: unsigned, or with its signature checked (a present signature
    must verify)."""
    if der is None:
        return TrustedRoot(hash_image, root_hash, source)
    load_trusted_certs, check_root_hash_signature = _checker()
    trust = (load_trusted_certs(trusted_certs) if search_path is None
             else load_trusted_certs(trusted_certs, search_path))
    verified = check_root_hash_signature(root_hash, der, trust, fingerprint)
    warnings = [f"trusted-certs: skipped {reason}" for reason in trust.skipped]
    if verified.signer.expired():
        warnings.append(f"root-hash-signature: certificate {verified.signer.subject} is not "
                        f"valid now (until {verified.signer.not_valid_after:%Y-%m-%d}); "
                        f"accepted, as systemd and the kernel accept it")
    return TrustedRoot(hash_image, root_hash, source, verified, sig_source, tuple(warnings))


def _checker():
    """The certificate loader and signature checker, imported when first needed."""
    try:
        from .certs import load_trusted_certs
        from .signature import check_root_hash_signature
    except ImportError as e:
        package = (e.name or "asn1crypto").split(".")[0]
        raise SignatureError(f"root-hash-signature: checking a signature needs the Python "
                             f"package {package} (pip install {package}, or Debian's "
                             f"python3-{package})") from None
    return load_trusted_certs, check_root_hash_signature
