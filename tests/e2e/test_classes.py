"""I/O classes through the real kernel: /dev/nbd1 attached as export `@rt`, /dev/nbd0 as `be`.

One guest, one `nbd-verity serve --control CTL`, two connections: the plain one falls to
the default class `be`, the one named `@rt` is `rt` (docs/control.md). The host reads the
server's per-class counters between the guest's steps, then flips the threshold table
between "everything to the pool" and "everything inline" while fio reads both devices,
and the guest must see no error and the right bytes. The rt jobs pause 20 ms between
reads (fio's thinktime): be waits while rt is busy (schedule/gate.py), and the pauses,
longer than the gate's quiet time, give it its turns.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from nbd_verity.ioclass import CLASSES

from .conftest import DATA_SIZE, Images
from .harness import NBD_VERITY, Server, guest_session

PORT = 10809
BLOCK = 4096
# Direct 4 KiB reads in the counting phase: one NBD request each.
RT_READS = 256
BE_READS = 128
# The two threshold tables the host alternates between during fio: every request of both
# classes to the pool, then every request inline (fio's largest read is 256 KiB).
ALL_POOL = ("be=0", "rt=0")
ALL_INLINE = ("be=1048576", "rt=1048576")
# At least this many threshold changes while fio runs (20 round trips), and at least this
# long; the guest repeats short fio rounds until the host has made them.
MIN_CHANGES = 40
MIN_FLIP_S = 3.0
FIO_ROUND_S = 2
# Read back afterwards: nbd0 (be) in 256 KiB reads, inline; nbd1 (rt) in 1 MiB reads, pool.
FINAL = ("be=1048576", "rt=0")

FIO = (f"fio --readonly --ioengine=psync --direct=1 --rw=randread "
       f"--bssplit=4k/20:8k/20:32k/20:128k/20:256k/20 --numjobs=2 "
       f"--runtime={FIO_ROUND_S} --time_based --output-format=json "
       f"--name=be --filename=/dev/nbd0 --name=rt --filename=/dev/nbd1 --thinktime=20000")


def ctl(control: Path, *args: str) -> dict:
    """The JSON reply of `nbd-verity ctl --control CONTROL ARGS`, checked to be ok."""
    out = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(control), *args],
                         check=True, capture_output=True, text=True).stdout
    reply = json.loads(out)
    assert reply["ok"], reply
    return reply


def stats(control: Path) -> dict:
    return ctl(control, "stats", "--json")["stats"]


def set_thresholds(control: Path, settings: tuple[str, ...]) -> dict[str, int]:
    """Change the table with `nbd-verity ctl thresholds`; the table the server reports."""
    out = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(control), "thresholds",
                          *settings], check=True, capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()]  # "CLASS VALUE [(pinned)]", then notes
    table = {row[0]: int(row[1]) for row in rows if row and row[0] in CLASSES}
    assert set(table) == set(CLASSES), out
    for setting in settings:
        cls, value = setting.split("=")
        assert table[cls] == int(value), f"asked {setting}, server reports {table}"
    return table


def counts(before: dict, after: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """(class, path) -> (requests, bytes) between two stats snapshots."""
    return {(cls, path): (after["classes"][cls][path]["requests"]
                          - before["classes"][cls][path]["requests"],
                          after["classes"][cls][path]["bytes"]
                          - before["classes"][cls][path]["bytes"])
            for cls in after["classes"] for path in ("inline", "pool")}


def class_total(delta: dict, cls: str) -> tuple[int, int]:
    inline, pool = delta[(cls, "inline")], delta[(cls, "pool")]
    return inline[0] + pool[0], inline[1] + pool[1]


def assert_clean(snapshot: dict) -> None:
    assert snapshot["status"] == "V"
    assert snapshot["totals"]["corruptions"] == 0
    assert snapshot["totals"]["io_errors"] == 0


def test_rt_export_and_threshold_changes_under_fio(images: Images, tmp_path: Path):
    export = images.export
    control = tmp_path / "ctl.sock"
    # Both devices are opened once (dev_size) before the first count: the kernel scans a
    # new nbd device's partition table at its first open, with buffered reads of its own.
    script = f"""
nbd_attach nbd0 {PORT}
nbd_attach nbd1 {PORT} @rt
dev_size nbd0 nbd0.size
dev_size nbd1 nbd1.size
host_signal attached
host_wait counted
dd if=/dev/nbd1 of=/dev/null bs={BLOCK} skip=1024 count={RT_READS} iflag=direct status=none
host_signal read-rt
host_wait counted-rt
dd if=/dev/nbd0 of=/dev/null bs={BLOCK} skip=2048 count={BE_READS} iflag=direct status=none
host_signal read-be
host_wait counted-be
host_signal fio-start
round=0
while :; do
    round=$((round + 1))
    status=0
    {FIO} --output="$E2E_WORK/fio-$round.json" || status=$?
    echo "$round $status" >>"$E2E_WORK/fio.status"
    [ "$status" = 0 ] || break
    [ ! -e "$E2E_WORK/sync/enough" ] || break
done
host_signal fio-done
host_wait final
dev_sha256_direct nbd0 nbd0.sha256 256K
dev_sha256_direct nbd1 nbd1.sha256 1M
host_signal read-back
nbd_detach nbd0
nbd_detach nbd1
"""
    # The seed table (4096 for every class): a 4 KiB read sits exactly on the threshold.
    server = Server(export, extra_args=("--control", str(control), "--threshold-preset", "seed",
                                           "--allow-class", "rt"))
    started = time.monotonic()
    with guest_session(script, [], {PORT: server}, tmp_path / "run") as guest:
        guest.wait_for("attached")
        attached_s = time.monotonic() - started
        attached = stats(control)
        assert attached["thresholds"]["rt"] == attached["thresholds"]["be"] == BLOCK

        guest.signal("counted")
        guest.wait_for("read-rt")
        after_rt = stats(control)
        delta = counts(attached, after_rt)
        # 4 KiB requests at the seed table's 4096 threshold: inline, all of them rt.
        assert delta[("rt", "inline")] == (RT_READS, RT_READS * BLOCK), delta
        assert class_total(delta, "be") == (0, 0), delta
        assert delta[("rt", "pool")] == (0, 0), delta

        guest.signal("counted-rt")
        guest.wait_for("read-be")
        after_be = stats(control)
        delta = counts(after_rt, after_be)
        assert delta[("be", "inline")] == (BE_READS, BE_READS * BLOCK), delta
        assert class_total(delta, "rt") == (0, 0), delta
        assert delta[("be", "pool")] == (0, 0), delta

        guest.signal("counted-be")
        guest.wait_for("fio-start")
        flip_started = time.monotonic()
        changes = 0
        enough_sent = False
        while not guest.signalled("fio-done"):
            set_thresholds(control, ALL_POOL if changes % 2 == 0 else ALL_INLINE)
            changes += 1
            if (not enough_sent and changes >= MIN_CHANGES
                    and time.monotonic() - flip_started >= MIN_FLIP_S):
                guest.signal("enough")
                enough_sent = True
        flip_s = time.monotonic() - flip_started
        after_fio = stats(control)

        set_thresholds(control, FINAL)
        guest.signal("final")
        read_back_started = time.monotonic()
        guest.wait_for("read-back")
        read_back_s = time.monotonic() - read_back_started
        after_read_back = stats(control)
        run = guest.finish()
    total_s = time.monotonic() - started

    rounds = [tuple(map(int, line.split())) for line in run.lines("fio.status")]
    assert [status for _, status in rounds] == [0] * len(rounds), rounds
    assert enough_sent, f"fio stopped after {len(rounds)} rounds, {changes} changes"
    assert changes >= MIN_CHANGES
    for round_no, _ in rounds:
        result = json.loads((run.work / f"fio-{round_no}.json").read_text())
        jobs = result["jobs"]
        assert sorted(job["jobname"] for job in jobs) == ["be", "be", "rt", "rt"]
        for job in jobs:
            assert job["error"] == 0, (round_no, job["jobname"], job["error"])
            assert job["read"]["io_bytes"] > 0, (round_no, job["jobname"])

    delta = counts(after_be, after_fio)
    for key in (("rt", "inline"), ("rt", "pool"), ("be", "inline"), ("be", "pool")):
        assert delta[key][0] > 0, f"{key} unused while the thresholds flipped: {delta}"
    assert class_total(delta, "none") == class_total(delta, "idle") == (0, 0), delta
    assert_clean(after_fio)

    assert run.read("nbd0.sha256") == images.sha256
    assert run.read("nbd1.sha256") == images.sha256
    delta = counts(after_fio, after_read_back)
    assert delta[("be", "inline")][1] == DATA_SIZE, delta
    assert delta[("rt", "pool")][1] == DATA_SIZE, delta
    assert delta[("be", "pool")] == delta[("rt", "inline")] == (0, 0), delta
    assert_clean(after_read_back)

    print(f"classes e2e: {total_s:.1f} s in all (guest {run.seconds:.1f} s, attached after "
          f"{attached_s:.1f} s, read-back {read_back_s:.1f} s); {changes} threshold changes "
          f"in {flip_s:.1f} s over {len(rounds)} fio rounds; "
          f"fio-phase requests {counts(after_be, after_fio)}")
