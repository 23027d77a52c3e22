"""`make bench`: nbd-verity side by side with its ceilings, in one run on one image.

Sections (BENCH_SECTIONS=main,readahead,scaling,knobs,hotpath picks some; the doc is only
rewritten by a full, non-quick run):
  main       fio --ioengine=nbd over Unix sockets against nbdkit's C file plugin, the
             Python pass-through plugin and nbd-verity with every request inline, every
             request in the pool and the default table: 8 synchronous jobs of 4 KiB random
             and of 512 KiB sequential reads, then a random-read block-size sweep; plus
             `openssl dgst -sha256` and `veritysetup verify` of the same file.
  readahead  sequential reads with and without Merkle readahead: hash-image reads per MiB.
  scaling    start-up time and RSS against the data image size (sparse 1 GiB, 64 GiB, 1 TiB).
  knobs      throughput against the pool size (--workers) and nbdkit --threads, and with
             all requests serialised (nbdkit's noparallel filter): the cost of the GIL.
  threads    nbd-verity under each nbdkit thread model (serialize-requests, the default;
             serialize-all-requests; parallel), 3 interleaved rounds: median and range.
  hotpath    microseconds per request of the server's read path without nbdkit
             (bench/hotpath.py): bookkeeping and pool hand-off, separated from I/O and hashing.
Environment: BENCH_RUNTIME seconds per fio run (default 10), BENCH_QUICK=1 for a smoke
run (small image, 1 s runs), BENCH_CACHE for the image directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import hotpath  # noqa: E402
import images  # noqa: E402
import report  # noqa: E402
import servers  # noqa: E402
from fiorun import Job, Result  # noqa: E402

SECTIONS = ("main", "readahead", "scaling", "knobs", "threads", "hotpath")
THREAD_MODELS = ("serialize-requests", "serialize-all-requests", "parallel")
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SWEEP_SIZES = [4 * KIB << i for i in range(8)]  # 4k .. 512k
INLINE = "nbd-verity, all inline"
POOL = "nbd-verity, all pool"
DEFAULT = "nbd-verity, default table"


@dataclass
class Settings:
    runtime: float
    quick: bool
    sections: tuple[str, ...]
    image_size: int = GIB
    sweep_sizes: list[int] = field(default_factory=lambda: list(SWEEP_SIZES))
    scaling: list[tuple[int, bool]] = field(default_factory=list)  # (size, formatted)

    @classmethod
    def from_env(cls) -> Settings:
        quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
        runtime = float(os.environ.get("BENCH_RUNTIME", "1" if quick else "10"))
        sections = tuple(s for s in os.environ.get("BENCH_SECTIONS", ",".join(SECTIONS))
                         .split(",") if s)
        unknown = set(sections) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"bench: BENCH_SECTIONS: unknown {', '.join(sorted(unknown))}")
        settings = cls(runtime, quick, sections)
        if quick:
            settings.image_size = 256 * MIB
            settings.sweep_sizes = [4 * KIB, 64 * KIB, 512 * KIB]
            settings.scaling = [(256 * MIB, True), (16 * GIB, False)]
        else:
            settings.scaling = [(GIB, True), (64 * GIB, True), (1 << 40, False)]
        return settings

    def describe(self) -> str:
        size = f"{self.image_size >> 20} MiB" if self.image_size < GIB else (
            f"{self.image_size >> 30} GiB")
        return f"{size} random image, {self.runtime:g} s per fio run"


def command() -> str:
    """The command as it was run: make's target or the script, with the BENCH_* settings."""
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("BENCH_"))
    run = "make bench" if os.environ.get("MAKELEVEL") else ".venv/bin/python bench/run.py"
    return f"{env} {run}".strip()


def say(message: str) -> None:
    print(f"bench: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def ensure_matplotlib() -> None:
    """Install matplotlib into this venv if it is missing (plots only)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        say("installing matplotlib into the venv (pip install matplotlib)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=True)


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def prefill(server: servers.Server, size: int) -> None:
    """NBD_CMD_CACHE over the whole device: nbd-verity verifies and caches its hash blocks
    first, so every row starts warm (the data is in the page cache already)."""
    import nbd
    h = nbd.NBD()
    h.connect_uri(server.uri())
    for offset in range(0, size, 32 * MIB):
        h.cache(min(32 * MIB, size - offset), offset)
    h.shutdown()


# -- sections -------------------------------------------------------------------------


def run_main(cfg: Settings, image: images.Image, out: dict) -> None:
    """All five servers alive at once; each workload runs on each in turn."""
    rand = Job("randread", 4 * KIB, 8, 1, cfg.runtime)
    seq = Job("read", 512 * KIB, 8, 1, cfg.runtime)
    sweep_job = lambda bs: Job("randread", bs, 4, 1, max(1.0, cfg.runtime / 2))  # noqa: E731
    group = [servers.file_server(image.data), servers.passthrough_server(image.data),
             servers.verity_server(INLINE, image, servers.inline_options()),
             servers.verity_server(POOL, image, servers.pool_options()),
             servers.verity_server(DEFAULT, image, [])]
    out["labels"] = (rand.label(), seq.label())
    out["main"] = {s.name: {} for s in group}
    out["sweep"] = {s.name: {} for s in group}
    try:
        for server in group:
            server.start()
            if server.kind == "verity":
                prefill(server, image.size)
        for job in (rand, seq):
            for server in group:
                say(f"{server.name}: {job.label()}")
                out["main"][server.name][job.label()] = fiorun.run(server.uri(), job, image.size)
        for bs in cfg.sweep_sizes:
            for server in group:
                say(f"{server.name}: sweep {fiorun.size_label(bs)}")
                out["sweep"][server.name][bs] = fiorun.run(server.uri(), sweep_job(bs),
                                                           image.size)
        out["sweep_label"] = f"{sweep_job(0).numjobs} jobs x QD1"
    finally:
        for server in group:
            server.stop()
    say("openssl dgst -sha256, veritysetup verify")
    out["tools"] = {
        "openssl dgst -sha256": image.size / timed(["openssl", "dgst", "-sha256",
                                                    str(image.data)]) / 1e6,
        "veritysetup verify": image.size / timed(["veritysetup", "verify", str(image.data),
                                                  str(image.hash), image.root]) / 1e6,
    }


def run_readahead(cfg: Settings, image: images.Image, out: dict) -> None:
    """A fresh server per run (cold hash-block cache); each job reads its own slice once,
    so every hash block it needs is read for the first time during the run."""
    rows = []
    for bs in (4 * KIB, 512 * KIB, 2 * MIB):
        job = Job("read", bs, 8, 1, cfg.runtime, time_based=False)
        for readahead in (False, True):
            options = ["--readahead" if readahead else "--no-readahead"]
            with servers.verity_server("readahead", image, options) as server:
                server.ctl({"cmd": "stats", "reset": True})
                say(f"readahead {'on' if readahead else 'off'}: {job.label()}")
                result = fiorun.run(server.uri(), job, image.size)
                stats = server.ctl({"cmd": "stats"})["stats"]
            read = sum(p["bytes"] for c in stats["classes"].values() for p in c.values())
            totals = stats["totals"]
            rows.append({"workload": job.label(), "readahead": readahead, "result": result,
                         "mib": read / MIB, "hash_reads": totals["hash_reads"],
                         "hash_blocks_read": totals["hash_blocks_read"],
                         "readaheads": totals["readaheads"]})
    out["readahead"] = rows


def run_scaling(cfg: Settings, out: dict) -> None:
    """Start-up time (exec → socket accepts) and RSS against the image size."""
    out["checks"] = [images.check_zerotree()]
    rows = []
    job = Job("randread", 64 * KIB, 1, 8, 300, time_based=False, io_size=GIB)
    for size, formatted in cfg.scaling:
        say(f"scaling: {size >> 20} MiB sparse image ({'format' if formatted else 'zerotree'})")
        image = images.sparse_image(size, formatted)
        if formatted and size >= 16 * GIB:
            out["checks"].append(images.check_same_root(image))
        startups = []
        for attempt in range(3):
            server = servers.verity_server("scaling", image, []).start()
            startups.append(server.startup_s)
            if attempt < 2:
                server.stop()
        try:
            rss_idle = server.rss_kib()
            result = fiorun.run(server.uri(), job, image.size)
            rss_after = server.rss_kib()
        finally:
            server.stop()
        rows.append({"image": _size_text(size), "how": image.how, "levels": _levels(size),
                     "startup": sorted(startups), "rss_idle": rss_idle,
                     "rss_after": rss_after, "result": result})
    big = images.sparse_image(*cfg.scaling[-1])
    base = []
    for _ in range(3):
        with servers.file_server(big.data) as server:
            base.append(server.startup_s)
    rows.append({"image": _size_text(big.size), "how": "(nbdkit file plugin, no tree)",
                 "startup": sorted(base)})
    out["scaling"] = rows


def _levels(size: int) -> int:
    from nbd_verity.format.params import VerityParams
    return VerityParams(data_blocks=size // 4096).geometry().levels


def _size_text(size: int) -> str:
    return f"{size >> 40} TiB" if size >= 1 << 40 else (
        f"{size >> 30} GiB" if size >= GIB else f"{size >> 20} MiB")


def run_knobs(cfg: Settings, image: images.Image, out: dict) -> None:
    """--workers with every request in the pool; nbdkit --threads with the default table
    (threads are per connection: one connection with 16 requests in flight uses them)."""
    runtime = max(1.0, cfg.runtime / 2)
    worker_jobs = [Job("randread", 512 * KIB, 1, 1, runtime),
                   Job("randread", 512 * KIB, 8, 1, runtime)]
    thread_jobs = [Job("randread", 4 * KIB, 1, 16, runtime),
                   Job("randread", 512 * KIB, 1, 16, runtime)]
    out["workers"], out["threads"] = [], []
    for workers in (1, 2, 4):
        options = [*servers.pool_options(), f"--workers={workers}"]
        with servers.verity_server("workers", image, options) as server:
            prefill(server, image.size)
            for job in worker_jobs:
                say(f"--workers={workers}: {job.label()}")
                out["workers"].append((workers, job.label(),
                                       fiorun.run(server.uri(), job, image.size)))
    for threads in (1, 2, 4, 16):
        with servers.verity_server("threads", image, [], threads=threads) as server:
            prefill(server, image.size)
            for job in thread_jobs:
                say(f"--threads={threads}: {job.label()}")
                out["threads"].append((threads, job.label(),
                                       fiorun.run(server.uri(), job, image.size)))
    out["serialize"] = run_serialize(image, runtime)


def run_serialize(image: images.Image, runtime: float) -> list[tuple[str, str, Result]]:
    """Each Python server as nbdkit runs it (parallel) and with every request serialised
    by nbdkit's noparallel filter: only one thread in Python at a time, no GIL contention
    (and no parallel hashing either)."""
    jobs = [Job("randread", 4 * KIB, 8, 1, runtime), Job("read", 512 * KIB, 8, 1, runtime)]
    inline = [f"threshold={c}={servers.ALL_INLINE}" for c in ("none", "rt", "be", "idle")]
    serial = ("noparallel",)
    rows = []
    for label, make in (
            ("Python pass-through", lambda f, k: servers.passthrough_server(image.data,
                                                                            filters=f, keys=k)),
            (DEFAULT, lambda f, k: servers.plugin_server(DEFAULT, image, k, f)),
            (INLINE, lambda f, k: servers.plugin_server(INLINE, image, [*inline, *k], f))):
        for name, filters, keys in (("the plugin's own thread model", (), ()),
                                    ("serialize=all-requests", serial,
                                     ("serialize=all-requests",))):
            with make(filters, list(keys)) as server:
                if server.kind == "plugin":
                    prefill(server, image.size)
                for job in jobs:
                    say(f"{label}, {name}: {job.label()}")
                    rows.append((f"{label}, {name}", job.label(),
                                 fiorun.run(server.uri(), job, image.size)))
    return rows


def run_thread_models(image: images.Image, runtime: float, rounds: int = 3) -> list[dict]:
    """The default table under each thread model, all servers alive at once and the rounds
    interleaved, so that a noisy minute on this shared machine hits every model."""
    jobs = [Job("randread", 4 * KIB, 8, 1, runtime), Job("read", 512 * KIB, 8, 1, runtime),
            Job("randread", 64 * KIB, 1, 8, runtime)]
    group = {model: servers.plugin_server(model, image, [f"thread-model={model}"])
             for model in THREAD_MODELS}
    results: dict = {(m, j.label()): [] for m in THREAD_MODELS for j in jobs}
    try:
        for server in group.values():
            server.start()
            prefill(server, image.size)
        for round_number in range(rounds):
            for job in jobs:
                for model, server in group.items():
                    say(f"thread model {model}, round {round_number + 1}: {job.label()}")
                    results[(model, job.label())].append(
                        fiorun.run(server.uri(), job, image.size).mb_s)
    finally:
        for server in group.values():
            server.stop()
    return [{"model": m, "job": j, "mb_s": sorted(v)} for (m, j), v in results.items()]


def thread_model_table(rows: list[dict]) -> str:
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    by = {(r["model"], r["job"]): r["mb_s"] for r in rows}
    header = ["thread model", *[f"{job} MB/s median (min-max)" for job in jobs]]
    body = []
    for model in THREAD_MODELS:
        cells = []
        for job in jobs:
            v = by[(model, job)]
            cells.append(f"{v[len(v) // 2]:.0f} ({v[0]:.0f}-{v[-1]:.0f})")
        body.append([model, *cells])
    return report.table(header, body)


# -- report ---------------------------------------------------------------------------


def render(cfg: Settings, out: dict, image: images.Image, load_before: str,
           load_after: str) -> str:
    parts = ["## Side by side", "",
             report.header(command(), cfg.describe(), load_before, load_after), "",
             f"Image: {image.size >> 20} MiB of random data, its tree by `nbd-verity format` "
             "(4096/4096, sha256), in the page cache; the nbd-verity servers' hash-block "
             "caches are filled (NBD_CMD_CACHE) before the first run. fio 3.33 "
             "`--ioengine=nbd` over Unix sockets, every server with nbdkit's default 16 "
             "threads per connection.", ""]
    if "main" in out:
        parts += [report.main_table(out["main"], out["tools"], out["labels"],
                                    "nbdkit file (C)", "Python pass-through"), "",
                  "![side by side](benchmarks-main.png)", "",
                  f"### Request-size sweep ({out['sweep_label']}, random reads)", "",
                  report.sweep_table(out["sweep"], "Python pass-through", DEFAULT), "",
                  "![sweep](benchmarks-sweep.png)", ""]
    if "readahead" in out:
        parts += ["## Merkle readahead", "",
                  "A fresh server per row (cold hash-block cache); each of the 8 jobs reads "
                  "its own eighth of the image once, sequentially (stopped after the run "
                  "time). Hash reads are `hash_reads` of `nbd-verity ctl stats` (read calls "
                  "on the hash image), per MiB served.", "",
                  report.readahead_table(out["readahead"]), ""]
    if "scaling" in out:
        parts += ["## Start-up and memory against the image size", "",
                  "Sparse all-zero data images (`truncate -s`). Start-up is the time from "
                  "exec of `nbd-verity serve` to its socket accepting a connection (3 starts); "
                  "RSS is VmRSS of the server (nbdkit) before and after reading 1 GiB at "
                  "random 64 KiB offsets (1 job, 8 requests in flight), default 64 MiB "
                  "level-0 cache.", "",
                  report.scaling_table(out["scaling"]), "",
                  *[f"- {check}" for check in out["checks"]], ""]
    if "workers" in out:
        parts += ["## Pool size and nbdkit threads", "",
                  "`--workers N` with every request in the pool (thresholds 0):", "",
                  report.knob_table("--workers", out["workers"]), "",
                  "nbdkit `--threads N` (threads per connection) with the default table:", "",
                  report.knob_table("--threads", out["threads"]), "",
                  "Every request serialised by nbdkit's noparallel filter "
                  "(`--filter=noparallel serialize=all-requests`: one request in Python at a "
                  "time, so no thread waits for the GIL) against nbdkit's parallel default:",
                  "", report.knob_table("server, thread model", out["serialize"]), ""]
    if "models" in out:
        parts += ["## Thread models", "",
                  "nbd-verity (default table) under each nbdkit thread model, the three "
                  "servers alive at once, 3 interleaved rounds per workload (median, and "
                  "the range over the rounds). `serialize-requests` is the default: "
                  "nbdkit 1.32's `parallel` can be aborted by a client (server.md, "
                  "\"Limits and guarantees\").", "",
                  thread_model_table(out["models"]), ""]
    if "hotpath" in out:
        parts += ["## The read path without nbdkit", "",
                  "`bench/hotpath.py`: the Device nbdkit would build, called from one thread "
                  "of the bench process (no sockets, no GIL contention), random reads of the "
                  "cached image, readahead off. Inline bookkeeping is what the server adds to "
                  "preadv and SHA-256 (split, cache look-ups, counters, stats); the pool "
                  "hand-off is pool minus inline.", "", out["hotpath"], ""]
    return "\n".join(parts)


def main() -> int:
    cfg = Settings.from_env()
    ensure_matplotlib()
    load_before = report.load()
    if os.getloadavg()[0] > 1.5:
        say(f"warning: load average {load_before}: other work will skew the figures")
    say(f"image: {cfg.image_size >> 20} MiB in {images.CACHE}")
    image = images.random_image(cfg.image_size)
    images.warm(image.data)
    images.warm(image.hash)
    out: dict = {}
    started = time.monotonic()
    if "main" in cfg.sections:
        run_main(cfg, image, out)
    if "readahead" in cfg.sections:
        run_readahead(cfg, image, out)
    if "scaling" in cfg.sections:
        run_scaling(cfg, out)
    if "knobs" in cfg.sections:
        run_knobs(cfg, image, out)
    if "threads" in cfg.sections:
        out["models"] = run_thread_models(image, max(1.0, cfg.runtime / 2))
    if "hotpath" in cfg.sections:
        say("hot path without nbdkit (bench/hotpath.py)")
        out["hotpath"] = hotpath.table(hotpath.measure(str(image.data), str(image.hash),
                                                       image.root))
    text = render(cfg, out, image, load_before, report.load())
    print(text)
    say(f"done in {time.monotonic() - started:.0f} s")
    if cfg.quick or set(cfg.sections) != set(SECTIONS):
        say("quick or partial run: docs/benchmarks.md left as it is")
        return 0
    report.plot_main(report.DOCS / "benchmarks-main.png", out["main"], out["tools"],
                     out["labels"])
    report.plot_sweep(report.DOCS / "benchmarks-sweep.png", out["sweep"],
                      f"Random reads, {out['sweep_label']}")
    say(f"wrote {report.write_doc(text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
