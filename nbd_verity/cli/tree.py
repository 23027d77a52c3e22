"""`nbd-verity format`, `verify` and `dump`: the offline tree commands.

Each command only turns options into VerityParams and calls the library (builder,
params); errors become one line on stderr and a non-zero exit, never a traceback.
Options are spelled as veritysetup spells them.
"""

from __future__ import annotations

import contextlib
import os
import sys

import click

from .. import builder
from ..digest import parse_salt
from ..errors import ConfigError, VerityError
from ..limits import block_size_problem
from ..params import VerityParams, load_params, parse_uuid, random_salt, random_uuid, read_params
from ..roothash import root_digest, root_hash_text
from ..trust.root import resolve_root
from .common import EXIT_CORRUPT, TREE_OPTIONS, edge, fail, geometry_options, image_arguments


def data_size_of(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.seek(0, os.SEEK_END)
    except OSError as e:
        raise VerityError(f"{path}: {e.strerror}") from None


def tree_options(kw: dict) -> dict:
    """Take the geometry options out of kw into load_params' dictionary (salt parsed)."""
    opts = {name: kw.pop(name) for name in TREE_OPTIONS}
    if opts["salt"] is not None:
        opts["salt"] = parse_salt(opts["salt"])
    return opts


def print_header(hash_path: str, params: VerityParams, root: bytes | None = None) -> None:
    """veritysetup's header block: the same field names, tabs and order."""
    geo = params.geometry()
    lines = [
        f"VERITY header information for {hash_path}",
        f"UUID:            \t{params.uuid_text if params.superblock else ''}",
        f"Hash type:       \t{params.hash_type}",
        f"Data blocks:     \t{params.data_blocks}",
        f"Data block size: \t{params.data_block_size}",
        f"Hash blocks:     \t{geo.hash_blocks}",
        f"Hash block size: \t{params.hash_block_size}",
        f"Hash algorithm:  \t{params.algorithm}",
        f"Salt:            \t{params.salt.hex() or '-'}",
    ]
    if root is not None:
        lines.append(f"Root hash:      \t{root.hex()}")
    if params.hash_offset == 0:  # as veritysetup: dump cannot know the offsets otherwise
        lines.append(f"Hash device size: \t{geo.hash_image_size} [bytes]")
    click.echo("\n".join(lines))


@contextlib.contextmanager
def progress_bar(total: int, label: str):
    """A progress bar on a terminal (stderr) for large images; nothing otherwise."""
    if not sys.stderr.isatty() or total < (256 << 20):
        yield None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


@click.command("format")
@click.argument("data")
@click.argument("hash_image", metavar="HASH")
@geometry_options
@click.option("--uuid", default=None, help="UUID for the superblock (default: random).")
@click.option("--root-hash-file", default=None, type=click.Path(dir_okay=False),
              help="Also write the root hash (hex) to this file.")
@click.option("--sign-key", default=None, metavar="KEY.pem",
              help="Sign the root hash with this key (with --sign-cert): writes "
                   "DATA.roothash and DATA.roothash.p7s, as `nbd-verity sign --sidecars`.")
@click.option("--sign-cert", default=None, metavar="CERT.pem", help="The signing key's cert.")
@edge
def format_cmd(data: str, hash_image: str, uuid: str | None, root_hash_file: str | None,
               sign_key: str | None, sign_cert: str | None, **kw) -> None:
    """Build the hash tree of DATA into HASH and print the root hash."""
    if (sign_key is None) != (sign_cert is None):
        raise ConfigError("sign-key: give --sign-key and --sign-cert together")
    opts = tree_options(kw)
    size = data_size_of(data)
    dbs = _given(opts["data_block_size"], 4096)
    problem = block_size_problem("data-block-size", dbs)
    if problem:  # checked before it divides the data size
        raise ConfigError(problem)
    blocks = opts["data_blocks"] if opts["data_blocks"] is not None else size // dbs
    if opts["data_blocks"] is None and blocks == 0:
        raise ConfigError(f"{data}: {size} bytes, less than one {dbs}-byte data block")
    params = VerityParams(
        data_blocks=blocks,
        hash_type=1 if opts["hash_type"] is None else opts["hash_type"],
        algorithm=_given(opts["algorithm"], "sha256").lower(),
        data_block_size=dbs, hash_block_size=_given(opts["hash_block_size"], 4096),
        salt=random_salt() if opts["salt"] is None else opts["salt"],
        uuid=parse_uuid(uuid) if uuid else random_uuid(),
        hash_offset=_given(opts["hash_offset"], 0), superblock=not opts["no_superblock"],
    ).check()
    if blocks * dbs > size:
        raise ConfigError(f"data-blocks: {blocks} blocks of {dbs} bytes exceed {data} "
                          f"({size} bytes)")
    _check_overlap(data, hash_image, params)
    if opts["data_blocks"] is None and size % dbs:  # warn only once the options are valid
        click.echo(f"nbd-verity: warning: {data}: the last {size % dbs} bytes are not a whole "
                   f"block and are not protected", err=True)
    with progress_bar(params.data_blocks * dbs, "Hashing") as update:
        root = builder.build_tree(data, hash_image, params, update)
    print_header(hash_image, params, root)
    if root_hash_file:
        with open(root_hash_file, "w") as f:
            f.write(root.hex())
    if sign_key is not None:
        _sign_beside(data, root.hex(), sign_key, sign_cert)


def _sign_beside(data: str, root_hex: str, key: str, cert: str) -> None:
    """format --sign-key/--sign-cert: the signature and root hash as sidecars of DATA."""
    from ..trust.sidecar import write_sidecars  # cryptography only when signing
    from ..trust.signing import sign_root_hash
    roothash, p7s = write_sidecars(data, root_hex, sign_root_hash(root_hex, key, cert))
    click.echo(f"Signed root hash written to {roothash} and {p7s}")


def _given(value, default):
    """An option's value, or its default when it was not given (0 and "" are values)."""
    return default if value is None else value


def _check_overlap(data: str, hash_image: str, params: VerityParams) -> None:
    """Refuse a tree that would be written over the data it protects."""
    if os.path.exists(hash_image) and os.path.samefile(data, hash_image):
        data_end = params.data_blocks * params.data_block_size
        if params.hash_offset < data_end:
            raise ConfigError(f"hash-offset: {params.hash_offset} overlaps the data area "
                              f"(which ends at byte {data_end})")


@click.command("verify")
@image_arguments
@edge
def verify_cmd(data: str, hash_image: str | None, root_hash: str | None,
               root_hash_file: str | None, root_hash_signature: str | None,
               trusted_certs: str | None, require_signatures: bool, **kw) -> None:
    """Check every block of DATA against HASH and the trusted ROOT_HASH (or the
    IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s beside DATA)."""
    trusted = resolve_root(data, hash_image,
                           root_hash_text(root_hash, root_hash_file, required=False),
                           root_hash_signature, trusted_certs, require_signatures)
    for warning in trusted.warnings:
        click.echo(f"nbd-verity: warning: {warning}", err=True)
    hash_image = trusted.hash_image
    params = load_params(hash_image, tree_options(kw), data_size_of(data))
    root = root_digest(trusted.root_hex, params.digester().digest_size)
    size = data_size_of(data)
    if size < params.data_blocks * params.data_block_size:
        raise VerityError(f"{data}: {size} bytes, the tree covers "
                          f"{params.data_blocks * params.data_block_size}")
    with progress_bar(params.data_blocks * params.data_block_size, "Verifying") as update:
        report = builder.verify_image(data, hash_image, params, root, update)
    if report.ok:
        click.echo(f"Verified {params.data_blocks} data blocks: OK")
        if trusted.signature is not None or trusted.root_hash_source != "given":
            click.echo(f"Trust: {trusted.describe()}")
        return
    for error in report.bad:
        click.echo(f"nbd-verity: {error}", err=True)
    if report.bad_count > len(report.bad):
        click.echo(f"nbd-verity: ... {report.bad_count - len(report.bad)} more", err=True)
    fail(f"verification failed: {report.bad_count} corrupted block(s)", EXIT_CORRUPT)


@click.command("dump")
@click.argument("hash_image", metavar="HASH")
@click.option("--hash-offset", type=int, default=0, metavar="BYTES",
              help="Where the superblock sits in the hash image.")
@edge
def dump_cmd(hash_image: str, hash_offset: int) -> None:
    """Print the superblock of HASH as veritysetup dump does."""
    print_header(hash_image, read_params(hash_image, hash_offset))
