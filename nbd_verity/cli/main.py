"""The `nbd-verity` command group: each command module registered with add_command.

Command modules import cli.common and the library, never this module, so there is no
import circle; `python -m nbd_verity.cli` and the `nbd-verity` script both run `main`.
"""

from __future__ import annotations

import click

from .ctl import ctl
from .serve import serve_cmd
from .tree import dump_cmd, format_cmd, verify_cmd
from .tune import tune_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"],
                               "auto_envvar_prefix": "NBD_VERITY"})
@click.version_option(package_name="nbd-verity")
def main() -> None:
    """A verified (dm-verity) block server for NBD, and its tools."""


for command in (format_cmd, verify_cmd, dump_cmd, serve_cmd, ctl, tune_cmd):
    main.add_command(command)
