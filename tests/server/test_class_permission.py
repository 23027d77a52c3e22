"""A class above the default, chosen by name (`NAME@rt`), needs the server's permission
(`serve --allow-class CLASS[=UID,...]`), as the kernel's ioprio_set(IOPRIO_CLASS_RT) needs
CAP_SYS_NICE: without it the connection gets the class it would have without the name.
Real nbdkit, real libnbd clients; the class a connection got read from the server's own
per-class counters (`ctl stats`)."""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from .serverlib import control_request, wait_for
from .test_exports import connect, images, write_export  # noqa: F401 - a fixture


def class_requests(control: str, export: str | None = None) -> dict[str, int]:
    """Requests counted per class (inline and pool) by the server."""
    request = {"cmd": "stats"} if export is None else {"cmd": "stats", "export": export}
    classes = control_request(control, request)["stats"]["classes"]
    return {name: row["inline"]["requests"] + row["pool"]["requests"]
            for name, row in classes.items()}


NOT_OURS = 4242 if os.geteuid() != 4242 else 4243


@pytest.mark.parametrize(("allow", "name", "expected"), [
    ({}, "@rt", "be"),  # no permission: the name's class is passed over
    ({"allow_class": "rt"}, "@rt", "rt"),  # every client may name rt
    ({"allow_class": f"rt={NOT_OURS}"}, "@rt", "be"),  # another uid may
    ({"allow_class": f"rt={NOT_OURS},{os.geteuid()}"}, "@rt", "rt"),  # we may
    ({}, "@idle", "idle"),  # below the default: always
    ({}, "@be", "be"),  # the default itself: always
    ({"default_class": "idle"}, "@be", "idle"),  # above an idle default: permission
    ({"default_class": "idle"}, "@none", "idle"),  # none is served as be: the same
    ({}, "@none", "none"),  # as be, not above it
])
def test_the_class_a_connection_named_needs_permission_above_the_default(
        default_image, servers, sockdir, allow, name, expected):
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(default_image, control=control, **allow)
    h = connect(server, name)
    assert h.pread(4096, 0) == default_image.expected(0, 4096)
    counts = class_requests(control)
    assert counts[expected] == 1 and sum(counts.values()) == 1, counts
    passed_over = "needs the server's permission" in server.log()
    assert passed_over == (expected != name[1:]), server.log()


def test_an_rt_name_without_permission_does_not_hold_back_other_clients(
        tmp_path, images, servers, sockdir):  # noqa: F811 - the fixture
    """~200 small reads a second on `c@rt`, not permitted, beside a be client of export
    a: the be client's reads stay fast (each took ~1000 ms when any client could name
    rt, held back by the class gate), and c's requests are counted as be."""
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "a", images["one"])
    write_export(directory, "c", images["two"])
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control])
    promoted, plain = connect(server, "c@rt"), connect(server, "a")
    stop = threading.Event()

    def hammer() -> None:
        end = time.monotonic() + 20  # bounded, whatever happens to the test
        while not stop.is_set() and time.monotonic() < end:
            promoted.pread(4096, 0)
            time.sleep(0.005)

    thread = threading.Thread(target=hammer)
    thread.start()
    took = []
    try:
        wait_for(lambda: class_requests(control, "c")["be"] > 10, "c's reads under way")
        for i in range(20):
            start = time.monotonic()
            assert plain.pread(4096, i * 4096) == images["one"].expected(i * 4096, 4096)
            took.append(time.monotonic() - start)
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    # loosely (a shared machine): the typical read, where every one waited ~1 s before
    assert statistics.median(took) < 0.2, f"be reads beside c@rt took {took}"
    counts = class_requests(control, "c")
    assert counts["rt"] == 0 and counts["be"] > 100, counts


def test_a_many_export_servers_default_class_is_every_exports(tmp_path, images, servers,  # noqa: F811 - the fixture
                                                              sockdir):
    """`serve --exports DIR --default-class idle`: a client naming no class gets idle on
    every export, and naming be is then a promotion (each export took be before)."""
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "a", images["one"])
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control,
                                "--default-class", "idle"])
    for name in ("a", "a@be"):
        assert connect(server, name).pread(4096, 0) == images["one"].expected(0, 4096)
    counts = class_requests(control, "a")
    assert counts["idle"] == 2 and sum(counts.values()) == 2, counts

