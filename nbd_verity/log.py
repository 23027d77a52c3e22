"""One line on the server's stderr: the terminal in `serve`'s foreground, the journal
under systemd, nbdkit's log otherwise. Library code logs here and never prints."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    sys.stderr.write(f"nbd-verity: {message}\n")
    sys.stderr.flush()
