"""python -m nbd_verity.cli ...: the same as the `nbd-verity` command."""

from .main import main

main(prog_name="nbd-verity")
