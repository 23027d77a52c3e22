"""Where a 4 KiB random read's microseconds go: CPU per request, server side, by part.

Each server (the Python pass-through with thread states kept, the bare verifying plugin,
nbd-verity's default) serves fio's 4 KiB random reads from 8 jobs while `perf record -e
cpu-clock -g` samples the server process (nbdkit) alone. The samples are split into the
system calls they ran under (perf's "children" figures for each __x64_sys_* symbol:
receiving requests, sending replies, preadv, futex = waiting for and handing over the
GIL and nbdkit's locks, ...), and the rest by where they ran (Python's interpreter,
nbdkit, libc, our native module = hashing, other kernel = interrupts, scheduling not
under a call). Each part is turned into CPU microseconds per request: samples / rate /
requests served while sampling (fio's IOPS x the sampled seconds). Rows of the verifying
servers minus the pass-through's are what verifying costs, part by part. The client
(fio) runs on the same two cores and is not sampled; its CPU time is the same for every
server per request, so a difference in MB/s beyond the server's added CPU per request is
time the cores spent waiting (for the GIL), not computing.
Usage: python bench/profile4k.py [SECONDS]   (needs perf: Debian's linux-perf)
"""

from __future__ import annotations

import os
import re
import shutil
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

PERF = shutil.which("perf") or "/usr/bin/perf"
RATE = 4000  # samples per second per CPU
SYSCALLS = {  # perf symbol -> the part it names
    "recvfrom": "recv (next request)", "recvmsg": "recv (next request)",
    "read": "recv (next request)", "sendto": "send (reply)", "sendmsg": "send (reply)",
    "write": "send (reply)", "writev": "send (reply)", "preadv2": "preadv (data)",
    "preadv": "preadv (data)", "pread64": "preadv (data)",
    "futex": "futex (GIL, locks)", "poll": "poll", "ppoll": "poll",
    "mmap": "mmap/munmap", "munmap": "mmap/munmap", "madvise": "mmap/munmap",
}
DSOS = {"_native": "hashing (our native module)", "libpython": "Python interpreter",
        "nbdkit": "nbdkit", "libc": "libc", "libcrypto": "hashing (our native module)"}


def record(pid: int, seconds: float, out: str) -> subprocess.Popen:
    return subprocess.Popen([PERF, "record", "-q", "-e", "cpu-clock", "-F", str(RATE), "-g",
                             "-p", str(pid), "-o", out, "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(path: str, children: bool) -> list[tuple[float, str, str]]:
    """(samples, dso, symbol) rows of perf report."""
    mode = "--children" if children else "--no-children"
    out = subprocess.run([PERF, "report", "-i", path, mode, "--stdio", "-g", "none",
                          "--sort", "dso,sym", "-F", "period,dso,sym" if not children else
                          "children,period,dso,sym", "-t", "\t"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split("\t")]
        if children:
            total, _period, dso, sym = fields[:4]
            rows.append((float(total.rstrip("%")), dso, sym))
        else:
            period, dso, sym = fields[:3]
            rows.append((float(period), dso, sym))
    return rows


def parts(path: str) -> dict[str, float]:
    """Share of all samples per part (sums to 1)."""
    self_rows = report(path, children=False)
    total = sum(p for p, _, _ in self_rows) or 1.0
    out: dict[str, float] = defaultdict(float)
    under = 0.0
    for share, _dso, sym in report(path, children=True):
        m = re.match(r"\[k\] __(?:x64|se)_sys_(\w+)$", sym)
        if m and m.group(1) in SYSCALLS:
            out[SYSCALLS[m.group(1)]] += share / 100
            under += share / 100
    user: dict[str, float] = defaultdict(float)
    other_kernel = 0.0
    for period, dso, sym in self_rows:
        if sym.startswith("[k]"):
            other_kernel += period / total
            continue
        name = next((v for k, v in DSOS.items() if k in dso), "other user space")
        user[name] += period / total
    out["other kernel (interrupts, scheduling)"] = max(0.0, other_kernel - under)
    for name, share in user.items():
        out[name] += share
    return dict(out)


def profile(server: servers.Server, image, seconds: float) -> tuple[float, float, dict]:
    """(MB/s, CPU µs per request, {part: µs per request}) for one server."""
    job = Job("randread", 4096, 8, 1, seconds + 2)
    out = tempfile.mktemp(prefix="nvperf-", suffix=".data")
    fio = subprocess.Popen(fiorun.argv(server.uri(), job, image.data.stat().st_size),
                           stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # fio's jobs are connected and reading
        perf = record(server.pid, seconds, out)
        perf.wait(timeout=seconds + 60)
        stdout, _ = fio.communicate(timeout=seconds + 120)
        result = fiorun.parse(stdout)
        samples = sum(p for p, _, _ in report(out, children=False))
        requests = result.iops * seconds
        cpu_us = samples / RATE / requests * 1e6
        return result.mb_s, cpu_us, {k: v * cpu_us for k, v in parts(out).items()}
    finally:
        if os.path.exists(out):
            os.unlink(out)


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 5.0
    image = images.random_image(1 << 30)
    images.warm(image.data)
    images.warm(image.hash)
    group = [servers.passthrough_server(image.data, keys=("keep-thread-state=yes",)),
             servers.bare_server("bare read_verify plugin, serialize-requests", image,
                                 "serialize-requests"),
             servers.verity_server("nbd-verity, default", image, [])]
    group[0].name = "Python pass-through, thread state kept"
    rows = {}
    for server in group:
        server.start()
        try:
            if server.kind == "verity":
                subprocess.run(["nbdcopy", server.uri(), "null:"], check=True)  # fill caches
            rows[server.name] = profile(server, image, seconds)
        finally:
            server.stop()
    print(table(rows, seconds))
    return 0


def table(rows: dict, seconds: float) -> str:
    names = list(rows)
    every = sorted({p for _, _, ps in rows.values() for p in ps},
                   key=lambda p: -max(rows[n][2].get(p, 0) for n in names))
    base = names[0]
    lines = [f"4 KiB random, 8 jobs x QD1, {seconds:g} s sampled per server at {RATE}/s "
             f"(perf cpu-clock, server process only); CPU µs per request", "",
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
    mbs = [rows[n][0] for n in names]
    wall = [4096 / (m * 1e6) * 1e6 * 1 for m in mbs]  # µs of wall time per request served
    lines.append("| MB/s | " + " | ".join(f"{m:.1f}" for m in mbs) + " | " +
                 " | ".join(f"{m / mbs[0]:.2f}x" for m in mbs[1:]) + " |")
    lines.append("| wall µs per request (both cores) | " + " | ".join(
        f"{2 * w:.2f}" for w in wall) + " | " + " | ".join(
        f"{2 * (w - wall[0]):+.2f}" for w in wall[1:]) + " |")
    lines.append(f"\n(base: {base})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
