"""`make bench-format`: nbd-verity format/verify against veritysetup, side by side.

Both tools build and check the tree of the same random image (1 GiB by default) with the
same salt and UUID; runs alternate between the tools so that a background load hits both
alike, each run writes a fresh hash image, and the median wall time of each is reported
with the ratio ours/theirs (below 1: we are faster). The image is kept in --dir and
reused; it is read once before timing so that both tools read it from the page cache.
The table goes to stdout and into the "Format and verify" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = str(Path(sys.executable).parent / "nbd-verity")
THEIRS = "/usr/sbin/veritysetup"
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "## Format and verify"
SALT = "e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d"
UUID = "a60c98d2-ae9b-4865-bfcb-b4e3ace11033"


QUIET = 0.10  # a round starts once other processes use less than this share of the CPUs


@dataclass
class Timing:
    """Wall and CPU (user + system, all threads and worker processes) seconds of one
    command, and the share of the machine's CPU time that other processes used meanwhile."""

    wall: float
    cpu: float
    others: float = 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def run_timed(argv: list[str]) -> tuple[Timing, str]:
    """Run argv; return its timing and stdout; stop the benchmark if it fails."""
    before, machine_before = resource.getrusage(resource.RUSAGE_CHILDREN), machine_cpu()
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after, machine_after = resource.getrusage(resource.RUSAGE_CHILDREN), machine_cpu()
    if done.returncode != 0:
        sys.exit(f"bench: {shlex.join(argv)} failed ({done.returncode}): {done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    busy = machine_after[0] - machine_before[0]
    total = machine_after[1] - machine_before[1]
    return Timing(wall, cpu, max(0.0, busy - cpu) / total if total else 0.0), done.stdout


def wait_until_quiet(limit: float) -> float:
    """Wait (at most limit seconds) until other processes leave the CPUs nearly idle;
    return the busy share seen last, so that a noisy run can be told apart."""
    deadline = time.monotonic() + limit
    while True:
        busy0, total0 = machine_cpu()
        time.sleep(1.0)
        busy1, total1 = machine_cpu()
        share = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        if share < QUIET or time.monotonic() >= deadline:
            return share
        time.sleep(4.0)


def root_hash(stdout: str) -> str:
    return next(line.split()[-1] for line in stdout.splitlines()
                if line.startswith("Root hash:"))


def prepare_image(directory: Path, size_mib: int) -> Path:
    """A random image of size_mib MiB, made once and reused; then read into the cache."""
    directory.mkdir(parents=True, exist_ok=True)
    image = directory / f"format-{size_mib}m.img"
    if not image.exists() or image.stat().st_size != size_mib << 20:
        print(f"creating {image} ({size_mib} MiB of random data)...", flush=True)
        with open(image.with_suffix(".tmp"), "wb") as f:
            for _ in range(size_mib):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())  # no writeback of it may overlap a timed run
        image.with_suffix(".tmp").rename(image)
    return image


def warm_cache(image: Path) -> None:
    """Read the image so that both tools read it from the page cache (other work on a
    shared machine evicts it between rounds)."""
    with open(image, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def one_round(image: Path, work: Path, order: list[tuple[str, str]]) -> dict:
    """Format then verify with each tool in order; {op: {tool: Timing}}."""
    timings: dict = {"format": {}, "verify": {}}
    roots = {}
    for name, exe in order:
        hash_image = work / f"{name}.hash"
        hash_image.unlink(missing_ok=True)  # neither tool truncates an existing one
        timings["format"][name], out = run_timed(
            [exe, "format", str(image), str(hash_image), f"--salt={SALT}", f"--uuid={UUID}"])
        roots[name] = root_hash(out)
    if roots["nbd-verity"] != roots["veritysetup"]:
        sys.exit(f"bench: the root hashes differ: {roots}")
    if (work / "nbd-verity.hash").read_bytes() != (work / "veritysetup.hash").read_bytes():
        sys.exit("bench: the hash images differ")
    for name, exe in order:
        timings["verify"][name], _ = run_timed(
            [exe, "verify", str(image), str(work / f"{name}.hash"), roots[name]])
    return timings


def bench(image: Path, work: Path, reps: int, quiet_wait: float) -> tuple[dict, int]:
    """Alternate ours and theirs, format then verify, until reps rounds ran undisturbed.

    The machine is shared: each round first waits for other processes to go quiet, and a
    round during which they took more than twice QUIET of the CPUs is run again (at most
    2 * reps times in all). Returns {op: {tool: [Timing]}} and the rounds run again.
    """
    results: dict = {op: {"nbd-verity": [], "veritysetup": []} for op in ("format", "verify")}
    tools = [("nbd-verity", OURS), ("veritysetup", THEIRS)]
    warm_cache(image)
    one_round(image, work, tools)  # warm-up (imports, caches): not counted
    kept = redone = 0
    while kept < reps:
        warm_cache(image)
        wait_until_quiet(quiet_wait)
        order = tools if kept % 2 == 0 else tools[::-1]
        timings = one_round(image, work, order)
        noisy = max(t.others for by_tool in timings.values() for t in by_tool.values())
        if noisy > 2 * QUIET and redone < 2 * reps:
            redone += 1
            continue
        for op, by_tool in timings.items():
            for name, timing in by_tool.items():
                results[op][name].append(timing)
        kept += 1
    return results, redone


SWEEP = [  # (window MiB, hashing processes); the first row is the default here
    (32, 2), (32, 1), (32, 3), (32, 4), (4, 2), (8, 2), (16, 2), (64, 2), (128, 2),
]
SWEEP_SECTION = "## Builder tuning"
THREAD_POOL_NOTE = (  # measured once, before the thread pool was replaced: not re-run here
    "Before the forked workers, a pool of two threads hashed 4 MiB tasks of each 32 MiB "
    "window: 0.55 s wall (median of 5; best 0.49 s) and 0.95 s CPU for the same work, "
    "against 0.42 s and 0.82 s for two processes in the same session (2026-11-30). Each "
    "4 KiB block costs about 0.5 µs of Python with the GIL held besides the 2.3 µs SHA-256 "
    "that runs without it; with threads the GIL changes hands about 250 000 times per GiB.")


def sweep(image: Path, reps: int, quiet_wait: float) -> str:
    """Time level-0 hashing (builder.data_slot_chunks: no start-up, no writes) for each
    SWEEP row."""
    sys.path.insert(0, str(REPO))
    from nbd_verity.format import builder
    from nbd_verity.format.params import VerityParams
    from nbd_verity.sources.source import ImageFile

    size = image.stat().st_size
    params = VerityParams(data_blocks=size // 4096, salt=bytes.fromhex(SALT)).check()
    geo, digester = params.geometry(), params.digester()
    default = builder.WINDOW_SIZE
    times: dict[tuple, list[Timing]] = {row: [] for row in SWEEP}
    data = ImageFile(str(image), "data")
    try:
        for _ in range(reps):
            for row in SWEEP:
                warm_cache(image)
                wait_until_quiet(quiet_wait)
                builder.WINDOW_SIZE = row[0] << 20
                cpu0, start = own_and_children_cpu(), time.perf_counter()
                for _ in builder.data_slot_chunks(data, geo, digester, workers=row[1]):
                    pass
                times[row].append(Timing(time.perf_counter() - start,
                                         own_and_children_cpu() - cpu0))
    finally:
        data.close()
        builder.WINDOW_SIZE = default
    lines = ["| window MiB | processes | wall s (median) | wall s (min) | CPU s | GB/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row, timings in times.items():
        wall = statistics.median(t.wall for t in timings)
        lines.append(f"| {row[0]} | {row[1]} | {wall:.3f} "
                     f"| {min(t.wall for t in timings):.3f} "
                     f"| {statistics.median(t.cpu for t in timings):.2f} "
                     f"| {size / wall / 1e9:.2f} |")
    return "\n".join(lines)


def own_and_children_cpu() -> float:
    """CPU seconds of this process and of its waited-for children (the workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def versions() -> str:
    theirs = subprocess.run([THEIRS, "--version"], capture_output=True, text=True,
                            check=False).stdout.strip()
    return f"{theirs}; Python {platform.python_version()}"


def table(results, size_mib: int) -> str:
    """A Markdown table: median wall (and CPU) seconds, throughput and ratio per operation."""
    lines = ["| operation | nbd-verity wall s | veritysetup wall s | ratio (ours/theirs) "
             "| nbd-verity GB/s | nbd-verity CPU s | veritysetup CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for op, by_tool in results.items():
        ours = statistics.median(t.wall for t in by_tool["nbd-verity"])
        theirs = statistics.median(t.wall for t in by_tool["veritysetup"])
        our_cpu = statistics.median(t.cpu for t in by_tool["nbd-verity"])
        their_cpu = statistics.median(t.cpu for t in by_tool["veritysetup"])
        rate = (size_mib << 20) / ours / 1e9
        lines.append(f"| {op} | {ours:.3f} | {theirs:.3f} | **{ours / theirs:.2f}** "
                     f"| {rate:.2f} | {our_cpu:.2f} | {their_cpu:.2f} |")
    return "\n".join(lines)


def spreads(results) -> list[str]:
    """'op tool min-max' of the wall seconds of each operation and tool."""
    spread = []
    for op, by_tool in results.items():
        for name, timings in by_tool.items():
            walls = sorted(t.wall for t in timings)
            spread.append(f"{op} {name} {walls[0]:.3f}-{walls[-1]:.3f}")
    return spread


def section(results, size_mib: int, reps: int, command: str, loads: tuple,
            redone: int) -> str:
    spread = spreads(results)
    others = [t.others for by_tool in results.values() for ts in by_tool.values() for t in ts]
    return "\n".join([
        SECTION,
        "",
        f"`nbd-verity format` and `verify` against `veritysetup format` and `verify` of the "
        f"same {size_mib} MiB random image (in the page cache), same salt and UUID, fresh "
        f"hash image per run; median of {reps} alternating runs after one warm-up round. "
        "Wall time includes process start-up. CPU is user + system time of all threads "
        "and processes.",
        "",
        table(results, size_mib),
        "",
        f"- Machine: {cpu_model()}, {os.cpu_count()} logical CPUs; {versions()}.",
        f"- 1-minute load average before and after the run: {loads[0][0]:.2f}, "
        f"{loads[1][0]:.2f} (the machine is shared; other work inflates both tools' times, "
        "ours more, as it needs both CPUs).",
        f"- Range (min-max wall s): {'; '.join(spread)}.",
        f"- Other processes used {100 * statistics.median(others):.0f}% (median; at most "
        f"{100 * max(others):.0f}%) of the machine's CPU time during the timed runs; each "
        f"round first waited for them to use less than {100 * QUIET:.0f}%, and {redone} "
        f"round(s) during which they used more than {200 * QUIET:.0f}% were run again.",
        f"- Measured {time.strftime('%Y-%m-%d %H:%M %Z')} with: `{command}`",
        "",
    ])


def update_doc(heading: str, text: str) -> None:
    """Replace a section of docs/benchmarks.md, or append it.

    A section runs from its heading to the next '## ' heading or the next '<!--' marker
    (bench/run.py keeps its own part between two marker comments), or to the end.
    """
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n\n"
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        ends = [i for i in (old.find("\n## ", start + len(heading)),
                            old.find("\n<!--", start + len(heading))) if i >= 0]
        rest = old[min(ends) + 1:] if ends else ""
        new = old[:start] + text.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="image size (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per tool")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/nbd-verity-bench-format"),
                        help="where the image is kept between runs")
    parser.add_argument("--no-doc", action="store_true", help="do not update the docs")
    parser.add_argument("--quiet-wait", type=float, default=300,
                        help="seconds a round may wait for other processes to go quiet")
    parser.add_argument("--sweep", action="store_true",
                        help="instead, time level-0 hashing per window size and number "
                             "of hashing processes")
    args = parser.parse_args()
    command = "make bench-format" if len(sys.argv) == 1 else (
        ".venv/bin/python bench/format.py " + shlex.join(sys.argv[1:]))
    image = prepare_image(args.dir, args.size_mib)
    work = args.dir / "work"
    work.mkdir(exist_ok=True)
    load = os.getloadavg()
    engine = subprocess.run([OURS, "--version"], capture_output=True, text=True,
                            check=False).stdout.strip().splitlines()[-1:]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; load {load[0]:.2f}; image {image}; "
          f"{''.join(engine)}", flush=True)
    if args.sweep:
        found = sweep(image, args.reps, args.quiet_wait)
        after = os.getloadavg()[0]
        print(found)
        print(f"load average before {load[0]:.2f}, after {after:.2f}")
        if not args.no_doc:
            update_doc(SWEEP_SECTION, "\n".join([
                SWEEP_SECTION, "",
                f"Level-0 hashing of the same {args.size_mib} MiB image "
                "(`builder.data_slot_chunks`: no start-up, no writes), per mapped window "
                "size and number of hashing processes (this one and forked workers); "
                "CPU includes the workers; median of "
                f"{args.reps} alternating runs, each after waiting for other processes to use "
                f"less than {100 * QUIET:.0f}% of the CPUs. {cpu_model()}, "
                f"{os.cpu_count()} logical "
                f"CPUs; 1-minute load average {load[0]:.2f} before, {after:.2f} after.",
                "", found, "", THREAD_POOL_NOTE, "",
                f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} with: `{command}`", ""]))
            print(f"\nupdated {DOC.relative_to(REPO)}")
        return
    results, redone = bench(image, work, args.reps, args.quiet_wait)
    loads = (load, os.getloadavg())
    text = section(results, args.size_mib, args.reps, command, loads, redone)
    print()
    print(table(results, args.size_mib))
    print(f"range (min-max wall s): {'; '.join(spreads(results))}")
    print(f"load average before {loads[0][0]:.2f}, after {loads[1][0]:.2f}")
    others = [t.others for by_tool in results.values() for ts in by_tool.values() for t in ts]
    print(f"other processes' share of the CPUs during the runs: median "
          f"{100 * statistics.median(others):.0f}%, max {100 * max(others):.0f}%; "
          f"{redone} disturbed round(s) run again")
    for name in ("nbd-verity", "veritysetup"):
        (work / f"{name}.hash").unlink(missing_ok=True)
    if not args.no_doc:
        update_doc(SECTION, text)
        print(f"\nupdated {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
