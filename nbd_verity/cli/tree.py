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

from ..errors import ConfigError, VerityError
from ..files import check_outputs, write_atomically
from ..format import builder
from ..format.areas import check_layout
from ..format.digest import parse_salt
from ..format.params import (
    VerityParams,
    parse_uuid,
    random_salt,
    random_uuid,
    read_params,
)
from ..format.roothash import root_digest, root_hash_text
from ..limits import block_size_problem
from ..sources.source import ImageFile, check_output_room, image_size
from ..trust.root import resolve_root
from ..trust.sidecar import auxiliary_path
from .common import (
    EXIT_CORRUPT,
    TREE_OPTIONS,
    ddi_arguments,
    edge,
    fail,
    fec_options,
    geometry_options,
    image_arguments,
)


def tree_options(kw: dict) -> dict:
    """Take the geometry options out of kw into load_params' dictionary (salt parsed)."""
    opts = {name: kw.pop(name) for name in TREE_OPTIONS}
    if opts["salt"] is not None:
        opts["salt"] = parse_salt(opts["salt"])
    return opts


def print_header(hash_path: str, params: VerityParams, root: bytes | None = None,
                 fec=None) -> None:
    """veritysetup's header block: the same field names, tabs and order; with fec (a
    FecGeometry) the lines veritysetup adds for --fec-device."""
    geo = params.geometry()
    hash_device_size = geo.hash_image_size
    if fec is not None and fec.on_hash_device:
        hash_device_size += fec.parity_size  # what veritysetup prints: tree, then parity
    lines = [
        f"VERITY header information for {hash_path}",
        f"UUID:            \t{params.uuid_text if params.superblock else ''}",
        f"Hash type:       \t{params.hash_type}",
        f"Data blocks:     \t{params.data_blocks}",
        f"Data block size: \t{params.data_block_size}",
        f"Hash blocks:     \t{geo.hash_blocks}",
        f"Hash block size: \t{params.hash_block_size}",
        f"Hash algorithm:  \t{params.algorithm}",
        *(fec.dump_lines() if fec is not None else ()),
        f"Salt:            \t{params.salt.hex() or '-'}",
    ]
    if root is not None:
        lines.append(f"Root hash:      \t{root.hex()}")
    if params.hash_offset == 0:  # as veritysetup: dump cannot know the offsets otherwise
        lines.append(f"Hash device size: \t{hash_device_size} [bytes]")
    if fec is not None and not fec.fec_offset and not fec.on_hash_device:
        lines.append(f"FEC device size: \t{fec.parity_size} [bytes]")
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
@fec_options
@edge
def format_cmd(data: str, hash_image: str, uuid: str | None, root_hash_file: str | None,
               sign_key: str | None, sign_cert: str | None, fec_device: str | None,
               fec_roots: int | None, fec_offset: int | None, **kw) -> None:
    """Build the hash tree of DATA into HASH and print the root hash; with --fec-device,
    also the Reed-Solomon parity that lets a reader repair corrupted blocks."""
    if (sign_key is None) != (sign_cert is None):
        raise ConfigError("sign-key: give --sign-key and --sign-cert together")
    opts = tree_options(kw)
    size = image_size(data, "data")
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
    fec = _fec_request(params, hash_image, fec_device, fec_roots, fec_offset)
    check_layout(params, data, hash_image, fec and fec[2], fec_device)  # before any write
    _check_format_outputs(data, hash_image, fec_device, root_hash_file, sign_key, sign_cert)
    if opts["data_blocks"] is None and size % dbs:  # warn only once the options are valid
        click.echo(f"nbd-verity: warning: {data}: the last {size % dbs} bytes are not a whole "
                   f"block and are not protected", err=True)
    created = [p for p in dict.fromkeys((hash_image, fec_device)) if p and not os.path.lexists(p)]
    try:
        with progress_bar(params.data_blocks * dbs, "Hashing") as update:
            root = builder.build_tree(data, hash_image, params, update)
        fec_geo = None
        if fec is not None:
            from ..fec.image import write_fec  # the codec only when asked for
            fec_geo = write_fec(data, hash_image, fec_device, params, *fec[:2])
        if root_hash_file:
            write_atomically(root_hash_file, root.hex())
        if sign_key is not None:
            _sign_beside(data, root.hex(), sign_key, sign_cert)
    except BaseException:
        for path in created:  # a failed format leaves no output it created
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    print_header(hash_image, params, root, fec_geo)
    if sign_key is not None:
        click.echo(f"Signed root hash written to {auxiliary_path(data, '.roothash')} and "
                   f"{auxiliary_path(data, '.roothash.p7s')}")


def _check_format_outputs(data: str, hash_image: str, fec_device: str | None,
                          root_hash_file: str | None, sign_key: str | None,
                          sign_cert: str | None) -> None:
    """No output of format may be one of its inputs (files.check_outputs); the hash image
    and the FEC device may share the data image's device, as areas (format/areas.py)."""
    sidecars = ((("sign-key", auxiliary_path(data, ".roothash")),
                 ("sign-key", auxiliary_path(data, ".roothash.p7s")))
                if sign_key is not None else ())
    keys = (("signing key", sign_key), ("certificate", sign_cert))
    check_outputs((("root-hash-file", root_hash_file), *sidecars),
                  (("data image", data), ("hash image", hash_image),
                   ("FEC device", fec_device), *keys))
    check_outputs((("hash", hash_image), ("fec-device", fec_device)),
                  (*keys, ("root hash file", root_hash_file)), regular=False)


def _sign_beside(data: str, root_hex: str, key: str, cert: str) -> None:
    """format --sign-key/--sign-cert: the signature and root hash as sidecars of DATA."""
    from ..trust.sidecar import write_sidecars  # cryptography only when signing
    from ..trust.signing import sign_root_hash
    write_sidecars(data, root_hex, sign_root_hash(root_hex, key, cert))


def _fec_request(params: VerityParams, hash_image: str, fec_device: str | None,
                 roots: int | None, offset: int | None) -> tuple | None:
    """(roots, offset, FecGeometry) of --fec-device, checked before anything is written;
    None without."""
    if fec_device is None:
        if roots is not None or offset is not None:
            raise ConfigError("fec-roots: --fec-roots and --fec-offset need --fec-device")
        return None
    from ..fec.image import same_file
    from ..fec.layout import DEFAULT_ROOTS, FecGeometry
    roots, offset = _given(roots, DEFAULT_ROOTS), _given(offset, 0)
    geo = FecGeometry.from_params(params, roots, params.geometry().hash_image_size, offset,
                                  same_file(hash_image, fec_device))
    check_output_room(fec_device, "fec", geo.parity_end)
    return roots, offset, geo


def _fec_geometry(params: VerityParams, hash_image: str, fec_device: str | None,
                  roots: int | None, offset: int | None):
    """The FecGeometry of an existing image's parity (verify, dump); None without."""
    if fec_device is None:
        return None
    from ..fec.image import fec_geometry
    from ..fec.layout import DEFAULT_ROOTS
    return fec_geometry(params, hash_image, fec_device, _given(roots, DEFAULT_ROOTS),
                        _given(offset, 0))


def _given(value, default):
    """An option's value, or its default when it was not given (0 and "" are values)."""
    return default if value is None else value


@click.command("verify")
@image_arguments
@fec_options
@edge
def verify_cmd(data: str, hash_image: str | None, root_hash: str | None,
               root_hash_file: str | None, root_hash_signature: str | None,
               trusted_certs: str | None, require_signatures: bool, fec_device: str | None,
               fec_roots: int | None, fec_offset: int | None, partition: str | None,
               **kw) -> None:
    """Check every block of DATA against HASH and the trusted ROOT_HASH (or the
    IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s beside DATA); with --fec-device,
    say which corrupted blocks FEC repairs, as veritysetup verify --fec-device. A
    Discoverable Disk Image is checked as its data and verity partitions."""
    from ..prepare.disk import is_ddi  # the GPT code only for a disk image
    options = {"data": data, "hash_image": hash_image, "root_hash": root_hash,
               "partition": partition}
    ddi_arguments(options)
    if options["partition"] is not None or is_ddi(data, options["hash_image"]):
        if fec_device is not None:
            raise ConfigError("fec-device: not supported for a DDI")
        _verify_ddi(data, options["partition"] or "auto",
                    root_hash_text(options["root_hash"], root_hash_file, required=False),
                    root_hash_signature, trusted_certs, require_signatures, kw)
        return
    trusted = resolve_root(data, hash_image,
                           root_hash_text(root_hash, root_hash_file, required=False),
                           root_hash_signature, trusted_certs, require_signatures)
    hash_image = trusted.hash_image
    with contextlib.closing(ImageFile(data, "data")) as data_file, \
            contextlib.closing(ImageFile(hash_image, "hash")) as hashes:
        params = _checked_params(data_file, hashes, trusted, kw)
        check_layout(params, data, hash_image)  # the FEC area too, in verify_with_fec
        if fec_device is not None or fec_roots is not None or fec_offset is not None:
            if fec_device is None:
                raise ConfigError("fec-roots: --fec-roots and --fec-offset need --fec-device")
            root = root_digest(trusted.root_hex, params.digester().digest_size)
            _verify_with_fec(data, hash_image, fec_device, params, root, fec_roots,
                             fec_offset)
            return
        _verify_opened(data_file, hashes, params, trusted, data_file.path, False)


def _verify_ddi(data: str, partition: str, root_hash: str | None, signature: str | None,
                trusted_certs: str | None, require_signatures: bool, kw: dict) -> None:
    """verify of a DDI: its triple chosen and its root settled as serve does, then every
    block of the data partition checked against the verity partition."""
    from ..prepare.disk import open_ddi
    ddi = open_ddi(data, partition, root_hash, signature, trusted_certs, require_signatures)
    with contextlib.closing(ddi):
        params = _checked_params(ddi.data, ddi.hashes, ddi.trust, kw)
        _verify_opened(ddi.data, ddi.hashes, params, ddi.trust, ddi.data.path, True)


def _checked_params(data, hashes, trusted, kw: dict) -> VerityParams:
    """The tree's parameters of opened images, and their sizes, checked as serve checks
    them (prepare/opened.py; warnings of the trust said first)."""
    from ..prepare.opened import checked_params
    for warning in trusted.warnings:
        click.echo(f"nbd-verity: warning: {warning}", err=True)
    return checked_params(tree_options(kw), data, hashes, hashes.path, whole_hash=False)


def _verify_opened(data, hashes, params: VerityParams, trusted, name: str,
                   always_trust: bool) -> None:
    """Every block of opened images against the trusted root; the verdict's lines."""
    root = root_digest(trusted.root_hex, params.digester().digest_size)
    with progress_bar(params.data_blocks * params.data_block_size, "Verifying") as update:
        report = builder.verify_opened(data, hashes, params, root, update)
    if not report.ok:
        _print_bad(report)
        fail(f"verification failed: {report.bad_count} corrupted block(s)", EXIT_CORRUPT)
    click.echo(f"Verified {params.data_blocks} data blocks" +
               (f" of {name}: OK" if always_trust else ": OK"))
    if always_trust or trusted.signature is not None or trusted.root_hash_source != "given":
        click.echo(f"Trust: {trusted.describe()}")


def _print_bad(report) -> None:
    """The first bad blocks of a verify report, one line each, then how many more."""
    for error in report.bad:
        click.echo(f"nbd-verity: {error}", err=True)
    if report.bad_count > len(report.bad):
        click.echo(f"nbd-verity: ... {report.bad_count - len(report.bad)} more", err=True)


def _verify_with_fec(data: str, hash_image: str, fec_device: str, params: VerityParams,
                     root: bytes, roots: int | None, offset: int | None) -> None:
    """verify --fec-device: veritysetup's verdict (exit status and lines), and which bad
    blocks a reader would get repaired (the kernel's decode, with erasures)."""
    from ..fec.image import verify_with_fec
    from ..fec.layout import DEFAULT_ROOTS
    report = verify_with_fec(data, hash_image, fec_device, params, root,
                             _given(roots, DEFAULT_ROOTS), _given(offset, 0))
    tree = report.tree
    if tree.ok:
        click.echo(f"Verified {params.data_blocks} data blocks: OK")
        return
    _print_bad(tree)
    for line in report.messages():
        click.echo(f"nbd-verity: {line}", err=True)
    if report.repaired:
        click.echo(f"FEC repairs {len(report.repaired)} block(s): {_blocks(report.repaired)}")
    if report.unrepaired:
        click.echo(f"FEC cannot repair {len(report.unrepaired)} block(s): "
                   f"{_blocks(report.unrepaired)}")
    if report.untried:
        click.echo(f"FEC not tried on {report.untried} more corrupted block(s)")
    if report.veritysetup_ok:
        click.echo(f"Verified {params.data_blocks} data blocks: {tree.bad_count} corrupted "
                   f"block(s), repairable with FEC")
        return
    fail(f"verification failed: {tree.bad_count} corrupted block(s)", EXIT_CORRUPT)


def _blocks(blocks: list[tuple[str, int]]) -> str:
    """("data", 5), ("hash", 3) as "data 5, metadata 3" (the kernel's names)."""
    return ", ".join(f"{'data' if kind == 'data' else 'metadata'} {block}"
                     for kind, block in blocks)


@click.command("dump")
@click.argument("hash_image", metavar="HASH")
@click.option("--hash-offset", type=int, default=0, metavar="BYTES",
              help="Where the superblock sits in the hash image.")
@click.option("--partition", type=click.Choice(("auto", "root", "usr")), default=None,
              help="HASH is a Discoverable Disk Image: describe this triple (default: a "
                   "DDI when HASH starts with a GPT rather than a verity superblock).")
@click.option("--trusted-certs", default=None, metavar="PATH",
              help="A DDI's signature is checked against these (default: verity.d).")
@fec_options
@edge
def dump_cmd(hash_image: str, hash_offset: int, partition: str | None,
             trusted_certs: str | None, fec_device: str | None,
             fec_roots: int | None, fec_offset: int | None) -> None:
    """Print the superblock of HASH as veritysetup dump does (and, with --fec-device,
    the FEC geometry); for a Discoverable Disk Image, its partitions, the triple that
    would be served, its root hash and signer, then the verity partition's superblock."""
    if partition is not None or (not hash_offset and _is_ddi_dump(hash_image)):
        _dump_ddi(hash_image, partition or "auto", trusted_certs)
        return
    params = read_params(hash_image, hash_offset)
    print_header(hash_image, params, None,
                 _fec_geometry(params, hash_image, fec_device, fec_roots, fec_offset))


def _is_ddi_dump(image: str) -> bool:
    """A DDI to dump: no verity superblock at its start, and a GPT (no IMAGE.verity
    beside it, as serve's rule); the image opened once."""
    from ..format.gpt import has_gpt_signature
    from ..format.superblock import SIGNATURE
    try:
        with ImageFile(image, "hash") as f:  # refuses a FIFO without opening it
            if f.size() >= len(SIGNATURE) and f.read_exact(len(SIGNATURE), 0) == SIGNATURE:
                return False
            return not os.path.exists(auxiliary_path(image, ".verity")) and \
                has_gpt_signature(f)
    except VerityError:
        return False  # read_params says what is wrong with it


def _dump_ddi(image: str, partition: str, trusted_certs: str | None) -> None:
    """dump of a DDI: the partitions, the triple, root hash and signer, the superblock;
    a DDI that serve would refuse is listed, then refused in one line (exit 2)."""
    from ..prepare.disk import describe_ddi, label, partition_lines
    report = describe_ddi(image, partition, trusted_certs)
    click.echo("\n".join(partition_lines(report.table)))
    if report.opened is None:
        fail(report.problem)
    with contextlib.closing(report.opened) as ddi:
        triple = ddi.triple
        sig = label(triple.signature) if triple.signature else "none"
        click.echo(f"Serves:          \t{triple.designator} ({triple.architecture}): data "
                   f"{label(triple.data)}; hash {label(triple.verity)}; signature {sig}")
        click.echo(f"Root hash:       \t{ddi.trust.root_hex}")
        signer = ddi.trust.signature
        click.echo(f"Signed by:       \t{signer.signer.describe() if signer else '-'}")
        for warning in ddi.trust.warnings:
            click.echo(f"nbd-verity: warning: {warning}", err=True)
        print_header(ddi.hashes.path, read_params(ddi.hashes.path, 0, ddi.hashes))
