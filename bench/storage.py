"""Storage with latency: verified reads against unverified ones of the same storage.

Each row is one workload from ONE client connection (one fio job, fio's nbd engine, at a
queue depth): unverified = fio reading the data upstream itself; verified = `nbd-verity
serve DATA HASH ROOT` over the same upstreams, default options, a fresh (cold) server
per run. The ratio is verified / unverified, per round; the table gives the median and
range over ROUNDS rounds. Each round runs the unverified read first and last, the
verified ones (and the relays) between them, and sets each against the mean of the two:
a machine or disk that drifts during a round moves the baseline with it; the table shows
the largest drift of the unverified read within a round. With several thread models, or
--baseline, their order is reversed every other round.

Sources:
- `delay D`: data and hash images behind nbdkit `file` upstreams under nbdkit's `delay`
  filter (`rdelay=D`: every read waits D), on Unix sockets: a network disk or an object
  store; beside the verified rows, the same reads relayed by nbdkit's own `nbd` plugin
  (C, verifying nothing): what one more NBD hop costs by itself; and by bench/
  passthrough.py (nbdkit's Python plugin, parallel model, one libnbd connection per
  thread, each read polled for on its request's thread, verifying nothing): what any
  Python plugin relaying those reads gets here;
- `http D`: the same files from an HTTP server whose every GET waits D
  (bench/httpdelay.py); unverified = nbdkit's curl plugin on the data URL;
- `disk`: the machine's own disk, uncached (root: the page cache is dropped before each
  run, `echo 3 > /proc/sys/vm/drop_caches`); unverified = nbdkit's C `file` plugin, 4 KiB
  random reads at QD1 and QD16 (a 2 GiB image); beside the verified rows, bench/
  passthrough.py (nbdkit's Python plugin reading the file, verifying nothing, parallel
  model, each nbdkit thread's Python thread state kept as serve keeps it) against the same
  baseline: what any Python plugin gets from that disk here.

    .venv/bin/python bench/storage.py [--rounds 3] [--runtime 4] [--delays 1ms,10ms]
        [--disk] [--http 10ms] [--thread-models default,serialize-requests]
        [--thread-models default,default+two-calls,default+no-chunks] [--baseline DIR]
        [--disk-models default,parallel,parallel+python-fast-path]

With --baseline DIR (a checkout of an earlier commit, its extensions built in place:
`python setup.py build_ext --inplace` there), each delay and disk row's models are
served by that checkout too, in the same rounds: a change's before and after from one
run.

`--delays 0ms` is a network source without latency (a page-cached upstream): where the
thread model serve chooses for a network image is measured against the other one.

It prints a markdown table for docs/benchmarks.md ("Storage with latency").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import report  # noqa: E402
import servers  # noqa: E402
from fiorun import Job  # noqa: E402

from nbd_verity import launch  # noqa: E402
from nbd_verity.format.digest import NATIVE_NBD_ENV  # noqa: E402
from nbd_verity.serve.fastpath import FAST_NATIVE_ENV  # noqa: E402
from nbd_verity.sources.ahead import CHUNKS_ENV  # noqa: E402

WORKLOADS = (("randread", 4 << 10, 1), ("randread", 4 << 10, 16), ("randread", 64 << 10, 4),
             ("read", 128 << 10, 1), ("read", 128 << 10, 8))
DISK_WORKLOADS = (("randread", 4 << 10, 1), ("randread", 4 << 10, 16))
SIZE = 512 << 20
DISK_SIZE = 2 << 30


def delayed(path: Path, delay: str, name: str) -> servers.Server:
    return servers.Server(f"{name}, rdelay={delay}", "file", [f"file={path}",
                                                             f"rdelay={delay}"], None,
                          ("delay",))


def label(rw: str, bs: int, qd: int) -> str:
    kind = "random" if rw == "randread" else "sequential"
    return f"{fiorun.size_label(bs)} {kind}, QD{qd}"


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def measure_delay(image: images.Image, delay: str, rounds: int, runtime: float,
                  models: list[str]) -> list[dict]:
    """Each workload, unverified then verified in each thread model (`default`: serve's
    own choice), within each round."""
    rows = []
    with delayed(image.data, delay, "data") as data, delayed(image.hash, delay, "hash") as hashes:
        served = images.Image(data.uri(), hashes.uri(), image.root, image.size, image.how)
        for rw, bs, qd in WORKLOADS:
            job = Job(rw, bs, 1, qd, runtime)
            runs = Runs()
            for round_ in range(rounds):
                first = fiorun.run(data.uri(), job, image.size).mb_s
                got = {}
                with servers.Server("relay", "nbd", [f"socket={data.socket}"]) as relay:
                    got[RELAY] = fiorun.run(relay.uri(), job, image.size).mb_s
                with servers.Server("Python relay", "passthrough",
                                    [f"uri={data.uri()}", "keep-thread-state=yes"]) as relay:
                    got[PYTHON_RELAY] = fiorun.run(relay.uri(), job, image.size).mb_s
                # every other round in reverse: no model always first after the relays
                for model in models if round_ % 2 == 0 else models[::-1]:
                    with verity(served, model) as server:
                        got[model] = fiorun.run(server.uri(), job, image.size).mb_s
                last = fiorun.run(data.uri(), job, image.size).mb_s
                runs.add(first, last, got, f"delay {delay}: {label(rw, bs, qd)}")
            for model in models:
                rows.append(runs.summary(f"NBD, {delay} per read{model_label(model)}",
                                         label(rw, bs, qd), model))
            for relay in (RELAY, PYTHON_RELAY):
                rows.append(runs.summary(f"NBD, {delay} per read: {relay}", label(rw, bs, qd),
                                         relay))
    return rows


class Runs:
    """One row group's rounds. The unverified read is run first and last in each round,
    and every run of the round is set against their mean: a drift of the machine or
    the disk during the round weighs on the verified runs as on their baseline (it is
    shown, as the largest first-to-last change of any round)."""

    def __init__(self) -> None:
        self.pairs: dict[str, list[tuple[float, float]]] = {}
        self.drifts: list[float] = []

    def add(self, first: float, last: float, got: dict[str, float], what: str) -> None:
        unverified = (first + last) / 2
        self.drifts.append(abs(last - first) / unverified if unverified else 0.0)
        for name, verified in got.items():
            self.pairs.setdefault(name, []).append((unverified, verified))
            say(f"{what} ({name}): {first:.1f}..{last:.1f} / {verified:.1f}")

    def summary(self, source: str, workload: str, name: str) -> dict:
        return summary(source, workload, self.pairs[name], max(self.drifts))


BASELINE = "+baseline"  # a model's suffix: served by the --baseline checkout
baseline_dir: Path | None = None  # --baseline
TWO_CALLS = "+two-calls"  # a model's suffix: NBD_VERITY_NATIVE_NBD=0
NO_CHUNKS = "+no-chunks"  # ... NBD_VERITY_STREAM_CHUNKS=0
PYTHON_FAST = "+python-fast-path"  # ... NBD_VERITY_FAST_NATIVE=0 (a local file's)
SUFFIXES = {  # suffix: (environment, row label)
    TWO_CALLS: ({NATIVE_NBD_ENV: "0"}, f"read and verified in two calls ({NATIVE_NBD_ENV}=0)"),
    NO_CHUNKS: ({CHUNKS_ENV: "0"}, f"each request its own read ({CHUNKS_ENV}=0)"),
    PYTHON_FAST: ({FAST_NATIVE_ENV: "0"}, f"the fast path in Python ({FAST_NATIVE_ENV}=0)"),
}


def split_model(model: str) -> tuple[str, list[str]]:
    """A model's base (`default` or a thread model) and its suffixes, in order."""
    base, *suffixes = model.split("+")
    suffixes = [f"+{suffix}" for suffix in suffixes]
    for suffix in suffixes:
        if suffix == BASELINE and baseline_dir is not None:
            continue
        if suffix not in SUFFIXES:
            raise SystemExit(f"--thread-models: unknown suffix {suffix} "
                             f"(one of {', '.join(SUFFIXES)})")
    return base, suffixes


def verity(served: images.Image, model: str) -> servers.Server:
    """serve in a thread model (`default`: its own choice); with TWO_CALLS, its fast path
    reads over NBD and verifies in two calls (read_idle, verify), as before the one
    native call (Hasher.nbd_read_verify); with NO_CHUNKS, a stream's requests in flight
    each read their own bytes, as before the shared chunks (sources/ahead.py); with
    PYTHON_FAST, a local file's fast path runs in Python, as before its native frame
    (FastRead.read); with BASELINE, the --baseline checkout serves."""
    base, suffixes = split_model(model)
    server = servers.verity_server("verified", served,
                                   [] if base == "default" else ["--thread-model", base])
    for suffix in suffixes:
        if suffix == BASELINE:
            server.env = {**server.env, "PYTHONPATH": str(baseline_dir)}
        else:
            server.env = {**server.env, **SUFFIXES[suffix][0]}
    return server


def model_label(model: str) -> str:
    base, suffixes = split_model(model)
    text = "" if base == "default" else f", --thread-model {base}"
    return text + "".join(f", the baseline ({baseline_label()})" if suffix == BASELINE
                          else f", {SUFFIXES[suffix][1]}" for suffix in suffixes)


def baseline_label() -> str:
    """The --baseline checkout by its commit (its directory if it has none)."""
    commit = subprocess.run(["git", "-C", str(baseline_dir), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return commit or str(baseline_dir)


DISK = "local disk, uncached"
RELAY = "relayed by nbdkit's nbd plugin (C, nothing verified)"
PYTHON_RELAY = "relayed by a Python plugin (bench/passthrough.py, nothing verified), parallel"
PASSTHROUGH = ("local disk, uncached: Python pass-through (nothing verified, thread states "
               "kept), parallel")


class DelayedHttp:
    """bench/httpdelay.py serving an image's data and hash files, each GET delayed."""

    def __init__(self, image: images.Image, delay: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="nvb-http-")
        port_file = os.path.join(self.dir, "port")
        seconds = float(delay.removesuffix("ms")) / 1000
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "httpdelay.py"), port_file, str(seconds),
             f"data.img={image.data}", f"hash.img={image.hash}"])
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("bench/httpdelay.py did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            self.base = f"http://127.0.0.1:{f.read().strip()}"

    def close(self) -> None:
        launch.stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def measure_http(image: images.Image, delay: str, rounds: int, runtime: float) -> list[dict]:
    """Each workload from an HTTP server whose GETs wait `delay`: unverified = nbdkit's
    curl plugin on the data URL, verified = serve of both URLs (its captive curl)."""
    rows = []
    http = DelayedHttp(image, delay)
    try:
        data_url, hash_url = f"{http.base}/data.img", f"{http.base}/hash.img"
        served = images.Image(data_url, hash_url, image.root, image.size, image.how)
        for rw, bs, qd in WORKLOADS:
            job = Job(rw, bs, 1, qd, runtime)
            runs = Runs()
            for _ in range(rounds):
                with servers.Server("curl", "curl", [f"url={data_url}"]) as plain:
                    first = fiorun.run(plain.uri(), job, image.size).mb_s
                with servers.verity_server("verified", served, []) as server:
                    verified = fiorun.run(server.uri(), job, image.size).mb_s
                with servers.Server("curl", "curl", [f"url={data_url}"]) as plain:
                    last = fiorun.run(plain.uri(), job, image.size).mb_s
                runs.add(first, last, {"default": verified}, f"http {delay}: {label(rw, bs, qd)}")
            rows.append(runs.summary(f"HTTP, {delay} per GET", label(rw, bs, qd), "default"))
    finally:
        http.close()
    return rows


def measure_disk(rounds: int, runtime: float, models: list[str]) -> list[dict]:
    """Each workload against the C file plugin, served in each model (--disk-models:
    by default serve's own choice and the parallel model) within each round, their order
    reversed every other round. By default an image mostly in the page cache is served
    serialize-requests (its reads are faster so); this one is not (the caches were just
    dropped), so auto serves it as a network image: parallel where nbdkit allows it (1.34
    on), serialize-requests on 1.32."""
    image = images.random_image_named("storage-disk", DISK_SIZE)
    rows = []
    for rw, bs, qd in DISK_WORKLOADS:
        job = Job(rw, bs, 1, qd, runtime)
        runs = Runs()
        for round_ in range(rounds):
            first = disk_unverified(image, job)
            got = {}
            for model in models if round_ % 2 == 0 else models[::-1]:
                drop_caches()
                with verity(image, model) as server:
                    got[model] = fiorun.run(server.uri(), job, image.size).mb_s
            drop_caches()
            with servers.passthrough_server(image.data,
                                            keys=("keep-thread-state=yes",)) as plain_python:
                got[PASSTHROUGH] = fiorun.run(plain_python.uri(), job, image.size).mb_s
            runs.add(first, disk_unverified(image, job), got, label(rw, bs, qd))
        rows += [runs.summary(DISK + model_label(model), label(rw, bs, qd), model)
                 for model in models]
        rows.append(runs.summary(PASSTHROUGH, label(rw, bs, qd), PASSTHROUGH))
    return rows


def disk_unverified(image: images.Image, job: Job) -> float:
    """nbdkit's C file plugin on the image, the page cache dropped first."""
    drop_caches()
    with servers.file_server(image.data) as server:
        return fiorun.run(server.uri(), job, image.size).mb_s


def summary(source: str, workload: str, runs: list[tuple[float, float]],
            drift: float) -> dict:
    ratios = sorted(v / u for u, v in runs)
    return {"source": source, "workload": workload,
            "unverified": statistics.median(u for u, _ in runs),
            "verified": statistics.median(v for _, v in runs),
            "ratio": statistics.median(ratios), "low": ratios[0], "high": ratios[-1],
            "drift": drift}


def table(rows: list[dict]) -> str:
    header = ["source", "workload (one connection)", "unverified MB/s", "verified MB/s",
              "verified / unverified (min-max)", "unverified's drift in a round (max)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['source']} | {r['workload']} | {r['unverified']:.1f} | "
                     f"{r['verified']:.1f} | {r['ratio']:.2f} ({r['low']:.2f}-{r['high']:.2f}) "
                     f"| {r['drift']:.0%} |")
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runtime", type=float, default=4.0)
    parser.add_argument("--delays", default="1ms,10ms")
    parser.add_argument("--disk", action="store_true", help="also the uncached disk (root)")
    parser.add_argument("--http", default="",
                        help="also an HTTP source whose GETs wait this long (e.g. 10ms)")
    parser.add_argument("--thread-models", default="default",
                        help="verified in each of these (comma-separated; default: serve's "
                             "own choice), e.g. default,serialize-requests; a model with "
                             f"the suffix {TWO_CALLS} reads and verifies over NBD in two "
                             f"calls ({NATIVE_NBD_ENV}=0), with {NO_CHUNKS} a stream's "
                             f"requests in flight each read their own bytes "
                             f"({CHUNKS_ENV}=0)")
    parser.add_argument("--disk-models", default="default,parallel",
                        help="the disk rows' models, as --thread-models (a model with the "
                             f"suffix {PYTHON_FAST} runs a local file's fast path in "
                             f"Python, {FAST_NATIVE_ENV}=0)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="each row's thread models served by this checkout too "
                             "(its extensions built in place), in the same rounds")
    args = parser.parse_args(argv[1:])
    models = args.thread_models.split(",")
    disk_models = args.disk_models.split(",")
    if args.baseline is not None:
        global baseline_dir
        if not (args.baseline / "nbd_verity").is_dir():
            parser.error(f"--baseline {args.baseline}: not a checkout (no nbd_verity/ in it)")
        baseline_dir = args.baseline.resolve()
        models += [model + BASELINE for model in models]
        disk_models += [model + BASELINE for model in disk_models]
    image = images.random_image(SIZE)
    rows = []
    for delay in filter(None, args.delays.split(",")):
        rows += measure_delay(image, delay, args.rounds, args.runtime, models)
    if args.http:
        rows += measure_http(image, args.http, args.rounds, args.runtime)
    if args.disk:
        rows += measure_disk(args.rounds, args.runtime, disk_models)
    print(f"{report.machine()}; load {report.load()}; {args.rounds} rounds of "
          f"{args.runtime:g} s")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
