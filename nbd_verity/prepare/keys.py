"""An image named by `serve`'s options, made ready to serve: the one home of that step.

`nbd-verity serve DATA ...`, `serve --export-file FILE` and every export of `serve
--exports DIR` go through image_pairs(): a DDI's second argument taken as its root hash,
the sidecars of an http(s) or s3 image looked up beside its URL (trust/remote_sidecar),
a captive nbdkit started for each URL (sources/upstream), and the plugin's key=value
pairs made (config.plugin_pairs). What happens next is the Device's: open the sources,
settle the root of trust, check the tree (device.py).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..read.counters import IGNORE_CORRUPTION, RESTART_ON_CORRUPTION
from .config import absolute_file, plugin_pairs


def settle_ddi_arguments(options: dict) -> None:
    """For a DDI (with partition, or DATA starting with a GPT), which holds its own
    verity partition, the second argument is the ROOT_HASH: `DATA [ROOT_HASH]`."""
    if options.get("partition") is None:
        from .disk import root_hash_in_hash_place  # the GPT code only for a DDI
        if root_hash_in_hash_place(options["data"], options.get("hash_image"),
                                   options.get("root_hash")):
            options["root_hash"], options["hash_image"] = options["hash_image"], None
        return
    if options.get("hash_image") is None:
        return
    if options.get("root_hash") is not None:
        raise ConfigError("partition: give DATA [ROOT_HASH]; the hash image is the DDI's "
                          "verity partition")
    options["root_hash"], options["hash_image"] = options["hash_image"], None


def image_pairs(options: dict, started: list | None = None) -> list[tuple[str, str]]:
    """The plugin's pairs for one image named by serve's options (click parameter names;
    absent ones are unset). Captive upstreams started for its URLs are appended to
    started (the caller stops them with the image)."""
    from ..sources.s3 import S3Options
    from ..sources.upstream import UpstreamOptions, attach
    from ..trust.remote_sidecar import close_private
    options = dict(options)
    if options.get("ignore_corruption") and options.get("restart_on_corruption"):
        raise ConfigError("ignore-corruption: conflicts with restart-on-corruption")
    credentials = options.get("s3_credentials")
    s3 = S3Options(options.get("s3_endpoint"), options.get("s3_profile"),
                   absolute_file("s3-credentials", credentials) if credentials else None)
    settle_ddi_arguments(options)
    checked = remote_sidecars(options, s3) if options.get("partition") is None else ()
    images = {role: options[role] for role in ("data", "hash_image") if options.get(role)}
    upstream = UpstreamOptions(bool(options.get("upstream_cache")),
                               options.get("upstream_cache_size"), s3)
    try:
        options.update(attach(images, upstream, started, checked))
    except BaseException:  # a fetched signature goes with the image it came for
        close_private(options.get("root_hash_signature"))
        raise
    options["error_mode"] = (IGNORE_CORRUPTION if options.get("ignore_corruption") else
                             RESTART_ON_CORRUPTION if options.get("restart_on_corruption")
                             else None)
    return plugin_pairs(options)


def remote_sidecars(options: dict, s3) -> tuple[str, ...]:
    """Fill in HASH, ROOT_HASH and the signature from URL.verity, URL.roothash and
    URL.roothash.p7s when DATA is an http(s) or s3 URL and HASH or ROOT_HASH is missing;
    an image with neither beside it that starts with a GPT is a DDI. Returns the s3://
    URLs it has read already (they are not checked again)."""
    from ..format.gpt import HEAD_SIZE, starts_with_gpt
    from ..sources.remote import redact
    from ..sources.s3 import check_object, head, is_s3, sidecar_reader
    from ..trust.remote_sidecar import discover, has_remote_sidecars, http_head, write_private
    from ..trust.sidecar import auxiliary_path
    root_given = options.get("root_hash") is not None or \
        options.get("root_hash_file") is not None
    if not has_remote_sidecars(options["data"]) or (options.get("hash_image") and root_given):
        return ()
    readers, checked = (), ()
    if is_s3(options["data"]):  # the image itself first: its refusal names it
        check_object(options["data"], s3)
        readers, checked = sidecar_reader(s3), (options["data"],)
    found = discover(options["data"], options.get("hash_image"), root_given,
                     options.get("root_hash_signature") is not None, *readers)
    data = options["data"]
    if not options.get("hash_image") and found.hash_image is None:
        first = head(data, s3, HEAD_SIZE) if is_s3(data) else http_head(data, HEAD_SIZE)
        if starts_with_gpt(first):
            options["partition"] = "auto"  # a DDI: the plugin reads its GPT
            return checked
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
    return checked
