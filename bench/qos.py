"""Classes that mean priority, and the dispatch under load (docs/benchmarks.md, "I/O
classes and dispatch under load"). Two tables, each over ROUNDS interleaved rounds:

QoS. A QD1 4 KiB random reader (libnbd, one request at a time) of one class, alone and
beside a bulk load of another (4 fio jobs, nbd engine, 2 MiB sequential, default CPU
priority), on one server; the same with class priorities off
(NBD_VERITY_CLASS_PRIORITY=0) beside it. Targets: be reader's p99 with an idle bulk load
<= 1.5x alone; rt reader's p99 with a be bulk load <= 1.5x alone; an idle bulk load alone
>= 0.95 of a be bulk load alone.

Dispatch. For 4 KiB random x8, 64 KiB random x8, 512 KiB sequential x8, 2 MiB sequential
x1 and x4 (fio, nbd engine): the default server's MB/s against each fixed table (all
inline, all pool, 64K, 256K, 1M, set with `ctl thresholds`: pinned). Target: the default
>= 0.95 of the best fixed table for each workload.

With --baseline DIR (a checkout of an earlier main, its extensions built in place:
`python setup.py build_ext --inplace` there), a server of that checkout on its own
default table runs each dispatch workload in the same rounds, just after this one's
default: the "no workload slower than before" column.

    python bench/qos.py [ROUNDS [SECONDS]] [--baseline DIR]   (default 3 5; make bench)
"""

from __future__ import annotations

import os
import random
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


def reader(uri: str, seconds: float, stop: threading.Event | None = None) -> list[float]:
    """QD1 4 KiB random reads for seconds: every latency, in seconds."""
    h = nbd.NBD()
    h.connect_uri(uri)
    rng = random.Random(1)
    blocks = SIZE // 4096
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        offset = rng.randrange(blocks) * 4096
        started = time.perf_counter()
        h.pread(4096, offset)
        latencies.append(time.perf_counter() - started)
    h.shutdown()
    return latencies


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6


def with_bulk(server, reader_class: str, bulk_class: str | None, seconds: float):
    """(reader p99 us, bulk MB/s or None) with the bulk load beside the reader."""
    result: dict = {}
    bulk = None
    if bulk_class is not None:
        job = fiorun.Job(BULK.rw, BULK.bs, numjobs=BULK.numjobs, runtime=seconds + 1)
        bulk = threading.Thread(target=lambda: result.update(
            bulk=fiorun.run(server.uri(f"@{bulk_class}"), job, SIZE)))
        bulk.start()
        time.sleep(0.5)  # the load is running before the reader starts
    latencies = reader(server.uri(f"@{reader_class}"), seconds)
    if bulk is not None:
        bulk.join()
    return p99(latencies), (result["bulk"].mb_s if "bulk" in result else None)


def qos_round(servers_by_name: dict, seconds: float, out: dict) -> None:
    for name, server in servers_by_name.items():
        for reader_class, bulk_class in (("be", None), ("be", "idle"), ("rt", None),
                                         ("rt", "be")):
            us, _ = with_bulk(server, reader_class, bulk_class, seconds)
            key = f"{name}: {reader_class} reader p99 us" + (
                f", {bulk_class} bulk beside" if bulk_class else ", alone")
            out.setdefault(key, []).append(us)
        for bulk_class in ("be", "idle"):
            job = fiorun.Job(BULK.rw, BULK.bs, numjobs=BULK.numjobs, runtime=seconds)
            mb_s = fiorun.run(server.uri(f"@{bulk_class}"), job, SIZE).mb_s
            out.setdefault(f"{name}: {bulk_class} bulk alone MB/s", []).append(mb_s)


def set_table(server, name: str | None) -> None:
    if name is None:
        server.ctl({"cmd": "thresholds", "preset": "default"})
    else:
        server.ctl({"cmd": "thresholds", "set": {c: TABLES[name] for c in CLASSES}})


def dispatch_round(server, seconds: float, out: dict, baseline=None) -> None:
    for job in WORKLOADS:
        timed = fiorun.Job(job.rw, job.bs, numjobs=job.numjobs, runtime=seconds)
        for table in (None, *TABLES):
            set_table(server, table)
            mb_s = fiorun.run(server.uri("@be"), timed, SIZE).mb_s
            out.setdefault((job.label(), table or "default"), []).append(mb_s)
            if table is None and baseline is not None:
                mb_s = fiorun.run(baseline.uri("@be"), timed, SIZE).mb_s
                out.setdefault((job.label(), "baseline"), []).append(mb_s)
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
          f"(min-max))")
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
    baseline_dir = None
    if "--baseline" in argv:
        at = argv.index("--baseline")
        baseline_dir = Path(argv[at + 1]).resolve()
        argv = argv[:at] + argv[at + 2:]
    rounds = int(argv[1]) if len(argv) > 1 else 3
    seconds = float(argv[2]) if len(argv) > 2 else 5.0
    image = images.random_image(SIZE)
    images.warm(image.data)
    images.warm(image.hash)
    started = {
        "priorities on": servers.verity_server("priorities on", image, []),
        "priorities off": servers.verity_server("priorities off", image, []),
    }
    started["priorities off"].env = {**started["priorities off"].env,
                                     "NBD_VERITY_CLASS_PRIORITY": "0"}
    baseline = None
    if baseline_dir is not None:
        baseline = servers.verity_server("baseline", image, [])
        baseline.env = {**baseline.env, "PYTHONPATH": str(baseline_dir)}
        started["baseline"] = baseline
    qos: dict = {}
    dispatch: dict = {}
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    try:
        for server in started.values():
            server.start(timeout=120)
        qos_servers = {k: v for k, v in started.items() if v is not baseline}
        for _ in range(rounds):
            qos_round(qos_servers, seconds, qos)
            dispatch_round(started["priorities on"], seconds, dispatch, baseline)
    finally:
        for server in started.values():
            server.stop()
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    report(qos, dispatch, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
