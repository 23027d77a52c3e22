"""nbdkit threads keep their Python thread state between requests (serve/threadstate.py),
and give it back when the client leaves, under every thread model.

Real nbdkit, real libnbd clients and raw-socket clients that leave mid-request; the count
of kept states is the control socket's `kept_thread_states`, which the C extension keeps.
"""

from __future__ import annotations

import os

import pytest

from nbd_verity.serve import threadstate

from ..serverlib import (
    close_handle,
    control_request,
    raw_connect,
    raw_read_request,
    wait_for,
)

pytestmark = pytest.mark.skipif(threadstate._threadstate is None,
                                reason="the _threadstate extension was not built")
MODELS = ("serialize-requests", "serialize-all-requests", "parallel")


def kept(control: str) -> int:
    return control_request(control, {"cmd": "stats"})["stats"]["kept_thread_states"]


def start(servers, image, sockdir, model):
    control = os.path.join(sockdir, f"ctl-{model}.sock")
    return servers.start(image, control=control, thread_model=model), control


@pytest.mark.parametrize("model", MODELS)
def test_states_are_kept_while_clients_read_and_given_back_when_they_leave(
        default_image, servers, sockdir, model, monkeypatch):
    monkeypatch.delenv(threadstate.KEEP_ENV, raising=False)
    server, control = start(servers, default_image, sockdir, model)
    handles = [server.connect() for _ in range(4)]
    for i, h in enumerate(handles):
        for j in range(12):
            offset = ((i * 12 + j) * 4096) % default_image.size
            assert h.pread(4096, offset) == default_image.expected(offset, 4096)
    # one thread per connection when nbdkit serialises; parallel spreads over its workers
    assert kept(control) >= 4 if model == "parallel" else kept(control) == 4
    for h in handles:
        server.handles.remove(h)
        close_handle(h)
    wait_for(lambda: kept(control) == 0, "every kept state given back")
    for round_ in range(30):  # clients come and go: nothing accumulates
        h = server.connect()
        assert h.pread(65536, round_ * 65536) == default_image.expected(round_ * 65536, 65536)
        server.handles.remove(h)
        close_handle(h)
    wait_for(lambda: kept(control) == 0, "every kept state given back after 30 clients")
    assert server.connect().pread(default_image.size, 0) == default_image.expected()


def test_clients_that_leave_mid_request_give_their_states_back(default_image, servers,
                                                               sockdir):
    server, control = start(servers, default_image, sockdir, "serialize-requests")
    for i in range(100):
        sock, size = raw_connect(str(server.socket))
        for handle in range(4):
            raw_read_request(sock, handle, (i * 4096 * 4 + handle * 4096) % size, 4096)
        sock.close()
    wait_for(lambda: kept(control) == 0, "states of 100 clients that left mid-request")
    assert server.alive()
    assert server.connect().pread(8192, 4096) == default_image.expected(4096, 8192)


def test_off_keeps_nothing(default_image, servers, sockdir, monkeypatch):
    monkeypatch.setenv(threadstate.KEEP_ENV, "0")
    server, control = start(servers, default_image, sockdir, "serialize-requests")
    h = server.connect()
    for j in range(8):
        assert h.pread(4096, j * 4096) == default_image.expected(j * 4096, 4096)
    assert kept(control) == 0
