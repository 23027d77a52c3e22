"""Classes rank whole requests (schedule/gate.py): an idle request waits while a be
client is busy, at most the stated bound, and not at all alone; no thread's nice value
changes with its class (read from /proc/PID/task/TID/stat)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import nbd

from nbd_verity.schedule.gate import WAIT_S

from ..serverlib import NBD_VERITY, connect, control_request, wait_for


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


def test_classes_rank_requests_not_threads(default_image, servers):
    """An rt and an idle client side by side: every thread of the server stays at the
    server's own nice (the class gate ranks whole requests; nice values ranked no QoS
    bar the gate alone does not, docs/decisions/priority.md), and both read right."""
    server = servers.start(default_image, allow_class="rt")
    rt, idle = connect(server, "@rt"), connect(server, "@idle")
    for offset in range(0, 1 << 20, 4096):
        assert rt.pread(4096, offset) == default_image.expected(offset, 4096)
        assert idle.pread(4096, offset) == default_image.expected(offset, 4096)
    assert set(thread_nices(server.pid).values()) == {0}


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
