"""The issue-10 targets side by side, repeated: min/median/max of each figure.

Servers (all alive at once, each workload run on each in turn, the whole round repeated
so that the machine's noise spreads over every row): nbdkit's C file plugin, the Python
pass-through in nbdkit's parallel model and serialised (noparallel filter), and
nbd-verity all inline, all pool and default table, on each engine asked for. Workloads:
4 KiB random and 512 KiB sequential with 8 jobs, 2 MiB sequential with 1 job (QD1).
Limits as bench/run.py computes them: L = 1/(1/P + 1/(cores*S)) with P the pass-through's
512 KiB rate, L1 the same with P1 its 2 MiB one-job rate, S one pass of `openssl dgst`.
Usage: python bench/side.py [ROUNDS [SECONDS [ENGINES]]]   e.g. 3 5 native,python
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import servers  # noqa: E402
from fiorun import Job  # noqa: E402
from run import prefill, say, timed  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
PASS, SERIAL = "Python pass-through", "Python pass-through, serialised"


def group(image, engines: list[str]) -> list[tuple[servers.Server, str | None]]:
    out = [(servers.file_server(image.data), None), (servers.passthrough_server(image.data), None),
           (servers.passthrough_server(image.data, filters=("noparallel",),
                                       keys=("serialize=all-requests",)), None)]
    out[2][0].name = SERIAL
    for engine in engines:
        for label, options in (("inline", servers.inline_options()),
                               ("pool", servers.pool_options()), ("default", [])):
            out.append((servers.verity_server(f"nbd-verity {engine}, {label}", image, options),
                        engine))
    return out


def start(server: servers.Server, engine: str | None) -> None:
    """Start on the engine asked for (the server's environment was taken when it was
    made, so it is changed there, not in ours)."""
    server.env.pop("NBD_VERITY_PURE", None)
    if engine == "python":
        server.env["NBD_VERITY_PURE"] = "1"
    server.start()


def measure(members, start, image, jobs: list[Job], rounds: int):
    """Every server of members alive at once (start(server, extra) starts each), each job
    run on each in turn, the whole round repeated; returns {server: {job: [MB/s]}} and
    one pass of `openssl dgst -sha256` per round (MB/s)."""
    mbs: dict[str, dict[str, list[float]]] = {s.name: {j.label(): [] for j in jobs}
                                              for s, _ in members}
    openssl: list[float] = []
    try:
        for server, extra in members:
            start(server, extra)
            if server.kind == "verity":
                prefill(server, image.size)
        for r in range(rounds):
            openssl.append(image.size / timed(["openssl", "dgst", "-sha256",
                                               str(image.data)]) / 1e6)
            for job in jobs:
                for server, _ in members:
                    say(f"round {r + 1}: {server.name}: {job.label()}")
                    mbs[server.name][job.label()].append(
                        fiorun.run(server.uri(), job, image.size).mb_s)
    finally:
        for server, _ in members:
            server.stop()
    return mbs, openssl


def spread(xs: list[float]) -> str:
    return f"{min(xs):.0f}/{statistics.median(xs):.0f}/{max(xs):.0f}"


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 3
    seconds = float(argv[1]) if len(argv) > 1 else 5.0
    engines = argv[2].split(",") if len(argv) > 2 else ["native"]
    image = images.random_image(1 << 30)
    images.warm(image.data)
    images.warm(image.hash)
    jobs = [Job("randread", 4 * KIB, 8, 1, seconds), Job("read", 512 * KIB, 8, 1, seconds),
            Job("read", 2 * MIB, 1, 1, seconds)]
    mbs, openssl = measure(group(image, engines), start, image, jobs, rounds)
    cores = os.cpu_count() or 1
    s = statistics.median(openssl)
    rand, seq, one = (j.label() for j in jobs)
    p = statistics.median(mbs[PASS][seq])
    p1 = statistics.median(mbs[PASS][one])
    best_rand = max(statistics.median(mbs[PASS][rand]), statistics.median(mbs[SERIAL][rand]))
    limit, limit1 = 1 / (1 / p + 1 / (cores * s)), 1 / (1 / p1 + 1 / (cores * s))
    print(f"openssl dgst -sha256 S = {spread(openssl)} MB/s; cores {cores}; "
          f"L = {limit:.0f} MB/s, L1 = {limit1:.0f} MB/s (from medians); "
          f"better pass-through at 4k = {best_rand:.1f} MB/s")
    print(f"| server | {rand} MB/s min/med/max | vs best PT | {seq} | vs L | {one} | vs L1 |")
    print("|---|---|---|---|---|---|---|")
    for name, row in mbs.items():
        m = {k: statistics.median(v) for k, v in row.items()}
        print(f"| {name} | {spread(row[rand])} | {m[rand] / best_rand:.2f} | "
              f"{spread(row[seq])} | {m[seq] / limit:.2f} | {spread(row[one])} | "
              f"{m[one] / limit1:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
