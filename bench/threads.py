"""The fast path under each nbdkit thread model, side by side with its ceilings, repeated.

Servers (all alive at once; each workload runs on each in turn, and the whole round is
repeated, so that the machine's noise spreads over every row): the Python pass-through in
nbdkit's parallel model and serialised (noparallel filter), each as it comes and keeping
its thread states as nbd-verity does (serve/threadstate.py); the bare verifying plugin
(bench/bareplugin.py: one read_verify per request, the fast path's ceiling) in the
parallel and serialize-all-requests models; nbd-verity (default table, fast path) under
serialize-requests, serialize-all-requests and parallel; nbd-verity with the fast path off
(NBD_VERITY_FAST_PATH=0), with every request inline, and with thread states not kept
(NBD_VERITY_KEEP_THREAD_STATE=0), all under the default model. Workloads: 4 KiB random and
512 KiB sequential with 8 jobs, 2 MiB sequential with 1 job (QD1). Figures are MB/s,
min/median/max over the rounds; ratios from medians: 4 KiB against the best pass-through,
512 KiB against L = 1/(1/P + 1/(cores*S)) and 2 MiB against L1 (P, P1: the best pass-
through's rates for them; S: one pass of `openssl dgst -sha256`); the default's ratios are
also given against the two pass-through rows that do not keep their thread states. The
load average is printed before and after: the machine may be shared.
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
KEPT = ", thread state kept"
KEEP_ENV = "NBD_VERITY_KEEP_THREAD_STATE"
FAST_PATH_ENV = "NBD_VERITY_FAST_PATH"


def members(image) -> list[tuple[servers.Server, dict]]:
    """(server, environment additions) in table order."""
    out = []
    for keep, suffix in ((), ""), (("keep-thread-state=yes",), KEPT):
        out += [(servers.passthrough_server(image.data, keys=keep), {}),
                (servers.passthrough_server(image.data, filters=("noparallel",),
                                            keys=("serialize=all-requests", *keep)), {})]
        out[-2][0].name, out[-1][0].name = PASS + suffix, SERIAL + suffix
    for model in ("parallel", "serialize-all-requests"):
        out.append((servers.bare_server(f"bare read_verify plugin, {model}", image, model), {}))
    for model in THREAD_MODELS:
        out.append((servers.verity_server(f"nbd-verity, {model}", image,
                                          [f"--thread-model={model}"]), {}))
    out.append((servers.verity_server("nbd-verity, serialize-requests, fast path off", image,
                                      []), {FAST_PATH_ENV: "0"}))
    out.append((servers.verity_server("nbd-verity, serialize-requests, all inline", image,
                                      servers.inline_options()), {}))
    out.append((servers.verity_server("nbd-verity, serialize-requests, thread state not kept",
                                      image, []), {KEEP_ENV: "0"}))
    return out


def start(server: servers.Server, env: dict) -> None:
    """Start with env added to the server's environment (taken when it was made: setting
    ours here would not reach it)."""
    server.env.update(env)
    server.start()
    if env.get(FAST_PATH_ENV) == "0" and server.ctl({"cmd": "stats"})["stats"]["fast_path"]:
        raise RuntimeError(f"{server.name}: {FAST_PATH_ENV}=0 did not reach the server")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 3
    seconds = float(argv[1]) if len(argv) > 1 else 5.0
    image = images.warm_random_image(1 << 30)
    jobs = [Job("randread", 4 * KIB, 8, 1, seconds), Job("read", 512 * KIB, 8, 1, seconds),
            Job("read", 2 * MIB, 1, 1, seconds)]
    before = load()
    mbs, openssl = measure(members(image), start, image, jobs, rounds)
    print(report(mbs, jobs, openssl, rounds, seconds, before, load()))
    return 0


def ceilings(med: dict, rand: str, seq: str, one: str, names: tuple[str, ...],
             cores: int, s: float) -> tuple[float, float, float]:
    """(better pass-through at 4k, L, L1) from the pass-through rows `names`: the best of
    them for each workload (P and P1 the best 512k and 2M rates)."""
    best = {k: max(med[n][k] for n in names) for k in (rand, seq, one)}
    return (best[rand], 1 / (1 / best[seq] + 1 / (cores * s)),
            1 / (1 / best[one] + 1 / (cores * s)))


def report(mbs: dict, jobs: list[Job], openssl: list[float], rounds: int, seconds: float,
           before: str, after: str) -> str:
    cores = os.cpu_count() or 1
    s = statistics.median(openssl)
    rand, seq, one = (j.label() for j in jobs)
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in mbs.items()}
    every = (PASS, SERIAL, PASS + KEPT, SERIAL + KEPT)
    best_rand, limit, limit1 = ceilings(med, rand, seq, one, every, cores, s)
    plain = ceilings(med, rand, seq, one, (PASS, SERIAL), cores, s)
    lines = [f"{rounds} rounds of {seconds:g} s per fio run; load average (1, 5, 15 min) "
             f"{before} before, {after} after; cores {cores}",
             f"openssl dgst -sha256 S = {spread(openssl)} MB/s; from the best of the four "
             f"pass-through rows: 4k = {best_rand:.1f} MB/s, L = {limit:.0f} MB/s, "
             f"L1 = {limit1:.0f} MB/s", "",
             f"| server | {rand} MB/s min/med/max | vs best PT | {seq} | vs L | {one} "
             f"| vs L1 |", "|---|---|---|---|---|---|---|"]
    for name, row in mbs.items():
        m = med[name]
        lines.append(f"| {name} | {spread(row[rand])} | {m[rand] / best_rand:.2f} | "
                     f"{spread(row[seq])} | {m[seq] / limit:.2f} | {spread(row[one])} | "
                     f"{m[one] / limit1:.2f} |")
    default = med["nbd-verity, serialize-requests"]
    for what, (r, lim, lim1) in (("the best of the four pass-through rows", (best_rand, limit,
                                                                              limit1)),
                                 ("the two pass-through rows without kept thread states",
                                  plain)):
        lines += ["", f"ratios of the default (serialize-requests, fast path, default "
                  f"table) against {what}: 4k random {default[rand] / r:.2f} (target 0.85); "
                  f"512k sequential {default[seq] / lim:.2f} of L (target 0.95); 2M one "
                  f"client {default[one] / lim1:.2f} of L1 (target 0.9)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
