"""Merkle readahead where latency is real: the hash image behind nbdkit's delay filter.

The verifying server reads its data image from a local file (in the page cache) and its
hash image from an NBD upstream (nbdkit's `file` plugin under `--filter=delay rdelay=1ms`:
every hash read waits 1 ms, as a remote object store or a network disk would make it), or,
for comparison, from the local hash file in the page cache. Each run starts a fresh
server (cold hash-block cache) and reads the device once sequentially (1 job, QD1, fio's
nbd engine) at 4 KiB, 64 KiB and 512 KiB, with readahead off and on. Reported: MB/s
(median and range of --reps runs), and hash reads (`hash_reads`: read calls on the hash
image) per MiB served. A second table calls the Device in this process from one thread
(no nbdkit, no fio, every request inline) over the whole image: the same comparison with
far less noise from a shared machine.

    .venv/bin/python bench/latency.py [--reps 3] [--runtime 5] [--write]

--write replaces the "Readahead with latency" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import report  # noqa: E402
import servers  # noqa: E402
from fiorun import Job  # noqa: E402

MIB = 1 << 20
SIZES = (4 << 10, 64 << 10, 512 << 10)
DELAY = "1ms"
HEADING = "## Readahead with latency"


def delayed_hash_server(image: images.Image) -> servers.Server:
    """The hash image behind nbdkit's delay filter, on a Unix socket."""
    return servers.Server(f"hash image, rdelay={DELAY}", "file",
                          [f"file={image.hash}", f"rdelay={DELAY}"], None, ("delay",))


def one_run(image: images.Image, hash_location: str, bs: int, readahead: bool,
            runtime: float) -> dict:
    """A fresh verifying server, one sequential pass; MB/s and hash reads per MiB."""
    options = ["--readahead" if readahead else "--no-readahead"]
    local = images.Image(image.data, hash_location, image.root, image.size, image.how)
    job = Job("read", bs, 1, 1, runtime, time_based=False)
    with servers.verity_server("latency", local, options) as server:
        result = fiorun.run(server.uri(), job, image.size)
        stats = server.ctl({"cmd": "stats"})["stats"]
    served = sum(p["bytes"] for c in stats["classes"].values() for p in c.values())
    totals = stats["totals"]
    return {"mb_s": result.mb_s, "mib": served / MIB, "hash_reads": totals["hash_reads"],
            "hash_blocks_read": totals["hash_blocks_read"],
            "hit_rate": hit_rate(totals)}


def measure(image: images.Image, reps: int, runtime: float) -> list[dict]:
    rows = []
    with delayed_hash_server(image) as upstream:
        sources = ((f"NBD, {DELAY} per read", upstream.uri()),
                   ("local file, page cache", str(image.hash)))
        for source, location in sources:
            for bs in SIZES:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(reps):
                    for readahead in (False, True):  # alternate: drift hits both alike
                        say(f"{source}: {fiorun.size_label(bs)} readahead "
                            f"{'on' if readahead else 'off'}")
                        runs[readahead].append(one_run(image, location, bs, readahead,
                                                       runtime))
                for readahead in (False, True):
                    rows.append(summary(source, bs, readahead, runs[readahead]))
    return rows


def inprocess_run(image: images.Image, hash_location: str, bs: int, readahead: bool) -> dict:
    """The Device nbdkit would build, read once sequentially from this thread (inline)."""
    from nbd_verity.prepare.config import config_from_pairs
    from nbd_verity.serve.device import Connection, Device
    device = Device(config_from_pairs([
        ("data", str(image.data)), ("hash", hash_location), ("root-hash", image.root),
        ("readahead", "true" if readahead else "false"),
        *[("threshold", f"{c}={servers.ALL_INLINE}") for c in ("none", "rt", "be", "idle")]]))
    try:
        connection, buf = Connection(device), memoryview(bytearray(bs))
        started = time.perf_counter()
        for offset in range(0, device.size, bs):
            device.dispatcher.read(buf, offset, connection)
        elapsed = time.perf_counter() - started
        totals = device.stats()["totals"]
    finally:
        device.close()
    return {"mb_s": device.size / elapsed / 1e6, "mib": device.size / MIB,
            "hash_reads": totals["hash_reads"], "hash_blocks_read": totals["hash_blocks_read"],
            "hit_rate": hit_rate(totals)}


def hit_rate(totals: dict) -> float:
    """Hash-block cache look-ups that found a verified block."""
    looked = totals["cache_hits"] + totals["cache_misses"]
    return totals["cache_hits"] / looked if looked else float("nan")


def measure_inprocess(image: images.Image, reps: int) -> list[dict]:
    rows = []
    with delayed_hash_server(image) as upstream:
        for source, location in ((f"NBD, {DELAY} per read", upstream.uri()),
                                 ("local file, page cache", str(image.hash))):
            for bs in SIZES:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(reps):
                    for readahead in (False, True):
                        runs[readahead].append(inprocess_run(image, location, bs, readahead))
                say(f"in process, {source}: {fiorun.size_label(bs)} done")
                rows += [summary(source, bs, ra, runs[ra]) for ra in (False, True)]
    return rows


def summary(source: str, bs: int, readahead: bool, runs: list[dict]) -> dict:
    speeds = sorted(r["mb_s"] for r in runs)
    median = runs[[r["mb_s"] for r in runs].index(statistics.median_low(speeds))]
    return {"source": source, "bs": bs, "readahead": readahead,
            "mb_s": statistics.median(speeds), "min": speeds[0], "max": speeds[-1],
            "reads_per_mib": median["hash_reads"] / max(median["mib"], 1e-9),
            "blocks_per_mib": median["hash_blocks_read"] / max(median["mib"], 1e-9),
            "mib": median["mib"], "hit_rate": median["hit_rate"]}


def table(rows: list[dict]) -> str:
    header = ["hash source", "request", "readahead", "MB/s (median)", "MB/s (min..max)",
              "on/off", "hash reads / MiB", "hash blocks read / MiB", "hash-cache hits",
              "MiB read"]
    off = {(r["source"], r["bs"]): r["mb_s"] for r in rows if not r["readahead"]}
    lines = []
    for r in rows:
        gain = report.ratio(r["mb_s"], off[(r["source"], r["bs"])]) if r["readahead"] else ""
        lines.append([r["source"], f"{fiorun.size_label(r['bs'])} sequential",
                      "on" if r["readahead"] else "off", f"{r['mb_s']:.1f}",
                      f"{r['min']:.1f}..{r['max']:.1f}", gain, f"{r['reads_per_mib']:.3f}",
                      f"{r['blocks_per_mib']:.3f}", f"{100 * r['hit_rate']:.2f}%",
                      f"{r['mib']:.0f}"])
    return report.table(header, lines)


def section(rows: list[dict], inprocess: list[dict], image: images.Image, reps: int,
            runtime: float, loads: tuple[str, str], command: str) -> str:
    return "\n".join([
        HEADING, "",
        f"`bench/latency.py`: {image.size >> 20} MiB random image; data from the local file "
        f"(page cache); hash image from an NBD upstream (nbdkit `file` under "
        f"`--filter=delay rdelay={DELAY}`), or from the local hash file for comparison. A "
        f"fresh server per run (cold hash-block cache); one sequential pass, 1 job x QD1, "
        f"at most {runtime:g} s; median of {reps} runs, readahead off and on alternating.",
        "", table(rows), "",
        f"The same without nbdkit and fio: the Device called from one thread of the bench "
        f"process, every request inline, one pass over the whole image; median of {reps} "
        f"runs.", "", table(inprocess), "",
        f"- {report.machine()}; load average {loads[0]} before, {loads[1]} after.",
        f"- Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with: `{command}`",
        ""])


def say(message: str) -> None:
    print(f"latency: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runtime", type=float, default=5.0, help="seconds per run, at most")
    parser.add_argument("--size-mib", type=int, default=256, help="image size (MiB)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    image = images.random_image(args.size_mib * MIB)
    images.warm(image.data)
    images.warm(image.hash)
    before = report.load()
    rows = measure(image, args.reps, args.runtime)
    inprocess = measure_inprocess(image, args.reps)
    command = " ".join([".venv/bin/python bench/latency.py", *sys.argv[1:]])
    loads = (before, report.load())
    text = section(rows, inprocess, image, args.reps, args.runtime, loads, command)
    print(text)
    if args.write:
        import format as format_bench  # bench/format.py owns the doc's section rewriting
        format_bench.update_doc(HEADING, text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
