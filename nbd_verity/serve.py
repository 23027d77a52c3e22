"""`nbd-verity serve`: check the images, then exec nbdkit with our plugin in the foreground.

serve turns its options into the same key=value list the plugin takes, builds the Device
once itself so that a wrong root hash or a bad image is one clear line before nbdkit even
starts, and then execs nbdkit (not a child: systemd socket activation needs LISTEN_PID to
be nbdkit's pid). nbdkit handles SIGTERM/SIGINT and stops cleanly.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from .config import config_from_pairs
from .errors import ConfigError
from .server import Device

PLUGIN = Path(__file__).resolve().parent / "nbdkit_plugin.py"  # what plugin.py loads


def plugin_pairs(data: str, hash_image: str, root_hash: str | None,
                 root_hash_file: str | None, tree: dict, extra: dict) -> list[tuple[str, str]]:
    """The plugin's key=value pairs for these options, absolute paths throughout."""
    pairs = [("data", os.path.abspath(data)), ("hash", os.path.abspath(hash_image))]
    if root_hash is not None:
        pairs.append(("root-hash", root_hash))
    if root_hash_file is not None:
        pairs.append(("root-hash-file", os.path.abspath(root_hash_file)))
    names = {"algorithm": "algorithm", "salt": "salt", "data_block_size": "data-block-size",
             "hash_block_size": "hash-block-size", "data_blocks": "data-blocks",
             "hash_offset": "hash-offset", "hash_type": "format"}
    for option, key in names.items():
        if tree.get(option) is not None:
            pairs.append((key, str(tree[option])))
    if tree.get("no_superblock"):
        pairs.append(("no-superblock", "true"))
    for key, value in extra.items():
        if isinstance(value, (list, tuple)):
            pairs.extend((key, str(v)) for v in value)
        elif value is not None:
            pairs.append((key, str(value)))
    return pairs


def nbdkit_command(pairs, listen: dict) -> list[str]:
    """The nbdkit argv: foreground, read-only, our plugin and its keys."""
    nbdkit = shutil.which("nbdkit") or "/usr/sbin/nbdkit"
    argv = [nbdkit, "-f", "-r"]
    if listen.get("exit_with_parent"):
        argv.append("--exit-with-parent")
    if listen.get("verbose"):
        argv.append("-v")
    if listen.get("unix"):
        argv += ["-U", os.path.abspath(listen["unix"])]
    elif listen.get("port") is not None:
        argv += ["-p", str(listen["port"]), "-i", listen.get("bind") or "127.0.0.1"]
    if listen.get("pid_file"):
        argv += ["-P", os.path.abspath(listen["pid_file"])]
    if listen.get("threads"):
        argv += ["-t", str(listen["threads"])]
    argv += ["python", str(PLUGIN)]
    argv += [f"{k}={v}" for k, v in pairs]
    return argv


def plugin_environment() -> dict:
    """Environment for nbdkit: PYTHONPATH reaches nbd_verity and this install's packages."""
    env = dict(os.environ)
    paths = [str(PLUGIN.parent.parent), sysconfig.get_paths()["purelib"]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def exec_server(pairs, listen: dict) -> None:
    """Check everything once here, then replace this process with nbdkit."""
    if not (listen.get("unix") or listen.get("port") is not None or os.environ.get("LISTEN_FDS")):
        raise ConfigError("listen: give --unix PATH or --port N (or use socket activation)")
    if listen.get("unix") and listen.get("port") is not None:
        raise ConfigError("listen: give --unix or --port, not both")
    if not PLUGIN.is_file():
        raise ConfigError(f"plugin: {PLUGIN} is missing from this installation")
    device = Device(config_from_pairs(pairs))
    device.close()
    argv = nbdkit_command(pairs, listen)
    sys.stderr.write(f"nbd-verity: serving {device.size} bytes, verified "
                     f"({device.params.algorithm}, {device.geo.levels} levels)\n")
    sys.stderr.flush()
    os.execve(argv[0], argv, plugin_environment())
