"""`nbd-verity sign`: sign a root hash as the kernel and systemd check it.

The signature is trust.signing.sign_root_hash's: a detached DER PKCS#7 over the lowercase
hex root hash, the bytes of `openssl smime -sign -nocerts -noattr -binary -outform der`.
`--sidecars IMAGE` writes IMAGE.roothash and IMAGE.roothash.p7s where `serve IMAGE` and
`verify IMAGE` (and systemd-dissect) look for them.
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import ConfigError
from ..files import check_outputs
from ..format.roothash import root_hash_text
from ..sources.source import image_size
from ..trust.certs import parse_pem_certificates
from ..trust.sidecar import auxiliary_path, parse_hex, write_file, write_sidecars
from ..trust.signature import HASHES
from ..trust.signing import sign_root_hash
from .common import edge


@click.command("sign")
@click.argument("root_hash", required=False)
@click.option("--key", "key_path", required=True, metavar="KEY.pem",
              help="The signing key (PEM, RSA or EC, unencrypted).")
@click.option("--cert", "cert_path", required=True, metavar="CERT.pem",
              help="The key's certificate (PEM); verifiers must trust it.")
@click.option("--root-hash-file", default=None, metavar="FILE",
              help="Read the root hash (hex) from this file.")
@click.option("-o", "--output", default=None, metavar="OUT.p7s",
              help="Write the DER signature here ('-': standard output).")
@click.option("--sidecars", "image", default=None, metavar="IMAGE",
              help="Write IMAGE.roothash and IMAGE.roothash.p7s beside IMAGE "
                   "(a .raw suffix dropped).")
@click.option("--digest", type=click.Choice(list(HASHES)), default="sha256",
              show_default=True, help="Digest of the signature.")
@edge
def sign_cmd(root_hash: str | None, key_path: str, cert_path: str,
             root_hash_file: str | None, output: str | None, image: str | None,
             digest: str) -> None:
    """Sign ROOT_HASH (or --root-hash-file) with KEY and CERT: a detached PKCS#7 over
    the lowercase hex, as `veritysetup open --root-hash-signature` and systemd take it."""
    if output is None and image is None:
        raise ConfigError("output: give -o FILE or --sidecars IMAGE")
    if image is not None:
        if not os.path.exists(image):
            raise ConfigError(f"sidecars: {image}: no such image")
        image_size(image, "sidecars")  # one that opens: a regular file or a block device
    sidecars = ((("sidecars", auxiliary_path(image, ".roothash")),
                 ("sidecars", auxiliary_path(image, ".roothash.p7s"))) if image else ())
    check_outputs((("output", output), *sidecars),
                  (("signing key", key_path), ("certificate", cert_path),
                   ("root hash file", root_hash_file), ("image", image)))
    root_hex = parse_hex(root_hash_text(root_hash, root_hash_file), "root-hash", "root hash")
    der = sign_root_hash(root_hex, key_path, cert_path, digest=digest)
    report = sys.stderr if output == "-" else sys.stdout
    if output == "-":
        sys.stdout.buffer.write(der)
        sys.stdout.flush()
    elif output is not None:
        write_file(output, der)
        click.echo(f"wrote {output}", file=report)
    if image is not None:
        roothash, signature = write_sidecars(image, root_hex, der)
        click.echo(f"wrote {roothash} and {signature}", file=report)
    signer = signer_of(cert_path)
    click.echo(f"signed root hash {root_hex} as {signer.subject} "
               f"(sha256 {signer.fingerprint})", file=report)


def signer_of(cert_path: str):
    """The certificate that signed (sign_root_hash has read and checked it already)."""
    with open(cert_path, "rb") as f:
        return parse_pem_certificates(f.read(), cert_path, first_only=True)[0]
