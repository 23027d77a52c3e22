"""`nbd-verity serve DATA [HASH [ROOT_HASH]]`: options forwarded to launch.exec_server.

The options become the plugin's key=value pairs through config.KEYS (config.plugin_pairs),
the one table of plugin keys; the listening options become nbdkit's own. DATA and HASH
are paths, NBD URIs, or http(s):// and s3:// URLs, for which captive upstream nbdkits are
started first (upstream.attach). For an http(s) or s3 DATA without HASH or ROOT_HASH, the
sidecars beside the URL are looked up first (trust.remote_sidecar; sources.s3). Every
message of it names URLs without their user part's password or their query
(upstream.redacting).
"""

from __future__ import annotations

import click

from ..serve.config import IGNORE_CORRUPTION, PARALLEL, RESTART_ON_CORRUPTION, THREAD_MODELS
from ..sources.upstream import redacting
from .common import ddi_arguments, edge, fec_options, image_arguments, s3_options


@click.command("serve")
@image_arguments
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
              help="Start from a preset table: default (1M each), seed (4096 each), kernel.")
@click.option("--workers", type=click.IntRange(0, 256), default=None,
              help="Verification pool threads (default: number of CPUs).")
@click.option("--default-class", default=None, metavar="CLASS",
              help="Class of connections that name none (default be).")
@click.option("--serialize/--parallel", default=None,
              help="One request in Python at a time (thread model serialize-all-requests), "
                   "or nbdkit's parallel model (a client can abort nbdkit < 1.34).")
@click.option("--thread-model", default=None,
              type=click.Choice(THREAD_MODELS),
              help="nbdkit thread model (default serialize-requests).")
@click.option("--log-rate", type=click.IntRange(0), default=None, metavar="LINES",
              help="Log lines a minute before a summary (default 120; 0: no limit).")
@click.option("--upstream-cache", is_flag=True,
              help="For http(s)/s3 images: nbdkit's cache filter below verification.")
@click.option("--upstream-cache-size", default=None, metavar="SIZE",
              help="Bound of that cache (nbdkit's cache-max-size, e.g. 1G).")
@s3_options
@edge
@redacting()  # inside edge: the one line it prints names no URL's secret
def serve_cmd(ignore_corruption, restart_on_corruption, unix, port, bind, threads, pid_file,
              exit_with_parent, verbose, upstream_cache, upstream_cache_size,
              s3_endpoint, s3_profile, s3_credentials, **options) -> None:
    """Serve DATA over NBD, verifying every byte against HASH and ROOT_HASH (or the
    IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s beside DATA).

    DATA and HASH are paths, NBD URIs (nbd://, nbds://, nbd+unix://) or http(s):// and
    s3:// URLs (read through nbdkit's curl or S3 plugin, started here)."""
    from ..launch import check_listen
    from ..serve.config import plugin_pairs  # the server side, imported only to serve
    from ..serve.startup import exec_server
    from ..sources.s3 import S3Options
    from ..sources.upstream import UpstreamOptions, attach
    if ignore_corruption and restart_on_corruption:
        raise click.UsageError("--ignore-corruption and --restart-on-corruption conflict")
    if options.get("serialize") is False:  # --parallel: nbdkit's parallel thread model
        if options.get("thread_model") not in (None, PARALLEL):
            raise click.UsageError("--parallel conflicts with --thread-model")
        options["serialize"], options["thread_model"] = None, PARALLEL
    check_listen({"unix": unix, "port": port})
    s3 = S3Options(s3_endpoint, s3_profile, s3_credentials)
    ddi_arguments(options)
    if options["partition"] is None:
        _remote_sidecars(options, s3)
    images = {role: options[role] for role in ("data", "hash_image") if options[role]}
    options.update(attach(images, UpstreamOptions(upstream_cache, upstream_cache_size, s3)))
    options["error_mode"] = (IGNORE_CORRUPTION if ignore_corruption else
                             RESTART_ON_CORRUPTION if restart_on_corruption else None)
    exec_server(plugin_pairs(options),
                {"unix": unix, "port": port, "bind": bind, "threads": threads,
                 "pid_file": pid_file, "exit_with_parent": exit_with_parent,
                 "verbose": verbose})


def _remote_sidecars(options: dict, s3) -> None:
    """Fill in HASH, ROOT_HASH and the signature from URL.verity, URL.roothash and
    URL.roothash.p7s when DATA is an http(s) or s3 URL and HASH or ROOT_HASH is missing."""
    from ..errors import ConfigError
    from ..format.gpt import HEAD_SIZE, starts_with_gpt
    from ..sources.s3 import check_object, is_s3, sidecar_reader
    from ..sources.upstream import redact
    from ..trust.remote_sidecar import discover, has_remote_sidecars, http_head, write_private
    from ..trust.sidecar import auxiliary_path
    root_given = options["root_hash"] is not None or options["root_hash_file"] is not None
    if not has_remote_sidecars(options["data"]) or (options["hash_image"] and root_given):
        return
    readers = ()
    if is_s3(options["data"]):  # the image itself first: its refusal names it
        check_object(options["data"], s3)
        readers = sidecar_reader(s3)
    found = discover(options["data"], options["hash_image"], root_given,
                     options["root_hash_signature"] is not None, *readers)
    data = options["data"]
    if not options["hash_image"] and found.hash_image is None:
        if not is_s3(data) and starts_with_gpt(http_head(data, HEAD_SIZE)):
            options["partition"] = "auto"  # a DDI: the plugin reads its GPT
            return
        raise ConfigError(f"hash: missing (give the hash image, or put "
                          f"{redact(auxiliary_path(data, '.verity'))} beside the image)")
    if not root_given and found.root_hash is None:
        raise ConfigError(f"root-hash: missing (give a root hash or a root-hash-file, or put "
                          f"{redact(auxiliary_path(data, '.roothash'))} beside the image)")
    if found.hash_image is not None:
        options["hash_image"] = found.hash_image
    if found.root_hash is not None:
        options["root_hash"] = found.root_hash
    if found.signature is not None:  # checked by the plugin as a local file would be
        options["root_hash_signature"] = write_private(found.signature,
                                                       redact(found.found[-1]))
