"""Where a 4 KiB random read's microseconds go: CPU per request, server and client, by part.

Each server (the Python pass-through keeping its thread states, the bare verifying
plugin, nbd-verity's default) serves fio's 4 KiB random reads from 8 jobs, twice per
round. The first run is plain: MB/s, and the CPU time per request of the server (nbdkit,
all its threads, /proc/PID/stat) and of the client (fio and its job processes,
getrusage of this process's children), over the requests fio served. The second is
sampled by `perf record -e cpu-clock -g` on the server alone, which slows a workload
this full of context switches down (by about half here), so it is used only for the
shares: the time under each kernel entry on the stack (perf's "children": reading the
next request, sending the reply, preadv, futex = waiting for and handing over the GIL
and nbdkit's locks, mmap/munmap, page faults), and the rest by where it ran (Python's
interpreter, nbdkit, libc, our native module = hashing, other kernel = interrupts and
scheduling outside those calls). Share x the plain run's server CPU per request = that
part's microseconds. Each verifying server's column minus the pass-through's is what
verifying costs, part by part. With two cores busy, wall µs per request x 2 is the CPU
time there was per request; server + client CPU per request against it says whether
the cores were full (CPU-bound) or waiting. Medians over the rounds.
Usage: python bench/profile4k.py [ROUNDS [SECONDS]]   (needs perf: Debian's linux-perf)
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import servers  # noqa: E402
from fiorun import Job  # noqa: E402
from side import spread  # noqa: E402

PERF = shutil.which("perf") or "/usr/bin/perf"
RATE = 1000  # samples per second per CPU (more slows the server down visibly)
KERNEL = {  # kernel symbols on the stack (perf's children) -> the part they name
    "__x64_sys_sendto": "send (reply)", "__x64_sys_sendmsg": "send (reply)",
    "ksys_write": "send (reply)", "ksys_read": "recv (next request)",
    "__x64_sys_recvfrom": "recv (next request)", "__x64_sys_recvmsg": "recv (next request)",
    "do_preadv": "preadv (data)", "__x64_sys_pread64": "preadv (data)",
    "__x64_sys_futex": "futex (GIL, locks)", "do_sys_poll": "poll",
    "__x64_sys_mmap": "mmap/munmap", "__x64_sys_munmap": "mmap/munmap",
    "__x64_sys_madvise": "mmap/munmap", "asm_exc_page_fault": "page faults",
}
DSOS = {"_native": "hashing (our native module)", "libpython": "Python interpreter",
        "nbdkit": "nbdkit", "libc": "libc", "libcrypto": "hashing (our native module)"}


def record(pid: int, seconds: float, out: str) -> subprocess.Popen:
    return subprocess.Popen([PERF, "record", "-q", "-e", "cpu-clock", "-F", str(RATE), "-g",
                             "-p", str(pid), "-o", out, "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


ROW = re.compile(r"^\s+([\d.]+)%\s+(?:([\d.]+)%\s+)?(\S+)\s+(\[.\] .+?)\s*$")


def report(path: str, children: bool) -> tuple[float, list[tuple[float, str, str]]]:
    """(CPU seconds sampled, [(share of them, dso, symbol)]) from perf report: with
    children, the share is the time under the symbol (its callees included)."""
    mode = "--children" if children else "--no-children"
    out = subprocess.run([PERF, "report", "-i", path, mode, "--stdio", "-g", "none",
                          "--sort", "dso,sym"], capture_output=True, text=True,
                         check=True).stdout
    seconds, rows = 0.0, []
    for line in out.splitlines():
        if line.startswith("# Event count (approx.):"):
            seconds = int(line.split(":")[1]) / 1e9  # cpu-clock counts nanoseconds
        m = ROW.match(line)
        if m:
            rows.append((float(m.group(1)) / 100, m.group(3), m.group(4)))
    return seconds, rows


def parts(path: str) -> tuple[float, dict[str, float]]:
    """(CPU seconds, {part: share}), the shares summing to 1."""
    seconds, self_rows = report(path, children=False)
    out: dict[str, float] = defaultdict(float)
    under = 0.0
    for share, _dso, sym in report(path, children=True)[1]:
        part = KERNEL.get(sym[4:]) if sym.startswith("[k] ") else None
        if part is not None:
            out[part] += share
            under += share
    other_kernel = 0.0
    for share, dso, sym in self_rows:
        if sym.startswith("[k]"):
            other_kernel += share
        else:
            out[next((v for k, v in DSOS.items() if k in dso), "other user space")] += share
    out["other kernel (interrupts, scheduling)"] = max(0.0, other_kernel - under)
    return seconds, dict(out)


def process_cpu(pid: int) -> float:
    """User + system seconds of a process, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def plain_run(server: servers.Server, image, seconds: float) -> tuple[float, float, float]:
    """(MB/s, server CPU µs per request, client CPU µs per request), no perf attached."""
    job = Job("randread", 4096, 8, 1, seconds)
    server_before, client_before = process_cpu(server.pid), children_cpu()
    result = fiorun.run(server.uri(), job, image.data.stat().st_size)
    requests = result.iops * seconds
    return (result.mb_s, (process_cpu(server.pid) - server_before) / requests * 1e6,
            (children_cpu() - client_before) / requests * 1e6)


def shares_run(server: servers.Server, image, seconds: float) -> dict[str, float]:
    """{part: share of the server's CPU} from a run sampled by perf."""
    job = Job("randread", 4096, 8, 1, seconds + 2)
    fd, out = tempfile.mkstemp(prefix="nvperf-", suffix=".data")
    os.close(fd)  # perf writes it
    fio = subprocess.Popen(fiorun.argv(server.uri(), job, image.data.stat().st_size),
                           stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # fio's jobs are connected and reading
        perf = record(server.pid, seconds, out)
        perf.wait(timeout=seconds + 60)
        fio.wait(timeout=seconds + 120)
        return parts(out)[1]
    finally:
        if os.path.exists(out):
            os.unlink(out)


def profile(server: servers.Server, image, seconds: float) -> tuple[float, float, float, dict]:
    """(MB/s, server and client CPU µs per request, {part: server µs per request})."""
    mb_s, server_us, client_us = plain_run(server, image, seconds)
    shares = shares_run(server, image, seconds)
    return mb_s, server_us, client_us, {k: v * server_us for k, v in shares.items()}


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 3
    seconds = float(argv[1]) if len(argv) > 1 else 5.0
    image = images.warm_random_image(1 << 30)
    group = [servers.passthrough_server(image.data, keys=("keep-thread-state=yes",)),
             servers.bare_server("bare read_verify plugin, serialize-requests", image,
                                 "serialize-requests"),
             servers.verity_server("nbd-verity, default", image, [])]
    group[0].name = "Python pass-through, thread state kept"
    runs: dict[str, list] = {server.name: [] for server in group}
    try:
        for server in group:
            server.start()
            if server.kind == "verity":
                subprocess.run(["nbdcopy", server.uri(), "null:"], check=True)  # fill caches
        for _ in range(rounds):
            for server in group:
                runs[server.name].append(profile(server, image, seconds))
    finally:
        for server in group:
            server.stop()
    print(table(runs, seconds))
    return 0


def table(runs: dict, seconds: float) -> str:
    """Medians over the rounds; MB/s and CPU per request with their min-max."""
    rows = {}
    for name, results in runs.items():
        every = {p for *_, ps in results for p in ps}
        rows[name] = (statistics.median(r[0] for r in results),
                      statistics.median(r[1] for r in results),
                      {p: statistics.median(r[3].get(p, 0.0) for r in results) for p in every},
                      statistics.median(r[2] for r in results))
    names = list(rows)
    every = sorted({p for _, _, ps, _ in rows.values() for p in ps},
                   key=lambda p: -max(rows[n][2].get(p, 0) for n in names))
    base = names[0]
    rounds = len(next(iter(runs.values())))
    lines = [f"4 KiB random, 8 jobs x QD1, {seconds:g} s sampled per server at {RATE}/s "
             f"(perf cpu-clock, server process only), {rounds} rounds; CPU µs per request, "
             "medians", "",
             "| part | " + " | ".join(names) + " | " +
             " | ".join(f"{n} - pass-through" for n in names[1:]) + " |",
             "|---|" + "---|" * (2 * len(names) - 1)]
    for part in every:
        vals = [rows[n][2].get(part, 0.0) for n in names]
        lines.append(f"| {part} | " + " | ".join(f"{v:.2f}" for v in vals) + " | " +
                     " | ".join(f"{v - vals[0]:+.2f}" for v in vals[1:]) + " |")
    cpu = [rows[n][1] for n in names]
    lines.append("| **server CPU per request** | " + " | ".join(f"**{v:.2f}**" for v in cpu)
                 + " | " + " | ".join(f"**{v - cpu[0]:+.2f}**" for v in cpu[1:]) + " |")
    client = [rows[n][3] for n in names]
    lines.append("| client (fio) CPU per request | " + " | ".join(f"{v:.2f}" for v in client)
                 + " | " + " | ".join(f"{v - client[0]:+.2f}" for v in client[1:]) + " |")
    both = [c + k for c, k in zip(cpu, client, strict=True)]
    lines.append("| server + client CPU per request | " + " | ".join(f"{v:.2f}" for v in both)
                 + " | " + " | ".join(f"{v - both[0]:+.2f}" for v in both[1:]) + " |")
    mbs = [rows[n][0] for n in names]
    wall = [4096 / m for m in mbs]  # µs of wall time per request served (MB/s = bytes/µs)
    lines.append("| MB/s | " + " | ".join(f"{m:.1f}" for m in mbs) + " | " +
                 " | ".join(f"{m / mbs[0]:.2f}x" for m in mbs[1:]) + " |")
    lines.append("| wall µs per request (both cores) | " + " | ".join(
        f"{2 * w:.2f}" for w in wall) + " | " + " | ".join(
        f"{2 * (w - wall[0]):+.2f}" for w in wall[1:]) + " |")
    for name, results in runs.items():
        lines.append(f"- {name}: MB/s {spread([r[0] for r in results])}, server CPU µs per "
                     f"request {spread1([r[1] for r in results])}, client "
                     f"{spread1([r[2] for r in results])} (min/median/max)")
    lines.append(f"\n(base: {base})")
    return "\n".join(lines)


def spread1(xs: list[float]) -> str:
    return f"{min(xs):.1f}/{statistics.median(xs):.1f}/{max(xs):.1f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
