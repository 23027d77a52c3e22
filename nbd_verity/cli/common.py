"""What every command shares: exit codes, the error edge, and veritysetup's tree options.

Command modules import this one and the library, never each other or the group in
main.py, so the CLI has no import circle.
"""

from __future__ import annotations

import functools
import sys

import click

from ..errors import VerityError
from ..sources.remote import redact_text

EXIT_CORRUPT = 1  # verify found corruption; a control request the server refused
EXIT_ERROR = 2  # bad input: options, files, formats
EXIT_INTERRUPTED = 130


def say(message: str) -> None:
    """One error line on stderr, every URL in it redacted (a user part's password, a
    query's token: verify, dump and tune take DATA and HASH as paths, and a URL given
    them is named in the error as a file; click's parse errors repeat a bad value)."""
    click.echo(f"nbd-verity: {redact_text(message)}", err=True)


def fail(message: str, code: int = EXIT_ERROR):
    """The command's one line (say()), and its exit status."""
    say(message)
    sys.exit(code)


def edge(fn):
    """Translate library errors into one line and an exit status (the CLI's edge)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VerityError as e:
            fail(str(e))
        except OSError as e:
            fail(f"{e.filename or 'I/O'}: {e.strerror}")
        except KeyboardInterrupt:
            fail("interrupted", EXIT_INTERRUPTED)
    return wrapper


def geometry_options(fn):
    """The tree options shared by format, verify and serve (veritysetup's spelling)."""
    options = [
        click.option("--hash", "algorithm", default=None, metavar="ALG",
                     help="Hash algorithm (default sha256)."),
        click.option("--salt", default=None, metavar="HEX",
                     help="Salt as hex; '-' for none (default: 32 random bytes)."),
        click.option("--data-block-size", type=int, default=None, metavar="BYTES",
                     help="Data block size (default 4096)."),
        click.option("--hash-block-size", type=int, default=None, metavar="BYTES",
                     help="Hash block size (default 4096)."),
        click.option("--data-blocks", type=int, default=None, metavar="N",
                     help="Number of data blocks (default: the whole data image)."),
        click.option("--hash-offset", type=int, default=None, metavar="BYTES",
                     help="Where the superblock/tree starts in the hash image."),
        click.option("--no-superblock", is_flag=True, help="No superblock on disk."),
        click.option("--format", "hash_type", type=int, default=None, metavar="0|1",
                     help="Hash format: 1 normal (default), 0 Chrome OS."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


TREE_OPTIONS = ("algorithm", "salt", "data_block_size", "hash_block_size", "data_blocks",
                "hash_offset", "no_superblock", "hash_type")


def fec_options(fn):
    """Where the Reed-Solomon parity is (veritysetup's --fec-device, --fec-roots,
    --fec-offset): format writes it, verify and serve repair with it, dump describes it."""
    for decorator in reversed((
            click.option("--fec-device", default=None, metavar="FEC",
                         help="Reed-Solomon parity (FEC) image; may be HASH itself with "
                              "--fec-offset."),
            click.option("--fec-roots", type=int, default=None, metavar="N",
                         help="Parity bytes per 255-byte codeword, 2..24 (default 2)."),
            click.option("--fec-offset", type=int, default=None, metavar="BYTES",
                         help="Where the parity starts on the FEC device (default 0)."))):
        fn = decorator(fn)
    return fn


def trust_options(fn):
    """Where the root hash's signature and the trusted certificates are, and whether one
    is required (docs/trust.md); the plugin keys of the same names."""
    for decorator in reversed((
            click.option("--root-hash-signature", default=None, metavar="FILE",
                         help="Detached DER PKCS#7 signature of the root hash, or a "
                              "verity.sig JSON file (default: IMAGE.roothash.p7s if "
                              "present)."),
            click.option("--trusted-certs", default=None, metavar="PATH",
                         help="PEM file or directory of *.crt to check signatures with "
                              "(default: /etc/verity.d, /run/verity.d, "
                              "/usr/local/lib/verity.d, /usr/lib/verity.d)."),
            click.option("--require-signatures", is_flag=True,
                         help="Refuse a root hash without a valid signature."))):
        fn = decorator(fn)
    return fn


def image_arguments(fn=None, *, optional_data: bool = False):
    """DATA [HASH [ROOT_HASH]], the tree options, --root-hash-file and the trust options:
    what names a verity device to check or serve (verify, serve). HASH and ROOT_HASH may
    be left out when DATA's sidecars (IMAGE.verity, IMAGE.roothash) are beside it; DATA
    too with optional_data (serve: an export file may name it instead)."""
    if fn is None:
        return lambda f: image_arguments(f, optional_data=optional_data)
    for decorator in reversed((
            click.argument("data", metavar="[DATA" if optional_data else "DATA",
                           required=not optional_data),
            click.argument("hash_image", metavar="[HASH", required=False),
            click.argument("root_hash", metavar="[ROOT_HASH]]]" if optional_data
                           else "[ROOT_HASH]]", required=False),
            geometry_options,
            click.option("--root-hash-file", default=None,
                         help="Read the root hash (hex) from this file."),
            click.option("--partition", type=click.Choice(("auto", "root", "usr")),
                         default=None,
                         help="DATA is a Discoverable Disk Image: serve its root or usr "
                              "verity triple (auto: the only one). Then the second "
                              "argument is the ROOT_HASH. Default: a DDI when DATA starts "
                              "with a GPT and no HASH is given or found."),
            trust_options)):
        fn = decorator(fn)
    return fn


def s3_options(fn):
    """Where s3:// images are read from and as whom (sources/s3.py): the endpoint, and
    a profile or credentials file; secrets themselves only through the environment."""
    for decorator in reversed((
            click.option("--s3-endpoint", default=None, metavar="URL",
                         help="S3 endpoint for s3:// images (MinIO, Ceph, a local store; "
                              "default: AWS)."),
            click.option("--s3-profile", default=None, metavar="NAME",
                         help="Profile of the AWS credentials file for s3:// images."),
            click.option("--s3-credentials", default=None, metavar="FILE",
                         type=click.Path(exists=True, dir_okay=False),
                         help="AWS shared credentials file for s3:// images (default "
                              "~/.aws/credentials, or AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY in the environment)."))):
        fn = decorator(fn)
    return fn


def ddi_arguments(options: dict) -> None:
    """For a DDI, the second argument is its ROOT_HASH (prepare/keys.py has the rule)."""
    from ..prepare.keys import settle_ddi_arguments  # the GPT code only for a DDI
    settle_ddi_arguments(options)
