"""FEC format time: nbd-verity against `veritysetup format --fec-device`, side by side.

Both build the tree and the parity of the same random image (1 GiB, roots 2 by default:
issue 12 asks for at most 1.5x veritysetup's wall time) with the same salt and UUID; runs
alternate between the tools, each writes fresh hash and FEC files, the parity files are
compared byte for byte, and min / median / max wall time of each tool is printed with the
ratio of the medians. Our side is the command a user types, `nbd-verity format
--fec-device` (process start-up included, as for veritysetup).

    .venv/bin/python bench/fec.py [--size-mib 1024] [--roots 2] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from format import SALT, THEIRS, UUID, prepare_image, wait_until_quiet, warm_cache

OURS = str(Path(sys.executable).parent / "nbd-verity")


def timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"bench: {argv[0]} failed ({done.returncode}): {done.stderr}")
    return wall, done.stdout


def commands(image: Path, work: Path, roots: int) -> dict[str, list[str]]:
    return {
        "nbd-verity": [OURS, "format", str(image), str(work / "ours.hash"),
                       "--fec-device", str(work / "ours.fec"), f"--fec-roots={roots}",
                       f"--salt={SALT}", f"--uuid={UUID}"],
        "veritysetup": [THEIRS, "format", str(image), str(work / "theirs.hash"),
                        "--fec-device", str(work / "theirs.fec"), f"--fec-roots={roots}",
                        f"--salt={SALT}", f"--uuid={UUID}"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--roots", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/nbd-verity-bench"))
    ap.add_argument("--quiet-wait", type=float, default=30.0)
    args = ap.parse_args()
    image = prepare_image(args.dir, args.size_mib)
    work = args.dir / "fec"
    work.mkdir(exist_ok=True)
    argv = commands(image, work, args.roots)
    walls: dict[str, list[float]] = {name: [] for name in argv}
    for rep in range(args.reps):
        order = list(argv) if rep % 2 == 0 else list(argv)[::-1]
        for name in order:
            for suffix in ("hash", "fec"):
                (work / f"{'ours' if name == 'nbd-verity' else 'theirs'}.{suffix}").unlink(
                    missing_ok=True)
            warm_cache(image)
            wait_until_quiet(args.quiet_wait)
            wall, _ = timed(argv[name])
            walls[name].append(wall)
            print(f"rep {rep + 1} {name:12} {wall:7.2f} s", flush=True)
        if not filecmp.cmp(work / "ours.fec", work / "theirs.fec", shallow=False):
            sys.exit("bench: the FEC files differ")
    print(f"\n{args.size_mib} MiB, roots {args.roots}, {args.reps} runs each (wall seconds)")
    print(f"{'tool':12} {'min':>7} {'median':>7} {'max':>7}")
    for name, w in walls.items():
        print(f"{name:12} {min(w):7.2f} {statistics.median(w):7.2f} {max(w):7.2f}")
    ratio = statistics.median(walls["nbd-verity"]) / statistics.median(walls["veritysetup"])
    print(f"ratio of medians ours/theirs: {ratio:.2f} (target: at most 1.5)")


if __name__ == "__main__":
    main()
