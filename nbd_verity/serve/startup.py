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
from .config import config_from_pairs
from .device import Device
from .nbdkit_compat import nbdkit_version, version_text


def check_device(pairs: Sequence[tuple[str, str]]):
    """Open the device once as the plugin will (clear errors now); return it, closed."""
    if not PLUGIN.is_file():
        raise ConfigError(f"plugin: {PLUGIN} is missing from this installation")
    device = Device(config_from_pairs(pairs))
    device.close()
    return device


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
