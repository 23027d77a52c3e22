"""SHA-256 of 4 KiB blocks on one core, MB/s by method: OpenSSL's EVP against SHA-NI x1-x3.

Builds bench/sha256x_bench.c with nbd_verity/format/sha256x.c and libcrypto and runs
it pinned to one CPU, RUNS times; then times the native engine as Python calls it
(Hasher.slots over a 1 MiB run, lanes 0 = EVP, 1-3 = SHA-NI streams). Within a run the
methods take turns in slices of SLICE seconds for ROUNDS rounds and each reports the
median of its slices (a burst of other work on the shared machine hits a slice, not a
method). Prints the median of the runs and their min-max, the ratios to EVP with a new
context per block, and the 1-minute load average before and after.
Usage: python bench/sha256x.py [RUNS [SLICE [ROUNDS [CPU]]]]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nbd_verity.format import digest  # noqa: E402

BLOCK_SIZE, BLOCKS, SALT_SIZE = 4096, 256, 32  # 1 MiB of blocks; veritysetup's salt size


def build(directory: Path) -> Path:
    exe = directory / "sha256x_bench"
    fmt = REPO / "nbd_verity" / "format"
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", f"-I{fmt}", "-o", str(exe),
                    str(REPO / "bench" / "sha256x_bench.c"), str(fmt / "sha256x.c"),
                    "-lcrypto"], check=True)
    return exe


def c_run(exe: Path, seconds: float, rounds: int, cpu: int) -> dict[str, float]:
    out = subprocess.run(["taskset", "-c", str(cpu), str(exe), str(seconds), str(rounds),
                          str(BLOCK_SIZE), str(BLOCKS), str(SALT_SIZE)],
                         capture_output=True, text=True, check=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())
            if rate != "-"}


def engine_run(seconds: float, rounds: int) -> dict[str, float]:
    """The native Hasher as the builder and the verifier call it, per lanes setting:
    the median of its slices."""
    native = digest._native
    data, salt = os.urandom(BLOCK_SIZE * BLOCKS), os.urandom(SALT_SIZE)
    top = native.SHA256_MAX_LANES if native.sha256_default_lanes() else 0
    hashers = {f"engine {'evp' if lanes == 0 else f'x{lanes}'}":
               native.Hasher("sha256", salt, 1, lanes=lanes) for lanes in range(top + 1)}
    slices: dict[str, list[float]] = {name: [] for name in hashers}
    for _ in range(rounds):
        for name, hasher in hashers.items():
            hasher.slots(data, BLOCK_SIZE)
            calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                hasher.slots(data, BLOCK_SIZE)
                calls += 1
            slices[name].append(calls * len(data) / elapsed / 1e6)
    return {name: statistics.median(rates) for name, rates in slices.items()}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    cpu = int(sys.argv[4]) if len(sys.argv) > 4 else os.cpu_count() - 1
    load_before = os.getloadavg()[0]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for _ in range(runs):
            for name, rate in c_run(exe, seconds, rounds, cpu).items():
                results.setdefault(name, []).append(rate)
            os.sched_setaffinity(0, {cpu})
            for name, rate in engine_run(seconds, rounds).items():
                results.setdefault(name, []).append(rate)
    load_after = os.getloadavg()[0]
    base = statistics.median(results["evp-new"])
    reuse = statistics.median(results["evp-reuse"])
    print(f"SHA-256 of {BLOCK_SIZE}-byte blocks, {SALT_SIZE}-byte salt first, one core "
          f"(CPU {cpu}); {runs} runs, each the median of {rounds} slices of {seconds:g} s "
          f"per method; engine: {digest.engine_name()}")
    print("| method | MB/s median | min-max | x evp-new | x evp-reuse |")
    print("|---|---:|---:|---:|---:|")
    for name, rates in results.items():
        med = statistics.median(rates)
        print(f"| {name} | {med:.0f} | {min(rates):.0f}-{max(rates):.0f} "
              f"| {med / base:.2f} | {med / reuse:.2f} |")
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")


if __name__ == "__main__":
    main()
