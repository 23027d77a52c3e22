"""Root-hash signatures: trusted certificates, each refusal with its message, sidecars.

Keys and certificates come from openssl (tests/pki.py); the openssl verdicts themselves
are compared in tests/oracle/test_signature_openssl.py.
"""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime

import pytest

from nbd_verity.errors import ConfigError, NoTrustedCertificates, SidecarError, SignatureError
from nbd_verity.trust.certs import certificate_files, load_trusted_certs
from nbd_verity.trust.root import resolve_root
from nbd_verity.trust.sidecar import (
    auxiliary_path,
    find_sidecars,
    parse_root_hash_text,
    parse_verity_sig,
    read_signature_file,
)
from nbd_verity.trust.signature import check_root_hash_signature, signed_content, verify_detached
from nbd_verity.trust.signing import sign_root_hash

from ...pki import ROOT_HEX, make_expired_identity, make_identity, openssl, smime_sign


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return {"rsa": make_identity(d, "rsa-signer"), "ec": make_identity(d, "ec-signer", "ec"),
            "other": make_identity(d, "other-signer"),
            "expired": make_expired_identity(d, "expired-signer")}


def _sig(identity, **kw) -> bytes:
    return sign_root_hash(ROOT_HEX, str(identity.key), str(identity.cert), **kw)


def _trust(*identities, tmp_path=None):
    if len(identities) == 1:
        return load_trusted_certs(str(identities[0].cert))
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"".join(i.cert.read_bytes() for i in identities))
    return load_trusted_certs(str(bundle))


# -- the error tree

def test_signature_errors_are_config_errors():
    assert issubclass(SignatureError, ConfigError)
    assert issubclass(NoTrustedCertificates, SignatureError)
    assert issubclass(SidecarError, ConfigError)


# -- what a good signature tells

def test_signer_subject_and_fingerprint(ids):
    result = check_root_hash_signature(bytes.fromhex(ROOT_HEX), _sig(ids["ec"]),
                                       _trust(ids["ec"]))
    assert result.root_hex == ROOT_HEX
    assert result.signer.subject == "CN=ec-signer"
    assert result.signer.fingerprint == ids["ec"].fingerprint()
    assert result.signer.algorithm == "ecdsa" and result.signer.digest == "sha256"
    assert result.signer.describe() == f"CN=ec-signer (sha256 {ids['ec'].fingerprint()})"
    assert not result.signer.expired()


def test_expired_certificate_is_accepted_and_says_so(ids):
    result = check_root_hash_signature(ROOT_HEX, _sig(ids["expired"]), _trust(ids["expired"]))
    assert result.signer.expired()
    assert result.signer.not_valid_after == datetime(2020, 1, 1, tzinfo=UTC)


def test_bundle_file_trusts_every_certificate(ids, tmp_path):
    trust = _trust(ids["other"], ids["rsa"], tmp_path=tmp_path)
    assert len(trust.certs) == 2
    assert check_root_hash_signature(ROOT_HEX, _sig(ids["rsa"]), trust).signer.subject == \
        "CN=rsa-signer"


@pytest.mark.parametrize("digest", ["sha256", "sha384", "sha512"])
def test_sha2_digests(ids, digest):
    result = check_root_hash_signature(ROOT_HEX, _sig(ids["rsa"], digest=digest,
                                                      signed_attributes=True),
                                       _trust(ids["rsa"]))
    assert result.signer.digest == digest


def test_certificate_fingerprint_must_name_the_signer(ids):
    sig, trust = _sig(ids["rsa"]), _trust(ids["rsa"])
    fingerprint = ids["rsa"].fingerprint()
    assert check_root_hash_signature(ROOT_HEX, sig, trust, fingerprint.upper())
    with pytest.raises(SignatureError, match="not by the certificate"):
        check_root_hash_signature(ROOT_HEX, sig, trust, ids["other"].fingerprint())


# -- each refusal, one line each

@pytest.mark.parametrize("blob, message", [
    (b"", "empty signature"),
    (b"not der at all", "not a DER PKCS#7 signature"),
    (b"\x30\x80", "not a DER PKCS#7 signature"),
    (bytes(40000), "more than the kernel's 32767"),
])
def test_malformed_signature(ids, blob, message):
    with pytest.raises(SignatureError, match=message) as e:
        verify_detached(ROOT_HEX.encode(), blob, _trust(ids["rsa"]))
    assert "\n" not in str(e.value)


def test_untrusted_signer_names_it(ids):
    with pytest.raises(SignatureError, match=r"signer \(issuer .*rsa-signer.*\) is not a "
                                             r"trusted certificate"):
        check_root_hash_signature(ROOT_HEX, _sig(ids["rsa"]), _trust(ids["other"]))


def test_attribute_digest_mismatch(ids):
    with pytest.raises(SignatureError, match="message digest does not match"):
        check_root_hash_signature(ROOT_HEX[::-1], _sig(ids["ec"], signed_attributes=True),
                                  _trust(ids["ec"]))


def test_attached_content_is_refused(ids, tmp_path):
    content = tmp_path / "rh"
    content.write_text(ROOT_HEX)
    out = smime_sign(ids["rsa"], content, tmp_path / "attached.p7s", extra=("-nodetach",))
    with pytest.raises(SignatureError, match="wants a detached signature"):
        check_root_hash_signature(ROOT_HEX, out.read_bytes(), _trust(ids["rsa"]))


def test_sha1_is_refused(ids, tmp_path):
    content = tmp_path / "rh"
    content.write_text(ROOT_HEX)
    out = smime_sign(ids["rsa"], content, tmp_path / "sha1.p7s", extra=("-md", "sha1"))
    with pytest.raises(SignatureError, match="digest sha1 is not accepted"):
        check_root_hash_signature(ROOT_HEX, out.read_bytes(), _trust(ids["rsa"]))


def test_signed_content_is_lowercase_hex():
    assert signed_content(bytes.fromhex(ROOT_HEX)) == ROOT_HEX.encode()
    assert signed_content(" " + ROOT_HEX.upper() + "\n") == ROOT_HEX.encode()
    with pytest.raises(SignatureError, match="not a hex string"):
        signed_content("xyz")


# -- signing refusals

def test_sign_refuses_a_certificate_of_another_key(ids):
    with pytest.raises(SignatureError, match="is not the certificate of"):
        sign_root_hash(ROOT_HEX, str(ids["rsa"].key), str(ids["ec"].cert))


def test_sign_refuses_a_missing_key_and_a_bad_digest(ids, tmp_path):
    with pytest.raises(SignatureError, match=r"sign-key: .*missing\.key"):
        sign_root_hash(ROOT_HEX, str(tmp_path / "missing.key"), str(ids["rsa"].cert))
    with pytest.raises(SignatureError, match="digest: 'md5'"):
        sign_root_hash(ROOT_HEX, str(ids["rsa"].key), str(ids["rsa"].cert), digest="md5")


# -- trusted certificates: systemd's verity.d rules

def test_directories_first_name_wins_masks_and_order(ids, tmp_path):
    etc, usr = tmp_path / "etc", tmp_path / "usr"
    etc.mkdir()
    usr.mkdir()
    (etc / "b.crt").write_bytes(ids["rsa"].cert.read_bytes())
    (usr / "b.crt").write_bytes(ids["other"].cert.read_bytes())  # hidden by etc/b.crt
    (usr / "a.crt").write_bytes(ids["ec"].cert.read_bytes())
    (usr / "c.crt").write_bytes(ids["other"].cert.read_bytes())
    (etc / "c.crt").symlink_to("/dev/null")  # masks usr/c.crt
    (usr / "d.pem").write_bytes(ids["other"].cert.read_bytes())  # not *.crt
    (usr / ".e.crt").write_bytes(ids["other"].cert.read_bytes())  # hidden
    assert certificate_files([etc, usr]) == [str(usr / "a.crt"), str(etc / "b.crt")]
    trust = load_trusted_certs(search_path=(str(etc), str(usr)))
    assert [c.subject for c in trust.certs] == ["CN=ec-signer", "CN=rsa-signer"]


def test_directory_takes_the_first_certificate_of_each_file(ids, tmp_path):
    (tmp_path / "two.crt").write_bytes(ids["rsa"].cert.read_bytes()
                                       + ids["ec"].cert.read_bytes())
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    trust = load_trusted_certs(str(tmp_path))
    assert [c.subject for c in trust.certs] == ["CN=rsa-signer"]
    assert len(trust.skipped) == 1 and "junk.crt: not a PEM file" in trust.skipped[0]


def test_no_trusted_certificates(tmp_path):
    (tmp_path / "junk.crt").write_text("junk")
    with pytest.raises(NoTrustedCertificates, match=r"no certificate found in .*junk.crt: "
                                                    r"not a PEM file"):
        load_trusted_certs(search_path=(str(tmp_path), str(tmp_path / "absent")))
    with pytest.raises(NoTrustedCertificates, match="absent"):
        load_trusted_certs(search_path=(str(tmp_path / "absent"),))


def test_explicit_file_without_certificate(ids, tmp_path):
    with pytest.raises(SignatureError, match="no certificate in this PEM file"):
        load_trusted_certs(str(ids["rsa"].key))
    with pytest.raises(SignatureError, match="No such file"):
        load_trusted_certs(str(tmp_path / "absent.pem"))


# -- root hash files, as systemd reads them

@pytest.mark.parametrize("text", [ROOT_HEX, ROOT_HEX.upper(), ROOT_HEX + "\n",
                                  ROOT_HEX + "\r\n", " " + ROOT_HEX[:8] + " " + ROOT_HEX[8:],
                                  ROOT_HEX + "\nsecond line is ignored\n"])
def test_root_hash_text_accepted(text):
    assert parse_root_hash_text(text.encode(), "x.roothash") == ROOT_HEX


@pytest.mark.parametrize("text, message", [
    ("", "0 bytes is too short"), ("\n" + ROOT_HEX, "0 bytes is too short"),
    (ROOT_HEX[:-1], "odd number"), ("zz" * 32, "is not hex"), ("ab" * 15, "too short"),
])
def test_root_hash_text_refused(text, message):
    with pytest.raises(SidecarError, match=f"x.roothash: root hash .*{message}"):
        parse_root_hash_text(text.encode(), "x.roothash")


# -- sidecar discovery

def test_auxiliary_path_drops_raw():
    assert auxiliary_path("/i/disk.raw", ".roothash") == "/i/disk.roothash"
    assert auxiliary_path("/i/disk.img", ".verity") == "/i/disk.img.verity"
    assert auxiliary_path("https://h/disk.raw", ".roothash.p7s") == "https://h/disk.roothash.p7s"


def test_a_urls_sidecar_keeps_its_query_after_the_path():
    assert (auxiliary_path("https://h/disk.raw?token=t&x=1", ".roothash")
            == "https://h/disk.roothash?token=t&x=1")
    assert auxiliary_path("http://u:p@h:8/d.img?t=1", ".verity") == "http://u:p@h:8/d.img.verity?t=1"
    assert auxiliary_path("s3://b/k.raw", ".verity") == "s3://b/k.verity"
    assert auxiliary_path("/i/d.img?x", ".verity") == "/i/d.img?x.verity"  # a path as it is


def test_find_all_sidecars(ids, tmp_path):
    image = tmp_path / "disk.raw"
    image.write_bytes(b"")
    (tmp_path / "disk.roothash").write_text(ROOT_HEX.upper() + "\n")
    (tmp_path / "disk.roothash.p7s").write_bytes(_sig(ids["rsa"]))
    (tmp_path / "disk.verity").write_bytes(b"")
    found = find_sidecars(str(image), xattr=None)
    assert found.root_hash == ROOT_HEX and found.partition == "root"
    assert found.root_hash_source == str(tmp_path / "disk.roothash")
    assert found.signature_path == str(tmp_path / "disk.roothash.p7s")
    assert found.hash_image == str(tmp_path / "disk.verity")
    assert check_root_hash_signature(found.root_hash, found.signature, _trust(ids["rsa"]))


def test_find_nothing(tmp_path):
    found = find_sidecars(str(tmp_path / "disk.raw"), xattr=None)
    assert (found.root_hash, found.signature, found.hash_image) == (None, None, None)


def test_usrhash_pair(ids, tmp_path):
    (tmp_path / "usr.usrhash").write_text(ROOT_HEX)
    (tmp_path / "usr.usrhash.p7s").write_bytes(_sig(ids["rsa"]))
    (tmp_path / "usr.roothash.p7s").write_bytes(b"ignored: the root hash is a usr hash")
    found = find_sidecars(str(tmp_path / "usr"), xattr=None)
    assert found.partition == "usr" and found.signature_path.endswith("usr.usrhash.p7s")


def test_signature_looked_up_when_the_root_hash_is_given(ids, tmp_path):
    (tmp_path / "d.roothash").write_text("not hex, and not read")
    (tmp_path / "d.roothash.p7s").write_bytes(_sig(ids["rsa"]))
    found = find_sidecars(str(tmp_path / "d"), xattr=None, root_hash_given=True)
    assert found.root_hash is None and found.signature_path.endswith("d.roothash.p7s")


def test_no_signature_looked_up_without_a_root_hash(tmp_path):
    (tmp_path / "d.roothash.p7s").write_bytes(b"x")
    assert find_sidecars(str(tmp_path / "d"), xattr=None).signature is None


def test_empty_signature_file_refused(tmp_path):
    (tmp_path / "d.roothash").write_text(ROOT_HEX)
    (tmp_path / "d.roothash.p7s").write_bytes(b"")
    with pytest.raises(SidecarError, match=r"d\.roothash\.p7s: empty signature file"):
        find_sidecars(str(tmp_path / "d"), xattr=None)


def test_xattr_before_file(tmp_path):
    image = tmp_path / "d.raw"
    image.write_bytes(b"")
    (tmp_path / "d.roothash").write_text("ab" * 32)
    try:
        os.setxattr(image, "user.verity.roothash", ROOT_HEX.encode())
    except OSError:
        pytest.skip("this file system has no user xattrs")
    found = find_sidecars(str(image))
    assert found.root_hash == ROOT_HEX and "xattr user.verity.roothash" in found.root_hash_source


def test_reader_is_pluggable():
    """Any reader works (the seam for images named by URL)."""
    files = {"https://h/d.roothash": ROOT_HEX.encode(), "https://h/d.roothash.p7s": b"sig"}
    found = find_sidecars("https://h/d.raw", read=files.get, exists=files.__contains__,
                          xattr=None)
    assert found.root_hash == ROOT_HEX and found.signature == b"sig"
    assert found.hash_image is None


# -- verity.sig

def _verity_sig(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_verity_sig_with_nul_padding(ids):
    der = _sig(ids["rsa"])
    blob = _verity_sig(rootHash=ROOT_HEX.upper(), signature=base64.b64encode(der).decode(),
                       certificateFingerprint=ids["rsa"].fingerprint())
    sig = parse_verity_sig(blob + bytes(4096 - len(blob)), "verity.sig")
    assert (sig.root_hash, sig.signature) == (ROOT_HEX, der)
    result = check_root_hash_signature(sig.root_hash, sig.signature, _trust(ids["rsa"]),
                                       sig.certificate_fingerprint)
    assert result.signer.fingerprint == sig.certificate_fingerprint


def test_verity_sig_fingerprint_optional_and_base64_with_newlines(ids):
    der = _sig(ids["ec"])
    text = base64.b64encode(der).decode()
    wrapped = "\n".join(text[i:i + 64] for i in range(0, len(text), 64))
    sig = parse_verity_sig(_verity_sig(rootHash=ROOT_HEX, signature=wrapped), "v")
    assert sig.signature == der and sig.certificate_fingerprint is None


@pytest.mark.parametrize("blob, message", [
    (b'{"rootHash": "' + ROOT_HEX.encode() + b'", "signature": "AA=="}\0x\0', "after the NUL"),
    (b"[1, 2]", "not a JSON object"), (b"{", "not a JSON object"), (b"\xff{}", "not a JSON"),
    (b'{"signature": "AA=="}', "no 'rootHash' field"),
    (b'{"rootHash": "' + ROOT_HEX.encode() + b'"}', "no 'signature' field"),
    (b'{"rootHash": 5, "signature": "AA=="}', "'rootHash' is not a string"),
    (b'{"rootHash": "' + ROOT_HEX.encode() + b'", "signature": "!!"}', "not base64"),
    (b'{"rootHash": "' + ROOT_HEX.encode() + b'", "signature": ""}', "empty signature"),
    (b'{"rootHash": "' + ROOT_HEX.encode() + b'", "signature": "AA==", '
     b'"certificateFingerprint": "abc"}', "not a SHA-256 in hex"),
    (b'{"rootHash": "xyzw", "signature": "AA=="}', "rootHash 'xyzw' is not hex"),
])
def test_verity_sig_refused(blob, message):
    with pytest.raises(SidecarError, match=message):
        parse_verity_sig(blob, "verity.sig")


def test_read_signature_file_sniffs_der_and_json(ids, tmp_path):
    der = _sig(ids["rsa"])
    (tmp_path / "a.p7s").write_bytes(der)
    (tmp_path / "verity.sig").write_bytes(
        b"\n" + _verity_sig(rootHash=ROOT_HEX, signature=base64.b64encode(der).decode()))
    assert read_signature_file(str(tmp_path / "a.p7s")) == (der, None)
    blob, sig = read_signature_file(str(tmp_path / "verity.sig"))
    assert blob == der and sig.root_hash == ROOT_HEX
    with pytest.raises(SidecarError, match="no such file"):
        read_signature_file(str(tmp_path / "absent.p7s"))


def test_openssl_fingerprint_matches_ours(ids):
    out = openssl("x509", "-in", str(ids["ec"].cert), "-noout", "-subject")
    assert "ec-signer" in out.stdout.decode()
    assert load_trusted_certs(str(ids["ec"].cert)).certs[0].fingerprint == \
        ids["ec"].fingerprint()


# -- resolve_root: the one entry point for the server and the CLI

def _sidecar_image(tmp_path, ids, signature=True):
    image = tmp_path / "disk.raw"
    image.write_bytes(b"")
    (tmp_path / "disk.roothash").write_text(ROOT_HEX + "\n")
    (tmp_path / "disk.verity").write_bytes(b"")
    if signature:
        (tmp_path / "disk.roothash.p7s").write_bytes(_sig(ids["rsa"]))
    return str(image)


def test_resolve_from_sidecars_signed(ids, tmp_path):
    root = resolve_root(_sidecar_image(tmp_path, ids), trusted_certs=str(ids["rsa"].cert),
                        require_signatures=True, xattr=None)
    assert root.hash_image == str(tmp_path / "disk.verity") and root.root_hex == ROOT_HEX
    assert root.describe().startswith(f"root hash {ROOT_HEX} signed by CN=rsa-signer")
    assert root.status()["fingerprint"] == ids["rsa"].fingerprint()


def test_resolve_refuses_unsigned_under_require_signatures(ids, tmp_path):
    image = _sidecar_image(tmp_path, ids, signature=False)
    assert not resolve_root(image, xattr=None).status()["signed"]
    with pytest.raises(SignatureError, match="require-signatures: the root hash is not signed"):
        resolve_root(image, require_signatures=True, xattr=None)


def test_resolve_refuses_a_wrong_signature_even_without_require(ids, tmp_path):
    with pytest.raises(SignatureError, match="not a trusted certificate"):
        resolve_root(_sidecar_image(tmp_path, ids), trusted_certs=str(ids["other"].cert),
                     xattr=None)


def test_resolve_given_root_hash_wins_and_verity_sig_must_agree(ids, tmp_path):
    image = _sidecar_image(tmp_path, ids)
    vsig = tmp_path / "verity.sig"
    vsig.write_bytes(_verity_sig(rootHash=ROOT_HEX,
                                 signature=base64.b64encode(_sig(ids["ec"])).decode()))
    root = resolve_root(image, root_hash=ROOT_HEX.upper(), signature_path=str(vsig),
                        trusted_certs=str(ids["ec"].cert), xattr=None)
    assert root.root_hash_source == "given" and root.signature_source == str(vsig)
    with pytest.raises(SignatureError, match="is for root hash"):
        resolve_root(image, root_hash="ab" * 32, signature_path=str(vsig), xattr=None)


def test_resolve_expired_signer_is_a_warning(ids, tmp_path):
    image = _sidecar_image(tmp_path, ids)
    (tmp_path / "disk.roothash.p7s").write_bytes(_sig(ids["expired"]))
    root = resolve_root(image, trusted_certs=str(ids["expired"].cert), xattr=None)
    assert root.signature and "is not valid now (until 2020-01-01)" in root.warnings[0]


def test_resolve_missing_pieces(tmp_path):
    with pytest.raises(ConfigError, match=r"hash: missing .*disk\.verity"):
        resolve_root(str(tmp_path / "disk.raw"), root_hash=ROOT_HEX, xattr=None)
    with pytest.raises(ConfigError, match=r"root-hash: missing .*disk\.roothash"):
        resolve_root(str(tmp_path / "disk.raw"), hash_image="h", xattr=None)
