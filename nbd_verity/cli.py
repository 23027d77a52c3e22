"""The `nbd-verity` command line: format, verify, dump (and serve, ctl, tune later).

Each command only turns options into VerityParams (or a server config) and calls the
library; errors become one line on stderr and a non-zero exit, never a traceback.
Options are spelled as veritysetup spells them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import click

from . import builder
from .cli_common import root_digest
from .digest import parse_salt
from .errors import ConfigError, VerityError
from .params import VerityParams, load_params, parse_uuid, random_salt, random_uuid, read_params
from .superblock import block_size_ok

EXIT_CORRUPT = 1  # verify found corruption
EXIT_ERROR = 2  # bad input: options, files, formats


def fail(message: str, code: int = EXIT_ERROR):
    click.echo(f"nbd-verity: {message}", err=True)
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
            fail("interrupted", 130)
    return wrapper


def _geometry_options(fn):
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


def _tree_options(kw: dict) -> dict:
    """Collect the geometry options into load_params' dictionary."""
    salt = kw.pop("salt")
    return {
        "algorithm": kw.pop("algorithm"), "salt": None if salt is None else parse_salt(salt),
        "data_block_size": kw.pop("data_block_size"),
        "hash_block_size": kw.pop("hash_block_size"), "data_blocks": kw.pop("data_blocks"),
        "hash_offset": kw.pop("hash_offset"), "no_superblock": kw.pop("no_superblock"),
        "hash_type": kw.pop("hash_type"),
    }


def data_size_of(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.seek(0, os.SEEK_END)
    except OSError as e:
        raise VerityError(f"{path}: {e.strerror}") from None


def read_root_hash(root_hash: str | None, root_hash_file: str | None, digest_size: int) -> bytes:
    """The trusted root digest from the argument or from --root-hash-file."""
    if root_hash is not None and root_hash_file is not None:
        raise ConfigError("root-hash: give it as an argument or with --root-hash-file, not both")
    if root_hash_file is not None:
        try:
            with open(root_hash_file) as f:
                root_hash = f.read().strip()
        except OSError as e:
            raise ConfigError(f"root-hash-file: {root_hash_file}: {e.strerror}") from None
    if root_hash is None:
        raise ConfigError("root-hash: missing (argument or --root-hash-file)")
    return root_digest(root_hash, digest_size)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"],
                               "auto_envvar_prefix": "NBD_VERITY"})
@click.version_option(package_name="nbd-verity")
def main() -> None:
    """A verified (dm-verity) block server for NBD, and its tools."""


@main.command("format")
@click.argument("data")
@click.argument("hash_image", metavar="HASH")
@_geometry_options
@click.option("--uuid", default=None, help="UUID for the superblock (default: random).")
@click.option("--root-hash-file", default=None, type=click.Path(dir_okay=False),
              help="Also write the root hash (hex) to this file.")
@edge
def format_cmd(data: str, hash_image: str, uuid: str | None, root_hash_file: str | None,
               **kw) -> None:
    """Build the hash tree of DATA into HASH and print the root hash."""
    opts = _tree_options(kw)
    size = data_size_of(data)
    dbs = _given(opts["data_block_size"], 4096)
    if not block_size_ok(dbs):  # checked before it divides the data size
        raise ConfigError(f"data-block-size: {dbs} is not a power of two from 512 to 524288")
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


@main.command("verify")
@click.argument("data")
@click.argument("hash_image", metavar="HASH")
@click.argument("root_hash", required=False)
@_geometry_options
@click.option("--root-hash-file", default=None, help="Read the root hash (hex) from this file.")
@edge
def verify_cmd(data: str, hash_image: str, root_hash: str | None,
               root_hash_file: str | None, **kw) -> None:
    """Check every block of DATA against HASH and the trusted ROOT_HASH."""
    params = load_params(hash_image, _tree_options(kw), data_size_of(data))
    root = read_root_hash(root_hash, root_hash_file, params.digester().digest_size)
    size = data_size_of(data)
    if size < params.data_blocks * params.data_block_size:
        raise VerityError(f"{data}: {size} bytes, the tree covers "
                          f"{params.data_blocks * params.data_block_size}")
    with progress_bar(params.data_blocks * params.data_block_size, "Verifying") as update:
        report = builder.verify_image(data, hash_image, params, root, update)
    if report.ok:
        click.echo(f"Verified {params.data_blocks} data blocks: OK")
        return
    for error in report.bad:
        click.echo(f"nbd-verity: {error}", err=True)
    if report.bad_count > len(report.bad):
        click.echo(f"nbd-verity: ... {report.bad_count - len(report.bad)} more", err=True)
    fail(f"verification failed: {report.bad_count} corrupted block(s)", EXIT_CORRUPT)


@main.command("dump")
@click.argument("hash_image", metavar="HASH")
@click.option("--hash-offset", type=int, default=0, metavar="BYTES",
              help="Where the superblock sits in the hash image.")
@edge
def dump_cmd(hash_image: str, hash_offset: int) -> None:
    """Print the superblock of HASH as veritysetup dump does."""
    print_header(hash_image, read_params(hash_image, hash_offset))


from . import cli_ctl, cli_serve, cli_tune  # noqa: E402,F401  (register `serve`, `ctl`, `tune`)

if __name__ == "__main__":
    main()
