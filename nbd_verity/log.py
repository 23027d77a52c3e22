"""One line on the server's stderr: the terminal in `serve`'s foreground, the journal
under systemd, nbdkit's log otherwise. Library code logs here and never prints; inside a
server the lines are rate-limited by nbd_verity.logbound (`log-rate`)."""

from __future__ import annotations

from . import logbound


def log(message: str) -> None:
    logbound.emit(f"nbd-verity: {message}\n")
