"""`nbd-verity serve`'s start: open the device once in this process, then exec nbdkit.

A wrong root hash or a bad image is one clear line here, before nbdkit even starts; then
this process is replaced by nbdkit (not a child: systemd socket activation needs
LISTEN_PID to be nbdkit's pid). Starting and stopping servers as children is launch.py's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..launch import NBDKIT, PLUGIN, check_listen, nbdkit_command, plugin_environment
from ..prepare.config import config_from_pairs, plugin_pairs
from .device import Device
from .nbdkit_compat import nbdkit_version, version_text


def check_device(pairs: Sequence[tuple[str, str]]):
    """Open the device once as the plugin will (clear errors now); return it, closed."""
    if not PLUGIN.is_file():
        raise ConfigError(f"plugin: {PLUGIN} is missing from this installation")
    device = Device(config_from_pairs(pairs))
    device.close()
    return device


def exec_exports(directory: str, options: dict, listen: Mapping) -> None:
    """`serve --exports DIR`: check the directory and every export file once here (a bad
    file is one line, and the others still serve), then replace this process with nbdkit
    serving them all; options are the server's (per-image ones belong in the files)."""
    from ..prepare.exportfile import OPTIONS
    from .exportset import ExportSet
    check_listen(listen)
    if not os.path.isdir(directory):
        raise ConfigError(f"exports: {directory}: not a directory")
    per_image = sorted({flag for flag, option in OPTIONS.items() if not option.server
                        and option.dest not in ("require_signatures", "trusted_certs",
                                                "cache_size")
                        and options.get(option.dest) not in (None, False, ())})
    if per_image or options.get("hash_image") or options.get("root_hash"):
        raise ConfigError(f"exports: {', '.join(per_image) or 'HASH, ROOT_HASH'} belong in "
                          f"the export files (ARGS=...), not on the command line")
    options = dict(options, exports=directory)
    options["data"] = None
    pairs = plugin_pairs(options)
    exports = ExportSet(config_from_pairs(pairs), say=lambda line: None)
    try:
        exports.reload()
        for why in exports.refused.values():  # each names its file
            sys.stderr.write(f"nbd-verity: refused: {why}\n")
        served = exports.list()
    finally:
        exports.close()
    sys.stderr.write(f"nbd-verity: serving {len(served)} export(s) of {directory}: "
                     f"{', '.join(name for name, _ in served) or 'none yet'}\n")
    sys.stderr.flush()
    argv = nbdkit_command(pairs, listen)
    os.execve(argv[0], argv, plugin_environment())


def exec_server(pairs: Sequence[tuple[str, str]], listen: Mapping) -> None:
    """Check everything once here, then replace this process with nbdkit."""
    check_listen(listen)
    device = check_device(pairs)
    argv = nbdkit_command(pairs, listen)
    sys.stderr.write(f"nbd-verity: serving {device.size} bytes, verified "
                     f"({device.params.algorithm}, {device.geo.levels} levels, "
                     f"{device.verifier.digester.implementation}, "
                     f"{device.verifier.digester.engine} engine), "
                     f"{device.trust.describe()}, on nbdkit "
                     f"{version_text(nbdkit_version(NBDKIT))}\n")
    sys.stderr.flush()
    os.execve(argv[0], argv, plugin_environment())
