"""One attached device: connect it (or adopt it), then keep its links alive.

The reconnect loop is a small state machine driven by the kernel's NBD_CMD_LINK_DEAD, as
in rbd-nbd and NBS: a dead link gets a new connection (any URI, in turn, with a bounded
backoff) that is negotiated here and handed over with NBD_CMD_RECONFIGURE; meanwhile the
kernel holds the device's requests for up to the dead-connection timeout. Every new
connection must name the device's image (identity.py): another image is never handed over.

Timers (docs/attach.md has the measurements; why: docs/decisions/attach.md):
- DEAD_TIMEOUT_S: how long reads wait for a server before they fail with EIO.
- No kernel request timeout while a link is alive: a slow read is never cut. While a link
  is dead, DEAD_LINK_TIMEOUT_S, so that the requests it held join the wait for a new link
  at the block layer's next look (IO_TIMER_MS).
Stopping attach leaves the device attached (reads wait for the next attach, within the
dead timeout); only detach (NBD_CMD_DISCONNECT) ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttachError
from ..files import write_atomically
from . import kernel
from .handshake import Negotiated, Uri, negotiate
from .identity import FirstServer, Identity
from .kernel import NbdKernel
from .status import STATE_DIR, State

BLOCK_SIZE = 4096  # one verity data block: a 4 KiB read is one NBD request
DEAD_TIMEOUT_S = 60
IO_TIMER_MS = 250  # the block layer's timer with one link (see above)
IO_TIMER_MULTI_MS = 30_000  # with several links the kernel cuts any request this old
DEAD_LINK_TIMEOUT_S = 1  # the request timeout while a link is dead (see _orphans_wait)
# Between rounds of tries: 0.05 s doubling to 0.1 s (a server back after a restart is
# found within that), and 1 s once a link has been dead for BACKOFF_SLOW_AFTER_S.
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 0.1
BACKOFF_SLOW_S = 1.0
BACKOFF_SLOW_AFTER_S = 30.0
FIRST_CONNECT_S = 10  # attaching (not reconnecting) gives up after this long


@dataclass
class Options:
    uris: list[Uri]
    device: int | None = None
    connections: int = 1
    dead_timeout_s: int = DEAD_TIMEOUT_S
    timeout_s: int = 0  # the kernel's request timeout (0: none, see the docstring)
    root_hash: str | None = None
    state_dir: Path = STATE_DIR


class Session:
    """One attach process: set up or adopt the device, then serve its LINK_DEAD events."""

    def __init__(self, options: Options, say: Callable[[str], None],
                 notify: Callable[[str], None] = lambda _msg: None) -> None:
        if not options.uris:
            raise AttachError("give at least one server URI")
        self.options = options
        self.say = say
        self.notify = notify
        self.kernel = NbdKernel()
        self.identity: Identity | None = None
        self.index: int | None = options.device
        self.state: State | None = None
        self._next_uri = 0
        self._stop = False

    # -- setting up -----------------------------------------------------------------

    def start(self) -> None:
        """Connect the device, or adopt it when an earlier attach connected it."""
        self.kernel.subscribe()  # before connecting: no LINK_DEAD is missed
        if self.index is not None and kernel.connected(self.index):
            self._adopt()
        else:
            self._connect()
        self._set_timer()
        self._write_state()
        self.notify(f"READY=1\nSTATUS=/dev/nbd{self.index}: {self.state.server}")

    def _connect(self) -> None:
        first = self._negotiate(FirstServer(self.options.root_hash))
        self.identity = Identity(first.root_hash, first.size)
        links = [first]
        try:
            if self.options.connections > 1 and not first.multi_conn:
                self.say(f"{self._uri_text()}: the server does not allow several "
                         f"connections: using one")
            else:
                links += [self._negotiate(self.identity)
                          for _ in range(self.options.connections - 1)]
            self.index = self.kernel.connect(
                [link.sock.fileno() for link in links], first.size, first.flags, BLOCK_SIZE,
                self.options.dead_timeout_s, self.options.timeout_s,
                self.identity.backend, self.index)
        finally:
            for link in links:  # the kernel holds its own reference to each socket
                link.sock.close()
        self.options.connections = len(links)
        self._new_state(first)
        self.say(f"/dev/nbd{self.index}: attached to {self._uri_text()}, {first.size} bytes, "
                 f"root hash {self.identity.root_hash}, {len(links)} connection(s)")

    def _adopt(self) -> None:
        """Take over a device an earlier attach set up, if it shows the same image. Its
        links may have died while no attach ran (the kernel's status cannot say): each
        gets a fresh connection now; the kernel drops those it has no dead link for."""
        found = Identity.from_backend(kernel.backend(self.index))
        if found is None:
            raise AttachError(f"/dev/nbd{self.index} is in use by something else than "
                              f"nbd-verity attach (backend {kernel.backend(self.index)!r})")
        if self.options.root_hash is not None and found.root_hash != self.options.root_hash:
            raise AttachError(f"/dev/nbd{self.index} is attached to another image "
                              f"(root hash {found.root_hash[:16]}...)")
        self.identity = found
        # The device is attached already and its reads wait: try until a server answers.
        links = [self._negotiate(found, stoppable=True)
                 for _ in range(self.options.connections)]
        if None in links:  # a signal: leave the device as it is
            raise AttachError(f"/dev/nbd{self.index}: stopped before a server answered")
        try:  # also ends a dead-link timeout an earlier attach may have left
            self._hand_over([link.sock.fileno() for link in links])
        finally:
            for link in links:
                link.sock.close()
        self._new_state(links[0])
        self.state.events.append(f"{_now()} adopted")
        self.say(f"/dev/nbd{self.index}: adopted (root hash {found.root_hash}), serving from "
                 f"{self._uri_text()}")

    # -- the loop --------------------------------------------------------------------

    def run(self) -> None:
        """Serve LINK_DEAD until the device is detached or a signal stops this process."""
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        while not self._stop:
            try:
                dead = self.kernel.link_dead(timeout=1.0)
            except InterruptedError:
                continue
            for index in dead:
                if index == self.index:
                    self._replace_link()
            if not kernel.connected(self.index) \
                    or kernel.backend(self.index) != self.identity.backend:
                self.say(f"/dev/nbd{self.index}: detached")
                self._remove_state()
                return
        self.say(f"/dev/nbd{self.index}: attach stops; the device stays attached "
                 f"(reads wait up to {self.options.dead_timeout_s} s for the next attach)")
        self._remove_state()

    def _on_signal(self, _signum, _frame) -> None:
        self._stop = True

    def _set_timer(self) -> None:
        kernel.set_io_timer(self.index, IO_TIMER_MS if self.options.connections == 1
                            else IO_TIMER_MULTI_MS)

    @property
    def _managed(self) -> bool:
        """Whether attach sets the request timeout itself (one link, no --timeout): with
        several links the kernel's timer cuts and moves requests by itself."""
        return not self.options.timeout_s and self.options.connections == 1

    def _orphans_wait(self) -> None:
        """While a link is dead, a request timeout (DEAD_LINK_TIMEOUT_S) makes the kernel
        move the requests that were in flight on it into the wait for a new link (served
        as soon as there is one, failed with EIO after the dead timeout); without it they
        would wait for the new link's hand-over and the timer's next look, or for ever if
        no server comes back. _hand_over ends it."""
        if self._managed:
            self.kernel.reconfigure(self.index, [], self.identity.backend,
                                    DEAD_LINK_TIMEOUT_S)

    def _hand_over(self, fds: list[int]) -> None:
        """Give the kernel new sockets for its dead links, with no request timeout again
        (in the same message, before the sockets: a socket handed over while a timeout is
        set gets it as its send timeout), so that a slow read is never cut."""
        self.kernel.reconfigure(self.index, fds, self.identity.backend,
                                0 if self._managed else None)
        if self._managed:
            self._set_timer()  # a timeout of 0 put the queue's timer back to 30 s

    def _replace_link(self) -> None:
        """A link died: a new connection to a server of the same image, handed over."""
        started = time.monotonic()
        self.say(f"/dev/nbd{self.index}: link dead, reconnecting")
        self._orphans_wait()
        link = self._negotiate(self.identity, stoppable=True)
        if link is None:
            return
        try:
            self._hand_over([link.sock.fileno()])
        finally:
            link.sock.close()
        waited = time.monotonic() - started
        state = self.state
        state.reconnects += 1
        state.server = self._uri_text()
        state.last_wait_s = round(waited, 3)
        state.longest_wait_s = max(state.longest_wait_s, state.last_wait_s)
        event = f"{_now()} reconnected to {state.server} in {waited:.3f} s"
        state.events = [*state.events, event][-20:]
        self._write_state()
        self.notify(f"STATUS=/dev/nbd{self.index}: {state.server}, {state.reconnects} "
                    f"reconnect(s)")
        self.say(f"/dev/nbd{self.index}: reconnected to {state.server} in {waited:.3f} s")

    def _negotiate(self, identity: Identity | FirstServer,
                   stoppable: bool = False) -> Negotiated | None:
        """A connection to the first URI (in turn) that serves identity's image; retried
        with a backoff until one does: while attaching, for FIRST_CONNECT_S at most (then
        AttachError with the reasons); for a dead link or a device adopted, until a signal
        stops attach (then None)."""
        delay = BACKOFF_FIRST_S
        said: set[str] = set()
        deadline = time.monotonic() + FIRST_CONNECT_S
        while True:
            for _ in range(len(self.options.uris)):
                uri = self.options.uris[self._next_uri]
                try:
                    got = negotiate(uri)
                except AttachError as e:
                    self._say_once(said, str(e))
                    self._advance()
                    continue
                refusal = identity.refuses(got)
                if refusal is None:
                    return got
                got.close()
                if self.state is not None:
                    self.state.skipped += 1
                self._say_once(said, f"{uri.text}: skipped: {refusal}")
                self._advance()
            if stoppable and self._stop:
                return None
            if not stoppable and time.monotonic() > deadline:
                raise AttachError(f"no server of the image within {FIRST_CONNECT_S} s: "
                                  + "; ".join(sorted(said)))
            time.sleep(delay)
            slow = time.monotonic() > deadline - FIRST_CONNECT_S + BACKOFF_SLOW_AFTER_S
            delay = BACKOFF_SLOW_S if slow else min(delay * 2, BACKOFF_MAX_S)

    def _advance(self) -> None:
        self._next_uri = (self._next_uri + 1) % len(self.options.uris)

    def _say_once(self, said: set[str], line: str) -> None:
        if line not in said:
            said.add(line)
            self.say(line)

    def _uri_text(self) -> str:
        return self.options.uris[self._next_uri].text

    # -- state for --list -----------------------------------------------------------

    def _new_state(self, link: Negotiated) -> None:
        self.state = State(device=f"/dev/nbd{self.index}", pid=os.getpid(),
                           uris=[u.text for u in self.options.uris],
                           root_hash=self.identity.root_hash, size=self.identity.size,
                           connections=self.options.connections, server=self._uri_text())

    def _state_path(self) -> Path:
        return self.options.state_dir / f"nbd{self.index}.json"

    def _write_state(self) -> None:
        try:
            self.options.state_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            write_atomically(str(self._state_path()),
                             json.dumps(self.state.__dict__, indent=1) + "\n", 0o644)
        except OSError as e:
            self.say(f"{self._state_path()}: {e.strerror} (attach --list will not show it)")

    def _remove_state(self) -> None:
        with contextlib.suppress(OSError):
            self._state_path().unlink()

    def close(self) -> None:
        self.kernel.close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


