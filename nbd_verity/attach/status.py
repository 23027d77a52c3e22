"""What a running attach tells others: its state file, `attach --list`, `detach`, systemd.

Each attach writes /run/nbd-verity/attach/nbdN.json (replaced whole on every change):
its device, URIs, the server in use, connections, reconnects and the last events.
`attach --list` joins those files to what sysfs says of every connected nbd device; a
file whose attach has exited is not shown. `detach` is NBD_CMD_DISCONNECT: the device's
reads end, its size drops to 0, and the attach serving it sees it and exits.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AttachError
from . import kernel
from .kernel import NbdKernel

STATE_DIR = Path("/run/nbd-verity/attach")


@dataclass
class State:
    """What `attach --list` shows of a running attach (written to STATE_DIR/nbdN.json)."""

    device: str
    pid: int
    uris: list[str]
    root_hash: str
    size: int
    connections: int
    server: str = ""
    reconnects: int = 0
    skipped: int = 0
    last_wait_s: float = 0.0
    longest_wait_s: float = 0.0
    events: list[str] = field(default_factory=list)




def detach(device: str) -> None:
    """End the device's connection (the attach serving it then exits)."""
    index = kernel.device_index(device)
    if not kernel.connected(index):
        raise AttachError(f"/dev/nbd{index}: not attached")
    with NbdKernel() as nbd:
        nbd.disconnect(index)


def listing(state_dir: Path = STATE_DIR) -> list[dict]:
    """Every connected nbd device: its size and backend, and what its attach says."""
    rows = []
    for index in kernel.devices():
        if not kernel.connected(index):
            continue
        row: dict = {"device": f"/dev/nbd{index}", "size": kernel.size_bytes(index),
                     "backend": kernel.backend(index)}
        try:
            state = json.loads((state_dir / f"nbd{index}.json").read_text())
            if _alive(state.get("pid")):
                row.update(state)
        except (OSError, ValueError):
            pass
        rows.append(row)
    return rows


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) what NOTIFY_SOCKET asks to hear; nothing without it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(path)
            sock.sendall(message.encode())
        except OSError:
            pass
