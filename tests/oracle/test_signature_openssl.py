"""The real openssl as the oracle for root-hash signatures.

Every case is a (signature, certificate, content) triple of files. The oracle is
`openssl smime -verify -binary -inform DER -noverify -nointern -certfile CERT -content
ROOTHASH`, the PKCS7_verify flags systemd uses; our verify_detached() gets the very same
bytes and must reach the same verdict, and each verdict is also pinned. Then the policy
layer: the content we check is always the lowercase hex of the root hash, so an uppercase
or newline-terminated root hash *file* is read as systemd reads it, and a signature over
anything but the lowercase hex text is refused, as the kernel refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from nbd_verity.errors import SignatureError
from nbd_verity.trust.certs import load_trusted_certs
from nbd_verity.trust.sidecar import parse_root_hash_text
from nbd_verity.trust.signature import check_root_hash_signature, verify_detached
from nbd_verity.trust.signing import sign_root_hash

from ..pki import (
    ROOT_HEX,
    cms_sign,
    make_expired_identity,
    make_identity,
    oracle_verify,
    smime_sign,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Keys and certificates, made once: RSA, ECDSA, an unrelated one, an expired one."""
    d = tmp_path_factory.mktemp("pki")
    ids = {"rsa": make_identity(d, "rsa-signer"), "ec": make_identity(d, "ec-signer", "ec"),
           "other": make_identity(d, "other-signer"),
           "expired": make_expired_identity(d, "expired-signer")}
    content = {"lower": ROOT_HEX, "upper": ROOT_HEX.upper(), "newline": ROOT_HEX + "\n",
               "tampered": ROOT_HEX[:-1] + "7"}
    files = {}
    for name, text in content.items():
        files[name] = d / f"{name}.txt"
        files[name].write_text(text)
    files["binary"] = d / "binary.bin"
    files["binary"].write_bytes(bytes.fromhex(ROOT_HEX))
    return d, ids, files


@dataclass(frozen=True)
class Case:
    name: str
    signer: str  # identity that signs
    signed: str  # content file that is signed
    checked: str  # content file given to -content
    trusted: str  # identity whose certificate is trusted
    accept: bool  # the pinned verdict
    attributes: bool = False
    certs: bool = False
    mangle: str = ""  # "truncate", "empty", "garbage"


CASES = [
    Case("rsa-noattr-nocerts", "rsa", "lower", "lower", "rsa", True),
    Case("rsa-attrs-certs", "rsa", "lower", "lower", "rsa", True, attributes=True, certs=True),
    Case("rsa-attrs-nocerts", "rsa", "lower", "lower", "rsa", True, attributes=True),
    Case("ec-noattr-nocerts", "ec", "lower", "lower", "ec", True),
    Case("ec-attrs-certs", "ec", "lower", "lower", "ec", True, attributes=True, certs=True),
    Case("tampered-root-hash", "rsa", "lower", "tampered", "rsa", False),
    Case("tampered-root-hash-attrs", "ec", "lower", "tampered", "ec", False, attributes=True),
    Case("uppercase-content", "rsa", "lower", "upper", "rsa", False),
    Case("newline-content", "rsa", "lower", "newline", "rsa", False),
    Case("wrong-certificate", "rsa", "lower", "lower", "other", False),
    Case("wrong-certificate-signer-embedded", "rsa", "lower", "lower", "other", False,
         attributes=True, certs=True),
    Case("truncated", "rsa", "lower", "lower", "rsa", False, mangle="truncate"),
    Case("empty", "rsa", "lower", "lower", "rsa", False, mangle="empty"),
    Case("garbage", "rsa", "lower", "lower", "rsa", False, mangle="garbage"),
    Case("expired-certificate", "expired", "lower", "lower", "expired", True),
    Case("binary-root-hash-signed", "rsa", "binary", "lower", "rsa", False),
    Case("binary-root-hash-signed-attrs", "ec", "binary", "lower", "ec", False,
         attributes=True),
]


def _signature(pki, case: Case) -> Path:
    d, ids, files = pki
    out = d / f"{case.name}.p7s"
    smime_sign(ids[case.signer], files[case.signed], out, case.attributes, case.certs)
    blob = out.read_bytes()
    if case.mangle == "truncate":
        out.write_bytes(blob[: len(blob) // 2])
    elif case.mangle == "empty":
        out.write_bytes(b"")
    elif case.mangle == "garbage":
        out.write_bytes(b"\x30\x82\x01\x00" + bytes(range(256)))
    return out


def _ours(signature: Path, cert: Path, content: Path) -> bool:
    try:
        verify_detached(content.read_bytes(), signature.read_bytes(),
                        load_trusted_certs(str(cert)))
    except SignatureError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_agrees_with_openssl_smime_verify(pki, case):
    _, ids, files = pki
    signature = _signature(pki, case)
    cert, content = ids[case.trusted].cert, files[case.checked]
    assert oracle_verify(signature, cert, content) is case.accept
    assert _ours(signature, cert, content) is case.accept


@pytest.mark.parametrize("extra", [
    ("-keyopt", "rsa_padding_mode:pss"),
    ("-keyopt", "rsa_padding_mode:pss", "-keyopt", "rsa_pss_saltlen:32", "-noattr"),
    ("-keyid", "-noattr"),
], ids=["pss-attrs", "pss-noattr-salt32", "subject-key-identifier"])
def test_pss_and_key_identifier_agree_with_openssl_cms(pki, extra):
    """OpenSSL 3.0's PKCS7 code (smime, and systemd) cannot read these; its CMS code can,
    and so do we, with the same verdict on the right and the tampered content."""
    d, ids, files = pki
    signature = cms_sign(ids["rsa"], files["lower"], d / f"cms{len(extra)}{extra[0]}.p7s",
                         *extra)
    for content, accept in ((files["lower"], True), (files["tampered"], False)):
        assert oracle_verify(signature, ids["rsa"].cert, content, tool="cms") is accept
        assert _ours(signature, ids["rsa"].cert, content) is accept
    assert not oracle_verify(signature, ids["rsa"].cert, files["lower"], tool="smime")
    assert not _ours(signature, ids["other"].cert, files["lower"])


@pytest.mark.parametrize("kind", ["rsa", "ec"])
@pytest.mark.parametrize("attributes", [False, True], ids=["noattr", "attrs"])
@pytest.mark.parametrize("embed", [False, True], ids=["nocerts", "certs"])
def test_our_signatures_verify_under_openssl(pki, tmp_path, kind, attributes, embed):
    _, ids, files = pki
    der = sign_root_hash(ROOT_HEX.upper(), str(ids[kind].key), str(ids[kind].cert),
                         signed_attributes=attributes, embed_certificate=embed)
    signature = tmp_path / "ours.p7s"
    signature.write_bytes(der)
    assert oracle_verify(signature, ids[kind].cert, files["lower"])
    assert not oracle_verify(signature, ids[kind].cert, files["upper"])
    assert not oracle_verify(signature, ids["other"].cert, files["lower"])


def test_our_rsa_signature_is_openssl_smime_byte_for_byte(pki, tmp_path):
    """PKCS#1 v1.5 is deterministic: `sign_root_hash` writes what `openssl smime -sign
    -nocerts -noattr -binary -outform der` writes."""
    _, ids, files = pki
    theirs = smime_sign(ids["rsa"], files["lower"], tmp_path / "theirs.p7s")
    ours = sign_root_hash(ROOT_HEX, str(ids["rsa"].key), str(ids["rsa"].cert))
    assert ours == theirs.read_bytes()


# The policy layer: what a root hash *file* means, and what the kernel would accept.

@pytest.mark.parametrize("file_name", ["lower", "upper", "newline"])
def test_root_hash_file_read_as_systemd_then_checked(pki, file_name):
    """An uppercase or newline-terminated IMAGE.roothash names the same root hash (systemd
    decodes it to bytes), and the signature over the lowercase hex covers it."""
    d, ids, files = pki
    signature = smime_sign(ids["rsa"], files["lower"], d / f"policy-{file_name}.p7s")
    root = parse_root_hash_text(files[file_name].read_bytes(), str(files[file_name]))
    result = check_root_hash_signature(root, signature.read_bytes(),
                                       load_trusted_certs(str(ids["rsa"].cert)))
    assert result.root_hex == ROOT_HEX
    assert result.signer.fingerprint == ids["rsa"].fingerprint()


@pytest.mark.parametrize("signed", ["upper", "newline", "binary"])
def test_signature_over_anything_but_the_lowercase_hex_is_refused(pki, signed):
    """openssl accepts these when handed the same bytes as content; the kernel checks the
    table's lowercase hex, so they are refused whatever the root hash file holds."""
    d, ids, files = pki
    signature = smime_sign(ids["rsa"], files[signed], d / f"refused-{signed}.p7s")
    assert oracle_verify(signature, ids["rsa"].cert, files[signed])
    with pytest.raises(SignatureError, match="does not match the root hash"):
        check_root_hash_signature(ROOT_HEX, signature.read_bytes(),
                                  load_trusted_certs(str(ids["rsa"].cert)))
