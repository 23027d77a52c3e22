"""A device that outlives its servers: `nbd-verity attach` on a real /dev/nbd0.

One guest boot (Debian's kernel under TCG) attaches /dev/nbd0 with `nbd-verity attach` to
two servers of the same image (ports A and B), reads the whole device with O_DIRECT in
128 KiB reads, pass after pass (guest/reader.py), while the host makes 20 events of four
kinds happen to its servers, 5 rounds of:
- stop: the server stopped as its unit stops it (`ctl stop`), then started again;
- kill: SIGKILL (a crash), then started again;
- gap: stopped, 3 s with nothing listening, then started again;
- takeover: the other server started, this one stopped for good.
Then a server of another image, and an unverified nbdkit of the same bytes, each listen in
turn for 3 s where attach reconnects: neither may be handed to the kernel. Then attach
itself is restarted under its device (it adopts it). Then the server stops and does not
come back: reads fail with EIO after the dead timeout, and read again once it is back.
Every pass must be the image, byte for byte, no read may fail but those, and `detach`
ends it all (size 0, attach exits).
The waits (the slowest read after each event) are printed and written to
WORK/attach-waits.txt; docs/attach.md gives them from these runs.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

from .harness import NBD_VERITY, GuestFailed, Server, ServerProcess, guest_session
from .images import random_file, verity_format

PORT_A, PORT_B = 10811, 10812
SIZE = 8 << 20  # a pass is 64 reads of 128 KiB
ROUNDS = 5
KINDS = ("stop", "kill", "gap", "takeover")
GAP_S = 3.0
DEAD_TIMEOUT_S = 10  # attach's --dead-timeout here (60 by default): the "gone" phase waits it
GUEST = "10.0.2.100"


def script() -> str:
    attach = (f"{NBD_VERITY} attach --dead-timeout {DEAD_TIMEOUT_S} nbd://{GUEST}:{PORT_A}/ "
              f"nbd://{GUEST}:{PORT_B}/ /dev/nbd0")
    return f"""
# start_attach N: attach in the background, its log in attach.N.log, its pid in a file
start_attach() {{
    {attach} >"$E2E_WORK/attach.$1.log" 2>&1 &
    echo $! >"$TMPDIR/attach.pid"
}}
start_attach 1
tries=300
until [ -e /sys/block/nbd0/pid ] && [ "$(cat /sys/block/nbd0/size)" -gt 0 ]; do
    tries=$((tries - 1)); [ "$tries" -gt 0 ] || {{ cat "$E2E_WORK/attach.1.log"; exit 1; }}
    sleep 0.1
done
python3 "$E2E_GUEST_DIR/reader.py" /dev/nbd0 "$E2E_WORK" &
reader=$!
host_signal attached
host_wait restart-attach 900
kill "$(cat "$TMPDIR/attach.pid")"
while kill -0 "$(cat "$TMPDIR/attach.pid")" 2>/dev/null; do sleep 0.05; done
start_attach 2
sleep 1
host_signal attach-restarted
host_wait done 900
wait "$reader"
{NBD_VERITY} attach --list --json >"$E2E_WORK/attach.list"
{NBD_VERITY} detach /dev/nbd0
while kill -0 "$(cat "$TMPDIR/attach.pid")" 2>/dev/null; do sleep 0.05; done
cat /sys/block/nbd0/size >"$E2E_WORK/size.after"
if [ -e /sys/block/nbd0/pid ]; then echo still; else echo gone; fi >"$E2E_WORK/pid.after"
"""


def progress(work: Path) -> int:
    try:
        return int((work / "reader.progress").read_text())
    except (OSError, ValueError):
        return 0


def wait_passes(guest, work: Path, more: int, timeout_s: float = 180) -> None:
    """Until the reader finished `more` passes after now (reads go on after an event)."""
    target = progress(work) + more
    deadline = time.monotonic() + timeout_s
    while progress(work) < target:
        guest.signalled("never")  # GuestFailed if the guest has stopped
        if time.monotonic() > deadline:
            raise GuestFailed(f"the reader did not get past pass {target} in {timeout_s} s; "
                              f"console:\n{guest.console()}")
        time.sleep(0.05)


def diagnostics(work: Path, console: str) -> str:
    """The last lines of attach's logs and of the guest kernel's nbd messages."""
    out = []
    for log in sorted(work.glob("attach.*.log")):
        out += [f"-- {log.name}", *log.read_text().splitlines()[-8:]]
    for pattern in ("[ab].*.log", "socat-*.log"):
        logs = sorted(work.glob(pattern), key=lambda p: p.stat().st_mtime)[-2:]
        for log in logs:
            out += [f"-- {log.name}", *log.read_text().splitlines()[-6:]]
    out += ["-- guest kernel", *[line for line in console.splitlines()
                                 if "nbd" in line and "I/O error" not in line][-15:]]
    return "\n".join(out)


def errors_text(work: Path) -> str:
    path = work / "reader.errors"
    return path.read_text() if path.exists() else ""


def waits_by_event(work: Path) -> dict[str, float]:
    """The slowest read seen under each event's label (reads over the reader's 50 ms)."""
    worst: dict[str, float] = {}
    path = work / "reader.slow"
    for line in (path.read_text().splitlines() if path.exists() else []):
        label, seconds = line.rsplit(" ", 1)
        worst[label] = max(worst.get(label, 0.0), float(seconds))
    return worst


def table(worst: dict[str, float]) -> str:
    """Per kind: median and worst of the events' slowest reads (under 0.05 s counts as 0.05)."""
    lines = []
    for kind in (*KINDS, "foreign", "unverified", "attach-restart"):
        waits = [worst.get(label, 0.05) for label in _labels(kind)]
        lines.append(f"{kind:<15} events {len(waits):>2}  median {statistics.median(waits):6.3f} s"
                     f"  worst {max(waits):6.3f} s")
    return "\n".join(lines)


def _labels(kind: str) -> list[str]:
    return [f"{kind}-{r}" for r in range(ROUNDS)] if kind in KINDS else [kind]


def test_device_outlives_its_servers(e2e_host, tmp_path: Path):
    folder = tmp_path / "images"
    folder.mkdir()
    data = random_file(folder / "data.img", SIZE, seed=67)
    export = verity_format(data, folder / "data.verity")
    other = verity_format(random_file(folder / "other.img", SIZE, seed=68),
                          folder / "other.verity")
    expected = hashlib.sha256(data.read_bytes()).hexdigest()
    work = tmp_path / "run"
    work.mkdir()
    servers = {PORT_A: ServerProcess(Server(export), PORT_A, work, "a"),
               PORT_B: ServerProcess(Server(export), PORT_B, work, "b")}
    intruders = []
    try:
        current = servers[PORT_A].start()
        with guest_session(script(), [], {}, work, timeout_s=900,
                           ports=[PORT_A, PORT_B]) as guest:
            guest.wait_for("attached", 300)
            wait_passes(guest, work, 1)
            for round_ in range(ROUNDS):
                for kind in KINDS:
                    guest.signal("event", f"{kind}-{round_}")
                    if kind == "stop":
                        current.stop()
                        current.start()
                    elif kind == "kill":
                        current.kill()
                        current.start()
                    elif kind == "gap":
                        current.stop()
                        time.sleep(GAP_S)
                        current.start()
                    else:
                        other_port = PORT_B if current.port == PORT_A else PORT_A
                        successor = servers[other_port].start()
                        current.stop()
                        current = successor
                    wait_passes(guest, work, 2)
            # Servers attach must not use, each alone where it reconnects for GAP_S.
            for label, server in (("foreign", Server(other)),
                                  ("unverified", Server(export, kind="nbdkit-file"))):
                guest.signal("event", label)
                current.stop()
                intruder = ServerProcess(server, current.port, work, label)
                intruders.append(intruder)
                intruder.start()
                time.sleep(GAP_S)
                intruder.close()
                current.start()
                wait_passes(guest, work, 2)
            guest.signal("event", "attach-restart")
            guest.signal("restart-attach")
            guest.wait_for("attach-restarted", 120)
            wait_passes(guest, work, 2)
            # A server that does not come back: reads fail (EIO) after the dead timeout,
            # and the device reads again once a server is back.
            guest.signal("event", "gone")
            current.stop()
            gone = time.monotonic()
            while "gone" not in errors_text(work):
                guest.signalled("never")
                assert time.monotonic() - gone < DEAD_TIMEOUT_S + 30, \
                    f"no read failed\n{diagnostics(work, guest.console())}"
                time.sleep(0.05)
            failed_after = time.monotonic() - gone
            time.sleep(1)
            guest.signal("event", "back")
            current.start()
            back = time.monotonic()
            wait_passes(guest, work, 1)
            recovered_after = time.monotonic() - back
            guest.signal("event", "end")
            guest.signal("stop-reader")
            guest.signal("done")
            run = guest.finish()
    finally:
        for server in (*servers.values(), *intruders):
            server.close()

    passes = run.lines("reader.passes")
    errors = [line.split() for line in errors_text(work).splitlines()]
    worst = waits_by_event(work)
    summary = (table(worst) + f"\ngone            reads failed (EIO) {failed_after:.1f} s "
               f"after the server's stop (dead timeout {DEAD_TIMEOUT_S} s); a pass done "
               f"{recovered_after:.1f} s after it was back")
    (work / "attach-waits.txt").write_text(summary + "\n")
    print(f"\nattach across {ROUNDS * len(KINDS)} server events, {len(passes)} passes "
          f"({run.console.count('e2e-guest: init up')} boot):\n{summary}")
    # Only while no server was there past the dead timeout (until the next one is up),
    # and only with EIO.
    assert errors and all(label in ("gone", "back") and code == "5"
                          for _offset, code, label in errors), errors
    assert DEAD_TIMEOUT_S - 1 <= failed_after <= DEAD_TIMEOUT_S + 10, failed_after
    # No server answered a request with an error (NBD_ESHUTDOWN, on a stop without the
    # drain), and no relay wrote its own text into the NBD stream.
    assert "Other side returned error" not in run.console
    assert "Wrong magic" not in run.console
    assert len(passes) >= 2 * ROUNDS * len(KINDS)
    assert set(passes) == {expected}, "a pass read other bytes than the image"
    logs = "".join((work / f"attach.{n}.log").read_text() for n in (1, 2))
    assert "skipped: it serves another image" in logs, logs
    assert "skipped: it names no root hash" in logs, logs
    assert "adopted" in (work / "attach.2.log").read_text()
    listed = json.loads(run.read("attach.list"))
    assert [row["device"] for row in listed] == ["/dev/nbd0"]
    assert listed[0]["root_hash"] == export.root_hash
    assert run.read("size.after") == "0"
    assert run.read("pid.after") == "gone"
