"""`nbd-verity serve DATA [HASH [ROOT_HASH]]`: options forwarded to launch.exec_server.

The options become the plugin's key=value pairs through config.KEYS (config.plugin_pairs),
the one table of plugin keys; the listening options become nbdkit's own. DATA and HASH
are paths, NBD URIs, or http(s):// and s3:// URLs, for which captive upstream nbdkits are
started first (upstream.attach). For an http(s) or s3 DATA without HASH or ROOT_HASH, the
sidecars beside the URL are looked up first (prepare/keys.py). Every message of it names
URLs without their user part's password or their query (remote.redacting).
"""

from __future__ import annotations

import click

from ..prepare.config import PARALLEL, THREAD_MODELS
from ..sources.remote import redacting
from .common import edge, fec_options, image_arguments, s3_options


@click.command("serve")
@image_arguments(optional_data=True)
@fec_options
@click.option("--unix", default=None, metavar="PATH", help="Listen on this Unix socket.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Listen on TCP port.")
@click.option("--bind", default=None, metavar="ADDR", help="TCP address (default 127.0.0.1).")
@click.option("--ignore-corruption", is_flag=True, help="Log corruption, return the data.")
@click.option("--restart-on-corruption", is_flag=True,
              help="Log corruption, then stop with status 75 so a supervisor restarts us.")
@click.option("--ignore-zero-blocks", is_flag=True,
              help="Blocks whose digest is the zero block's read as zeros, unhashed.")
@click.option("--check-at-most-once", is_flag=True,
              help="Verify each data block only the first time it is read.")
@click.option("--cache-size", default=None, metavar="SIZE",
              help="Bytes of verified level-0 hash blocks to keep (default 64M).")
@click.option("--readahead/--no-readahead", default=None,
              help="Merkle readahead (default: on for an NBD/HTTP/S3 hash image, off for a "
                   "local file, which the kernel's page cache reads ahead).")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="nbdkit worker threads per connection.")
@click.option("--pid-file", default=None, metavar="PATH", help="nbdkit writes its pid here.")
@click.option("--exit-with-parent", is_flag=True, help="Stop when the parent process exits.")
@click.option("--verbose", "-v", is_flag=True, help="nbdkit debug messages.")
@click.option("--control", default=None, metavar="PATH",
              help="Control socket for `nbd-verity ctl` (created 0600).")
@click.option("--threshold", "thresholds", multiple=True, metavar="CLASS=BYTES",
              help="Inline threshold of one I/O class (none, rt, be, idle); repeatable.")
@click.option("--threshold-preset", default=None, metavar="NAME",
              help="Start from a preset table: default (256K each; above it, requests of "
                   "512K or more take the pool only while few are served and a worker is "
                   "free), or one that pins every class: fixed (1M each), seed (4096 "
                   "each), kernel.")
@click.option("--workers", type=click.IntRange(0, 256), default=None,
              help="Verification pool threads (default: number of CPUs).")
@click.option("--default-class", default=None, metavar="CLASS",
              help="Class of connections that name none (default be).")
@click.option("--allow-class", "allow_classes", multiple=True, metavar="CLASS[=UID,...]",
              help="Let clients choose CLASS by name (NAME@CLASS) although it ranks above "
                   "the default class: every client, or the Unix-socket peers of these "
                   "uids (repeatable; without it such a name gets the default class).")
@click.option("--list-exports", is_flag=True, default=None,
              help="Answer NBD_OPT_LIST (nbdinfo --list: names, sizes, root hashes, "
                   "signers); off by default, as nbd-server's allowlist.")
@click.option("--serialize/--parallel", default=None,
              help="One request in Python at a time (thread model serialize-all-requests), "
                   "or nbdkit's parallel model (a client can abort nbdkit < 1.34).")
@click.option("--thread-model", default=None,
              type=click.Choice(THREAD_MODELS),
              help="nbdkit thread model (default auto: parallel for an image read over "
                   "a network or a local one not in the page cache at start-up, on "
                   "nbdkit 1.34 or newer; else serialize-requests).")
@click.option("--log-rate", type=click.IntRange(0), default=None, metavar="LINES",
              help="Log lines a minute before a summary (default 120; 0: no limit).")
@click.option("--source-timeout", type=click.FloatRange(0, 86400, min_open=True),
              default=None, metavar="SECONDS",
              help="A connect or read of an NBD, HTTP or S3 image taking longer fails "
                   "with EIO and the connection is replaced (default 60).")
@click.option("--upstream-cache", is_flag=True,
              help="For http(s)/s3 images: nbdkit's cache filter below verification.")
@click.option("--upstream-cache-size", default=None, metavar="SIZE",
              help="Bound of that cache (nbdkit's cache-max-size, e.g. 1G).")
@click.option("--exports", "exports_dir", default=None, metavar="DIR",
              help="Serve every DIR/NAME.conf as export NAME (clients pick one by name: "
                   "nbd-client -N NAME); give no DATA then.")
@click.option("--export-file", default=None, metavar="FILE",
              help="Serve the image FILE names (an /etc/nbd-verity/NAME.conf), as the "
                   "template units do; give no DATA then.")
@s3_options
@edge
@redacting()  # inside edge: the one line it prints names no URL's secret
def serve_cmd(unix, port, bind, threads, pid_file, exit_with_parent, verbose, exports_dir,
              export_file, **options) -> None:
    """Serve DATA over NBD, verifying every byte against HASH and ROOT_HASH (or the
    IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s beside DATA).

    DATA and HASH are paths, NBD URIs (nbd://, nbds://, nbd+unix://) or http(s):// and
    s3:// URLs (read through nbdkit's curl or S3 plugin, started here). With --exports
    DIR, one server serves every image of DIR's export files, each by its name."""
    from ..launch import check_listen
    from ..prepare.keys import image_pairs  # the server side, imported only to serve
    from ..serve.startup import exec_exports, exec_server
    listen = {"unix": unix, "port": port, "bind": bind, "threads": threads,
              "pid_file": pid_file, "exit_with_parent": exit_with_parent, "verbose": verbose}
    _thread_model(options)
    check_listen({"unix": unix, "port": port})
    if exports_dir is not None or export_file is not None:
        if options["data"] is not None:
            raise click.UsageError("give DATA, --export-file or --exports, one of them")
        if exports_dir is not None and export_file is not None:
            raise click.UsageError("--exports and --export-file conflict")
    if exports_dir is not None:
        exec_exports(exports_dir, options, listen)
        return
    if export_file is not None:
        options = _from_export_file(export_file, options, listen)
    elif options["data"] is None:
        raise click.UsageError("Missing argument 'DATA' (or --export-file, --exports).")
    exec_server(image_pairs(options), listen)


def _thread_model(options: dict) -> None:
    """--parallel is nbdkit's parallel thread model (and conflicts with another one)."""
    if options.get("serialize") is False:
        if options.get("thread_model") not in (None, PARALLEL):
            raise click.UsageError("--parallel conflicts with --thread-model")
        options["serialize"], options["thread_model"] = None, PARALLEL


def _from_export_file(path: str, options: dict, listen: dict) -> dict:
    """serve's options with an export file's image and ARGS in them (the command line's
    own options first; the file's may not repeat them)."""
    from ..prepare.exportfile import read_export_file
    spec = read_export_file(path)
    merged = dict(options, data=spec.data, hash_image=spec.hash_image,
                  root_hash=spec.root_hash)
    for name, value in spec.options.items():
        if name == "threads":
            listen["threads"] = listen["threads"] or value
            continue
        if options.get(name) not in (None, False, ()):
            raise click.UsageError(f"{path}: ARGS repeats an option given on the command "
                                   f"line ({name.replace('_', '-')})")
        merged[name] = tuple(value) if isinstance(value, list) else value
    _thread_model(merged)
    return merged
