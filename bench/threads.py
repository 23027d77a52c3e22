"""The fast path under each nbdkit thread model, side by side with its ceilings, repeated.

Servers (all alive at once; each workload runs on each in turn, and the whole round is
repeated, so that the machine's noise spreads over every row): the Python pass-through in
nbdkit's parallel model and serialised (noparallel filter); the bare verifying plugin
(bench/bareplugin.py: one read_verify per request, the fast path's ceiling) in the
parallel and serialize-all-requests models; nbd-verity (default table, fast path) under
serialize-requests, serialize-all-requests and parallel; nbd-verity with the fast path
off (NBD_VERITY_FAST_PATH=0) and with every request inline, both under the default
model. Workloads: 4 KiB random and 512 KiB sequential with 8 jobs, 2 MiB sequential with
1 job (QD1). Figures are MB/s, min/median/max over the rounds; ratios from medians: 4 KiB
against the better pass-through, 512 KiB against L = 1/(1/P + 1/(cores*S)) and 2 MiB
against L1 (P, P1: the parallel pass-through's rates; S: one pass of `openssl dgst
-sha256`). The load average is printed before and after: the machine may be shared.
Usage: python bench/threads.py [ROUNDS [SECONDS]]   e.g. 3 5
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import images  # noqa: E402
import servers  # noqa: E402
from fiorun import Job  # noqa: E402
from run import THREAD_MODELS  # noqa: E402
from side import measure, spread  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
PASS, SERIAL = "Python pass-through, parallel", "Python pass-through, serialised"
FAST_PATH_ENV = "NBD_VERITY_FAST_PATH"


def members(image) -> list[tuple[servers.Server, dict]]:
    """(server, environment additions) in table order."""
    out = [(servers.passthrough_server(image.data), {}),
           (servers.passthrough_server(image.data, filters=("noparallel",),
                                       keys=("serialize=all-requests",)), {})]
    out[0][0].name, out[1][0].name = PASS, SERIAL
    for model in ("parallel", "serialize-all-requests"):
        out.append((servers.bare_server(f"bare read_verify plugin, {model}", image, model), {}))
    for model in THREAD_MODELS:
        out.append((servers.verity_server(f"nbd-verity, {model}", image,
                                          [f"--thread-model={model}"]), {}))
    out.append((servers.verity_server("nbd-verity, serialize-requests, fast path off", image,
                                      []), {FAST_PATH_ENV: "0"}))
    out.append((servers.verity_server("nbd-verity, serialize-requests, all inline", image,
                                      servers.inline_options()), {}))
    return out


def start(server: servers.Server, env: dict) -> None:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        server.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 3
    seconds = float(argv[1]) if len(argv) > 1 else 5.0
    image = images.random_image(1 << 30)
    images.warm(image.data)
    images.warm(image.hash)
    jobs = [Job("randread", 4 * KIB, 8, 1, seconds), Job("read", 512 * KIB, 8, 1, seconds),
            Job("read", 2 * MIB, 1, 1, seconds)]
    before = load()
    mbs, openssl = measure(members(image), start, image, jobs, rounds)
    print(report(mbs, jobs, openssl, rounds, seconds, before, load()))
    return 0


def report(mbs: dict, jobs: list[Job], openssl: list[float], rounds: int, seconds: float,
           before: str, after: str) -> str:
    cores = os.cpu_count() or 1
    s = statistics.median(openssl)
    rand, seq, one = (j.label() for j in jobs)
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in mbs.items()}
    p, p1 = med[PASS][seq], med[PASS][one]
    best_rand = max(med[PASS][rand], med[SERIAL][rand])
    limit, limit1 = 1 / (1 / p + 1 / (cores * s)), 1 / (1 / p1 + 1 / (cores * s))
    lines = [f"{rounds} rounds of {seconds:g} s per fio run; load average (1, 5, 15 min) "
             f"{before} before, {after} after; cores {cores}",
             f"openssl dgst -sha256 S = {spread(openssl)} MB/s; L = {limit:.0f} MB/s, "
             f"L1 = {limit1:.0f} MB/s; better pass-through at 4k = {best_rand:.1f} MB/s", "",
             f"| server | {rand} MB/s min/med/max | vs best PT | {seq} | vs L | {one} "
             f"| vs L1 |", "|---|---|---|---|---|---|---|"]
    for name, row in mbs.items():
        m = med[name]
        lines.append(f"| {name} | {spread(row[rand])} | {m[rand] / best_rand:.2f} | "
                     f"{spread(row[seq])} | {m[seq] / limit:.2f} | {spread(row[one])} | "
                     f"{m[one] / limit1:.2f} |")
    default = med["nbd-verity, serialize-requests"]
    lines += ["", "ratios of the default (serialize-requests, fast path, default table): "
              f"4k random {default[rand] / best_rand:.2f} of the better pass-through "
              f"(target 0.85); 512k sequential {default[seq] / limit:.2f} of L (target "
              f"0.95); 2M one client {default[one] / limit1:.2f} of L1 (target 0.9)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
