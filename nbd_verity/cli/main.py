"""The `nbd-verity` command group: every command registered here, imported when it runs.

Command modules import cli.common and the library, never this module, so there is no
import circle; `python -m nbd_verity.cli` and the `nbd-verity` script both run `main`.
Each command's module is imported only when that command runs (or help lists them all):
`nbd-verity ctl` then loads the control client and click, not the verifier, the builder
or tune's measuring code, and answers in a fraction of the time.
"""

from __future__ import annotations

import importlib

import click

COMMANDS = {  # name -> "module:attribute", in the order help lists them
    "format": "nbd_verity.cli.tree:format_cmd",
    "verify": "nbd_verity.cli.tree:verify_cmd",
    "dump": "nbd_verity.cli.tree:dump_cmd",
    "sign": "nbd_verity.cli.sign:sign_cmd",
    "serve": "nbd_verity.cli.serve:serve_cmd",
    "ctl": "nbd_verity.cli.ctl:ctl",
    "tune": "nbd_verity.cli.tune:tune_cmd",
    "attach": "nbd_verity.cli.attach:attach_cmd",
    "detach": "nbd_verity.cli.attach:detach_cmd",
}


class CommandGroup(click.Group):
    """A group whose commands are imported from COMMANDS on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module, attribute = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return self.commands.get(name)


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                 "auto_envvar_prefix": "NBD_VERITY"})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=lambda ctx, _param, value: _version(ctx) if value else None,
              help="Show the version, the hashing engine and nbdkit's version, and exit.")
def main() -> None:
    """A verified (dm-verity) block server for NBD, and its tools."""


def _version(ctx: click.Context) -> None:
    """`nbd-verity --version`: the package's version, which engine hashes, and the nbdkit
    that `serve` runs."""
    from importlib.metadata import PackageNotFoundError, version

    from ..format.digest import engine_name
    from ..launch import NBDKIT
    from ..serve.nbdkit_compat import nbdkit_version, version_text
    try:
        text = version("nbd-verity")
    except PackageNotFoundError:
        from .. import __version__ as text
    click.echo(f"nbd-verity {text}\nhashing engine: {engine_name()}\n"
               f"nbdkit: {version_text(nbdkit_version(NBDKIT))} ({NBDKIT})")
    ctx.exit()
