"""Where releasing the GIL pays in nbd_verity.format._native, measured under a real nbdkit.

One nbd-verity server (every request inline) per release size, all alive at once; fio
(--ioengine=nbd, 8 jobs x QD1 random reads) runs each request size on each server in
turn, ROUNDS times, so the machine's noise spreads over every column. Release size 0
releases the GIL for every run, NEVER for none; NBD_VERITY_RELEASE_SIZE sets it in the
server (nbd_verity.format.digest). Prints MB/s min/median/max per request size and release size.
Usage: python bench/native_gil.py [SECONDS [ROUNDS [SIZES [RELEASE_SIZES]]]]
       e.g. python bench/native_gil.py 3 4 4096,16384,65536,262144 0,4611686018427387904
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
from run import prefill  # noqa: E402

from nbd_verity.format.digest import RELEASE_ENV  # noqa: E402

NEVER = 1 << 62
SIZES = (4096, 16384, 32768, 65536, 131072, 262144)


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 3.0
    rounds = int(argv[1]) if len(argv) > 1 else 3
    sizes = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else list(SIZES)
    releases = [int(x) for x in argv[3].split(",")] if len(argv) > 3 else [0, NEVER]
    image = images.warm_random_image(1 << 30)  # in the page cache: served as before
    started = {}
    try:
        for release in releases:
            os.environ[RELEASE_ENV] = str(release)
            server = servers.verity_server(f"release {release}", image,
                                           servers.inline_options())
            started[release] = server.start()
            prefill(server, image.size)
    finally:
        os.environ.pop(RELEASE_ENV, None)
    mbs = {(size, release): [] for size in sizes for release in releases}
    try:
        for _ in range(rounds):
            for size in sizes:
                job = Job("randread", size, 8, 1, seconds)
                for release, server in started.items():
                    mbs[(size, release)].append(fiorun.run(server.uri(), job, image.size).mb_s)
    finally:
        for server in started.values():
            server.stop()
    print("| request | " + " | ".join(f"release {'never' if r == NEVER else r} MB/s"
                                      for r in releases) + " |")
    print("|---" * (1 + len(releases)) + "|")
    for size in sizes:
        cells = [mbs[(size, r)] for r in releases]
        print(f"| {fiorun.size_label(size)} | " + " | ".join(
            f"{min(c):.0f}/{statistics.median(c):.0f}/{max(c):.0f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
