"""SHA-256 of 4 KiB blocks on one core, MB/s by method: OpenSSL's EVP against SHA-NI x1-x3.

Builds bench/sha256x_bench.c with nbd_verity/format/sha256x.c and libcrypto, runs it
pinned to one CPU RUNS times (each run measures every method in turn), then times the
native engine as Python calls it (Hasher.slots over a 1 MiB run, lanes 0 = EVP, 1-3 =
SHA-NI streams). Prints the median and the min-max of the runs, the ratios to
EVP per call, and the 1-minute load average before and after (the machine is shared).
Usage: python bench/sha256x.py [RUNS [SECONDS [CPU]]]
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


def c_run(exe: Path, seconds: float, cpu: int) -> dict[str, float]:
    out = subprocess.run(["taskset", "-c", str(cpu), str(exe), str(seconds), str(BLOCK_SIZE),
                          str(BLOCKS), str(SALT_SIZE)], capture_output=True, text=True,
                         check=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())
            if rate != "-"}


def engine_run(seconds: float) -> dict[str, float]:
    """The native Hasher as the builder and the verifier call it, per lanes setting."""
    native = digest._native
    data, salt = os.urandom(BLOCK_SIZE * BLOCKS), os.urandom(SALT_SIZE)
    rates = {}
    for lanes in range(0, native.SHA256_MAX_LANES + 1 if native.sha256_default_lanes() else 1):
        hasher = native.Hasher("sha256", salt, 1, lanes=lanes)
        hasher.slots(data, BLOCK_SIZE)
        rounds, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            hasher.slots(data, BLOCK_SIZE)
            rounds += 1
        rates[f"engine {'evp' if lanes == 0 else f'x{lanes}'}"] = \
            rounds * len(data) / elapsed / 1e6
    return rates


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    cpu = int(sys.argv[3]) if len(sys.argv) > 3 else os.cpu_count() - 1
    load_before = os.getloadavg()[0]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for _ in range(runs):
            for name, rate in c_run(exe, seconds, cpu).items():
                results.setdefault(name, []).append(rate)
            os.sched_setaffinity(0, {cpu})
            for name, rate in engine_run(seconds).items():
                results.setdefault(name, []).append(rate)
    load_after = os.getloadavg()[0]
    base = statistics.median(results["evp-new"])
    reuse = statistics.median(results["evp-reuse"])
    print(f"SHA-256 of {BLOCK_SIZE}-byte blocks, {SALT_SIZE}-byte salt first, one core "
          f"(CPU {cpu}); {runs} runs of {seconds:g} s per method; engine: {digest.engine_name()}")
    print("| method | MB/s median | min-max | x evp-new | x evp-reuse |")
    print("|---|---:|---:|---:|---:|")
    for name, rates in results.items():
        med = statistics.median(rates)
        print(f"| {name} | {med:.0f} | {min(rates):.0f}-{max(rates):.0f} "
              f"| {med / base:.2f} | {med / reuse:.2f} |")
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")


if __name__ == "__main__":
    main()
