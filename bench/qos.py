"""Classes that mean priority, and the dispatch under load (docs/benchmarks.md, "I/O
classes and dispatch under load"). Two tables, each over ROUNDS interleaved rounds:

QoS. A QD1 4 KiB random reader (libnbd, one request at a time) of one class, alone and
beside a bulk load of another (4 fio jobs, nbd engine, 2 MiB sequential, default CPU
priority), on one server; the same with class priorities off
(NBD_VERITY_CLASS_PRIORITY=0) beside it. Alone and beside are measured in turns of
SLICE_S within one run (the load paused with SIGSTOP in the alone slices), so that the
host's bursts of CPU steal fall on both alike; each round prints the steal it saw.
Targets: be reader's p99 with an idle bulk load <= 1.5x alone; rt reader's p99 with a be
bulk load <= 1.5x alone; an idle bulk load alone >= 0.95 of a be bulk load alone.

Dispatch. For 4 KiB random x8, 64 KiB random x8, 512 KiB sequential x8, 2 MiB sequential
x1 and x4 (fio, nbd engine): the default server's MB/s against each fixed table (all
inline, all pool, 64K, 256K, 1M, set with `ctl thresholds`: pinned), in slices of one
second taken in turn, DISPATCH_SLICES x SECONDS of each per round (rounded to a multiple
of PROCESSES: 16 for 5 s), on PROCESSES server processes started anew each round (the
slices spread over them alike). A pinned table sends every request
of one size the same way (inline when it fits the threshold, else the pool), so the
fixed tables that dispatch a workload alike are one measurement, taken as often as the
default's: the best of four runs of one table against one run of the default would be
the best of four draws of this machine's noise (identical tables' means of five slices
were up to 25% apart).
Target: the default >= 0.95 of the best fixed table for each workload.

With --baseline DIR (a checkout of an earlier main, its extensions built in place:
`python setup.py build_ext --inplace` there), a server of that checkout on its own
default table runs each dispatch workload in the same rounds, in the same turns, on as
many processes of its own: the "no workload slower than before" column.

    python bench/qos.py [ROUNDS [SECONDS]] [--baseline DIR]   (default 3 5; make bench)
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import nbd  # noqa: E402
import servers  # noqa: E402

SIZE = 512 << 20
KIB, MIB = 1 << 10, 1 << 20
BULK = fiorun.Job("read", 2 * MIB, numjobs=4)
WORKLOADS = [fiorun.Job("randread", 4 * KIB), fiorun.Job("randread", 64 * KIB),
             fiorun.Job("read", 512 * KIB), fiorun.Job("read", 2 * MIB, numjobs=1),
             fiorun.Job("read", 2 * MIB, numjobs=4)]
TABLES = {"all inline": 32 * MIB, "all pool": 0, "64K": 64 * KIB, "256K": 256 * KIB,
          "1M": MIB}
CLASSES = ("none", "rt", "be", "idle")
DISPATCH_SLICES = 3  # dispatch: one-second slices per config and round, per SECONDS (one
# slice's MB/s is 4-10% (sd) from the next of the same dispatch: the mean of 16 is then
# within about 1-2.5%, by arithmetic, not measured apart)
RT_BY_NAME = ["--allow-class", "rt"]  # the readers name their class, rt included
PROCESSES = 2  # dispatch: server processes of each kind per round, started anew each round
SLICE_S = 1.25  # QoS: the reader's slices alone and beside the load, in turn: longer than
# the gate's 1 s bound, so that a slice beside the load holds the requests that ran because
# they had waited that long, at the rate a continuous load gets them
TURN_S = 0.1  # ... and the pause at each turn (not counted): longer than the gate's 8 ms
# quiet plus its waiters' 64 ms between looks, so a paused load's requests end in it


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6


def paired(server, reader_class: str, bulk_class: str, seconds: float) -> tuple[float, float]:
    """(reader p99 us alone, beside the bulk load): one reader and one fio bulk load run
    for 2 x seconds, the load paused (SIGSTOP) and resumed in turn every SLICE_S, so
    that both figures come from the same seconds of this shared machine (its CPU steal
    comes in bursts of seconds: docs/benchmarks.md). Slices go alone, beside, beside,
    alone, ... At each turn the reader stops for TURN_S and its requests of the moment
    are not counted: once paused, the load's requests in flight end (the gate lets them
    through when the reader has been quiet for its 8 ms and they look again), and once
    resumed it is running again. In the alone slices the load's connections stay open,
    idle."""
    slices = max(2, round(seconds / SLICE_S)) * 2
    job = fiorun.Job(BULK.rw, BULK.bs, numjobs=BULK.numjobs,
                     runtime=slices * (SLICE_S + TURN_S) + 3)
    samples: dict = {"alone": [], "beside": []}
    phase: list = [None, 0]  # the slice's name (None: a turn), and a count of turns
    done = threading.Event()
    errors: list = []

    def read() -> None:
        try:
            h = nbd.NBD()
            h.connect_uri(server.uri(f"@{reader_class}"))
            rng = random.Random(1)
            blocks = SIZE // 4096
            while not done.is_set():
                name, turn = phase
                if name is None:
                    time.sleep(0.001)
                    continue
                offset = rng.randrange(blocks) * 4096
                started = time.perf_counter()
                h.pread(4096, offset)
                seconds = time.perf_counter() - started
                if phase == [name, turn]:  # no turn began while it ran
                    samples[name].append(seconds)
            h.shutdown()
        except Exception as e:  # reported by the caller
            errors.append(e)

    bulk = fiorun.Running(server.uri(f"@{bulk_class}"), job, SIZE)
    reader_thread = threading.Thread(target=read)
    try:
        time.sleep(0.5)  # the load is connected and running
        reader_thread.start()
        for i in range(slices):
            name = "beside" if i % 4 in (1, 2) else "alone"
            phase[:] = [None, phase[1] + 1]
            bulk.signal(signal.SIGCONT if name == "beside" else signal.SIGSTOP)
            time.sleep(TURN_S)
            phase[:] = [name, phase[1]]
            time.sleep(SLICE_S)
    finally:
        done.set()
        if reader_thread.is_alive():
            reader_thread.join()
        bulk.stop()
    if errors:
        raise errors[0]
    return p99(samples["alone"]), p99(samples["beside"])


def qos_round(servers_by_name: dict, seconds: float, out: dict) -> None:
    for name, server in servers_by_name.items():
        for reader_class, bulk_class in (("be", "idle"), ("rt", "be")):
            alone, beside = paired(server, reader_class, bulk_class, seconds)
            key = f"{name}: {reader_class} reader p99 us"
            out.setdefault(f"{key}, alone", []).append(alone)
            out.setdefault(f"{key}, {bulk_class} bulk beside", []).append(beside)
        for bulk_class in ("be", "idle"):
            job = fiorun.Job(BULK.rw, BULK.bs, numjobs=BULK.numjobs, runtime=seconds)
            mb_s = fiorun.run(server.uri(f"@{bulk_class}"), job, SIZE).mb_s
            out.setdefault(f"{name}: {bulk_class} bulk alone MB/s", []).append(mb_s)


def steal() -> int:
    """The host's CPU steal so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def set_table(server, name: str | None) -> None:
    if name is None:
        server.ctl({"cmd": "thresholds", "preset": "default"})
    else:
        server.ctl({"cmd": "thresholds", "set": {c: TABLES[name] for c in CLASSES}})


def alike(job: fiorun.Job) -> dict[str, list[str]]:
    """The fixed tables grouped by how they dispatch the job's requests (all of one size):
    the first of each group stands for it."""
    groups: dict = {}
    for name, threshold in TABLES.items():
        groups.setdefault("inline" if job.bs <= threshold else "pool", []).append(name)
    return {names[0]: names for names in groups.values()}


def balanced(n: int, k: int) -> list[int]:
    """The k-th order of n configs in a Williams design: over n orders (2n when n is
    odd) every config comes first, second, ... and right after every other one as often
    (a slice right after another process's, or after a table that loads the machine
    otherwise, may run unlike one after the same server's)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = k % (n if n % 2 == 0 else 2 * n)
    order = [(x + row) % n for x in first]
    return order[::-1] if row >= n else order


def dispatch_round(fleet: list, seconds: float, out: dict, baselines: list | None = None,
                   turn: int = 0) -> None:
    """Each workload on the default, each fixed table that dispatches it differently and
    the baseline, in slices of one second taken in turn (each slice and each round in
    the next order of a balanced design), DISPATCH_SLICES x seconds of each in all:
    this machine's speed moves from one second to the next (identical dispatch measured
    5 s after 5 s differed by up to 15%), and slices in turn put every table under the
    same seconds. The slices go to the fleet's processes in turn (PROCESSES of this
    server, as many of the baseline's), every config on each as often: identical
    processes serve at rates up to 20% apart for their whole life (docs/benchmarks.md),
    so the default and the fixed tables share their processes, and the baseline's
    column is its own processes' against this server's, new ones each round. A table's
    MB/s is the mean of its slices'; the tables that dispatch the workload alike get
    their group's."""
    slices = max(1, round(DISPATCH_SLICES * seconds / len(fleet))) * len(fleet)
    for job in WORKLOADS:
        groups = alike(job)
        configs = [None, *groups] + (["baseline"] if baselines else [])
        timed = fiorun.Job(job.rw, job.bs, numjobs=job.numjobs, runtime=1)
        got: dict = {}
        for i in range(slices):
            server = fleet[i % len(fleet)]
            for config in (configs[j] for j in balanced(len(configs), turn * slices + i)):
                if config == "baseline":
                    uri = baselines[i % len(baselines)].uri("@be")
                else:
                    set_table(server, config)
                    uri = server.uri("@be")
                got.setdefault(config or "default", []).append(
                    fiorun.run(uri, timed, SIZE).mb_s)
        for config, values in got.items():
            for name in groups.get(config, [config]):
                out.setdefault((job.label(), name), []).append(statistics.fmean(values))
        for server in fleet:
            set_table(server, None)


def cell(values: list[float], digits: int = 0) -> str:
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
            f"{max(values):.{digits}f})")


def report(qos: dict, dispatch: dict, rounds: int) -> None:
    print(f"## QoS: a QD1 4 KiB reader beside a bulk load ({rounds} rounds: median (min-max))")
    print("| figure | value |\n|---|---|")
    for key, values in qos.items():
        print(f"| {key} | {cell(values)} |")
    for name in ("priorities on", "priorities off"):
        for reader_class, bulk in (("be", "idle"), ("rt", "be")):
            alone = qos[f"{name}: {reader_class} reader p99 us, alone"]
            beside = qos[f"{name}: {reader_class} reader p99 us, {bulk} bulk beside"]
            ratios = [b / a for a, b in zip(alone, beside, strict=True)]
            print(f"| {name}: {reader_class} p99 with {bulk} bulk / alone (target <= 1.5) "
                  f"| {cell(ratios, 2)} |")
        idle, be = qos[f"{name}: idle bulk alone MB/s"], qos[f"{name}: be bulk alone MB/s"]
        ratios = [i / b for i, b in zip(idle, be, strict=True)]
        print(f"| {name}: idle bulk alone / be bulk alone (target >= 0.95) | "
              f"{cell(ratios, 2)} |")
    print(f"\n## Dispatch: the default against fixed tables ({rounds} rounds: MB/s, median "
          f"(min-max); the fixed tables that dispatch a workload alike are one measurement)")
    baseline = any(key[1] == "baseline" for key in dispatch)
    header = ["default", *TABLES] + (["baseline"] if baseline else [])
    extra = " default / baseline |" if baseline else ""
    print("| workload | " + " | ".join(header) + " | default / best fixed (target >= 0.95) |"
          + extra)
    print("|---" * (len(header) + 2 + baseline) + "|")
    for job in WORKLOADS:
        label = job.label()
        cells = [cell(dispatch[(label, t)]) for t in header]
        best = max(statistics.median(dispatch[(label, t)]) for t in TABLES)
        default = statistics.median(dispatch[(label, "default")])
        row = f"| {label} | " + " | ".join(cells) + f" | {default / best:.2f} |"
        if baseline:
            row += f" {default / statistics.median(dispatch[(label, 'baseline')]):.2f} |"
        print(row)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/qos.py",
        description="Classes that mean priority, and the dispatch under load.")
    parser.add_argument("rounds", nargs="?", type=int, default=3)
    parser.add_argument("seconds", nargs="?", type=float, default=5.0,
                        help="seconds of each measurement per round")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="a checkout of an earlier main, extensions built in place")
    args = parser.parse_args(argv[1:])
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("rounds must be 1 or more and seconds over 0")
    if args.baseline is not None and not (args.baseline / "nbd_verity").is_dir():
        parser.error(f"--baseline {args.baseline}: not a checkout (no nbd_verity/ in it)")
    rounds, seconds = args.rounds, args.seconds
    baseline_dir = None if args.baseline is None else args.baseline.resolve()
    image = images.random_image(SIZE)
    images.warm(image.data)
    images.warm(image.hash)
    started = {
        "priorities on": servers.verity_server("priorities on", image, RT_BY_NAME),
        "priorities off": servers.verity_server("priorities off", image, RT_BY_NAME),
    }
    started["priorities off"].env = {**started["priorities off"].env,
                                     "NBD_VERITY_CLASS_PRIORITY": "0"}
    qos: dict = {}
    dispatch: dict = {}
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    try:
        for server in started.values():
            server.start(timeout=120)
        for turn in range(rounds):
            ticks, began = steal(), time.monotonic()
            qos_round(started, seconds, qos)
            fleet = [servers.verity_server(f"default {i}", image, [])
                     for i in range(PROCESSES)]
            baselines = [servers.checkout_server(f"baseline {i}", image, baseline_dir)
                         for i in range(PROCESSES)] if baseline_dir is not None else []
            try:
                for server in fleet + baselines:
                    server.start(timeout=120)
                dispatch_round(fleet, seconds, dispatch, baselines, turn)
            finally:
                for server in fleet + baselines:
                    server.stop()
            share = (steal() - ticks) / os.sysconf("SC_CLK_TCK") / (
                (time.monotonic() - began) * (os.cpu_count() or 1))
            print(f"round {turn + 1}: CPU steal {100 * share:.1f}% of this machine's CPU "
                  f"time", file=sys.stderr)
    finally:
        for server in started.values():
            server.stop()
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    report(qos, dispatch, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
