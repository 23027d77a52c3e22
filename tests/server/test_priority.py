"""Classes rank the CPU: the nbdkit threads that verify a connection's requests run at
its class's nice value (rt -10, be 0, idle 19; idle only while a connection of another
rank is open, the server's own alone), read from /proc/PID/task/TID/stat; bytes do not
depend on it. Classes rank whole requests (schedule/gate.py): an idle request waits
while a be client is busy, at most the stated bound, and not at all alone."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import nbd
import pytest

from nbd_verity.schedule.gate import WAIT_S

from .serverlib import NBD_VERITY, control_request, wait_for


def thread_nices(pid: int) -> dict[int, int]:
    """nice of every thread of pid (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile (between the listing and the read)
        out[int(tid)] = int(fields[16])  # after "pid (comm)": state is field 3, nice 19
    return out


def connect(server, name: str):
    h = nbd.NBD()
    server.handles.append(h)
    h.set_export_name(name)
    h.connect_unix(server.socket)
    return h


@pytest.mark.parametrize("name, nice", [("@rt", -10), ("@idle", 0), ("@be", 0)])
def test_a_connections_threads_run_at_its_class(default_image, servers, name, nice):
    """Alone: rt at -10, be at 0, and idle at 0 too, as nothing else wants the server."""
    server = servers.start(default_image, allow_class="rt")
    before = thread_nices(server.pid)
    h = connect(server, name)
    for offset in range(0, 1 << 20, 4096):  # every request on the connection's threads
        assert h.pread(4096, offset) == default_image.expected(offset, 4096)
    after = thread_nices(server.pid)
    changed = {tid: n for tid, n in after.items() if tid in before and before[tid] != n}
    born = {tid: n for tid, n in after.items() if tid not in before}
    if nice != 0:
        assert nice in {**changed, **born}.values(), (before, after)
    assert all(n == nice for n in changed.values()), changed  # nothing else changed
    # the connection's threads: at its class once they served a request (nbdkit starts
    # more threads than a client of one request at a time may reach, on a busy machine)
    assert all(n in (nice, 0) for n in born.values()), born
    assert before[server.pid] == after[server.pid] == 0  # the main thread stays


def test_the_class_follows_the_connection(default_image, servers):
    """One server: an rt client's threads at -10 and, beside it, an idle client's at 19;
    when the rt client leaves its threads go with it, and the idle client's next
    requests run at the server's own nice again."""
    server = servers.start(default_image, allow_class="rt")
    rt, idle = connect(server, "@rt"), connect(server, "@idle")
    for h in (rt, idle):
        h.pread(4096, 0)
    for offset in range(0, 1 << 20, 4096):  # every idle thread, the rt client open
        idle.pread(4096, offset)
    nices = set(thread_nices(server.pid).values())
    assert {-10, 19} <= nices, nices
    rt.shutdown()
    wait_for(lambda: -10 not in thread_nices(server.pid).values(), "rt threads gone")
    before = thread_nices(server.pid)
    assert 19 in before.values()  # not before their next request
    for offset in range(0, 1 << 20, 4096):
        assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
    after = thread_nices(server.pid)
    changed = {tid: n for tid, n in after.items() if before.get(tid, n) != n}
    assert changed and set(changed.values()) == {0}, (before, after)  # 19 -> 0 only


def be_load(server, clients: int, stop: threading.Event, errors: list) -> list:
    """clients be connections reading 1 MiB requests round the image until stop."""
    def run():
        h = nbd.NBD()
        h.set_export_name("@be")
        h.connect_unix(server.socket)
        try:
            while not stop.is_set():
                for offset in range(0, 4 << 20, 1 << 20):
                    h.pread(1 << 20, offset)
        except nbd.Error as e:
            errors.append(str(e))
        finally:
            h.shutdown()

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def gate_of(control: str) -> dict:
    return control_request(control, {"cmd": "stats"})["stats"]["class_gate"]


def test_an_idle_request_completes_under_a_constant_be_load(default_image, servers, tmp_path):
    """Four be clients read as fast as they can; an idle client's 1 MiB reads wait at the
    gate and run when they have waited WAIT_S (the bound docs/control.md states),
    so each completes within WAIT_S and its own work (1.5 s of slack on a shared
    machine), and returns the image's bytes."""
    control = str(tmp_path / "ctl.sock")
    server = servers.start(default_image, control=control)
    stop = threading.Event()
    errors: list[str] = []
    load = be_load(server, 4, stop, errors)
    try:
        time.sleep(0.5)
        idle = connect(server, "@idle")
        worst = 0.0
        for offset in range(0, 3 << 20, 1 << 20):
            started = time.monotonic()
            assert idle.pread(1 << 20, offset) == default_image.expected(offset, 1 << 20)
            worst = max(worst, time.monotonic() - started)
        gate = gate_of(control)["idle"]
    finally:
        stop.set()
        for thread in load:
            thread.join(60)
    assert errors == []
    assert worst < WAIT_S + 1.5, worst
    # the bound, not a lull in the load, let one run; a request may also find a lull of
    # the be clients (a busy machine) and run without waiting, as idle should
    assert gate["waited"] >= gate["aged"] >= 1, gate


def test_idle_waits_for_be_and_runs_freely_once_be_has_gone(default_image, servers,
                                                            tmp_path):
    """While a be client reads, an idle client's requests wait at the gate; alone (the be
    client gone) they wait for nothing: not one more wait is counted."""
    control = str(tmp_path / "ctl.sock")
    server = servers.start(default_image, control=control)
    idle = connect(server, "@idle")
    for offset in range(0, 1 << 20, 4096):  # alone: no better connection is open
        assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
    assert gate_of(control)["idle"]["waited"] == 0
    stop = threading.Event()
    errors: list[str] = []
    load = be_load(server, 1, stop, errors)
    try:
        wait_for(lambda: gate_of(control)["be"]["connections"] == 1, "the be client")
        time.sleep(0.2)
        for offset in range(0, 64 << 10, 4096):
            assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
    finally:
        stop.set()
        for thread in load:
            thread.join(60)
    assert errors == []
    during = gate_of(control)
    assert during["idle"]["waited"] >= 1, during
    wait_for(lambda: gate_of(control)["be"]["connections"] == 0, "the be client gone")
    for offset in range(0, 1 << 20, 4096):
        assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
    assert gate_of(control)["idle"]["waited"] == during["idle"]["waited"]
    shown = subprocess.run([str(NBD_VERITY), "ctl", "--control", control, "stats"],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    line = next(x for x in shown.splitlines() if x.startswith("dispatch "))
    waited = during["idle"]["waited"]
    assert f"idle {waited} (" in line.split("waited for a better class:")[1], line


def test_class_priority_off_turns_the_gate_off(default_image, servers, tmp_path,
                                               monkeypatch):
    """NBD_VERITY_CLASS_PRIORITY=0: connections are not counted, nobody waits."""
    control = str(tmp_path / "ctl.sock")
    monkeypatch.setenv("NBD_VERITY_CLASS_PRIORITY", "0")
    server = servers.start(default_image, control=control)
    stop = threading.Event()
    errors: list[str] = []
    load = be_load(server, 1, stop, errors)
    try:
        idle = connect(server, "@idle")
        time.sleep(0.2)
        for offset in range(0, 64 << 10, 4096):
            assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
        gate = gate_of(control)
    finally:
        stop.set()
        for thread in load:
            thread.join(60)
    assert errors == []
    assert gate["idle"] == {"connections": 0, "waited": 0, "aged": 0, "waited_s": 0.0}
    assert gate["be"]["connections"] == 0
