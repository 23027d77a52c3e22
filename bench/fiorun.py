"""Run fio with its nbd engine against a server's URI and read the aggregate figures.

Every job here reads only (`randread` or `read`), with `--group_reporting` so the JSON has
one aggregate job. Sequential jobs each start in their own slice of the device
(`offset_increment`), so eight jobs read eight streams instead of the same blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

FIO = shutil.which("fio") or "/usr/bin/fio"


@dataclass(frozen=True)
class Job:
    """One fio workload."""

    rw: str  # "randread" or "read"
    bs: int  # bytes per request
    numjobs: int = 8
    iodepth: int = 1
    runtime: float = 10.0  # seconds
    time_based: bool = True  # False: stop at the end of each job's slice (or runtime)
    io_size: int | None = None  # bytes each job reads before it stops (not time based)

    def label(self) -> str:
        kind = "random" if self.rw == "randread" else "sequential"
        return f"{size_label(self.bs)} {kind}, {self.numjobs} jobs x QD{self.iodepth}"


@dataclass(frozen=True)
class Result:
    bw_bytes: float
    iops: float
    bytes_read: int

    @property
    def mb_s(self) -> float:
        return self.bw_bytes / 1e6


def size_label(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("k", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def argv(uri: str, job: Job, device_size: int) -> list[str]:
    """The fio command line for one job against one URI."""
    args = [FIO, "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--rw={job.rw}",
            f"--bs={job.bs}", f"--numjobs={job.numjobs}", f"--iodepth={job.iodepth}",
            f"--runtime={max(1, round(job.runtime))}", "--group_reporting",
            "--output-format=json", "--randrepeat=0"]
    if job.time_based:
        args.append("--time_based")
    if job.io_size:
        args.append(f"--io_size={job.io_size}")
    if job.rw == "read" and job.numjobs > 1:
        part = device_size // job.numjobs // job.bs * job.bs
        args += [f"--size={part}", f"--offset_increment={part}"]
    return args


def run(uri: str, job: Job, device_size: int) -> Result:
    """Run fio; raise with its stderr when it fails."""
    cmd = argv(uri, job, device_size)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=job.runtime + 120,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    return parse(proc.stdout, " ".join(cmd))


class Running:
    """fio started in the background, so that its processes can be paused and resumed
    together (SIGSTOP, SIGCONT) while it runs. Its job processes each start a session of
    their own: they are found as its children."""

    def __init__(self, uri: str, job: Job, device_size: int) -> None:
        self.cmd = argv(uri, job, device_size)
        self.job = job
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def pids(self) -> list[int]:
        """fio's process and its children (the jobs)."""
        found = [self.proc.pid]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # ended meanwhile
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == self.proc.pid:
                found.append(int(entry))
        return found

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None:
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signum)

    def stop(self) -> None:
        """End it (SIGKILL to every process of it); raise with its stderr when it had
        ended before: a load that was not there."""
        if self.proc.poll() is not None:
            _, stderr = self.proc.communicate()
            raise RuntimeError(f"fio ended early ({self.proc.returncode}): "
                               f"{' '.join(self.cmd)}\n{stderr}")
        self.signal(signal.SIGKILL)
        self.proc.communicate()


def parse(stdout: str, what: str = "fio") -> Result:
    """The aggregate figures of fio's JSON output (after whatever it printed first)."""
    report = json.loads(stdout[stdout.index("{"):])
    (agg,) = report["jobs"]
    if agg["error"]:
        raise RuntimeError(f"fio job error {agg['error']}: {what}")
    read = agg["read"]
    return Result(float(read["bw_bytes"]), float(read["iops"]), int(read["io_bytes"]))
