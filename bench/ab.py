"""Two checkouts' servers on one fio workload, in pairs of fresh processes: B/A.

Identical server processes serve at rates that stay apart for their whole life (four of
the same code: 1400-1677 MB/s, docs/benchmarks.md), so one process of each checkout
measures that luck as much as the code. Here every pair is a new process of each, run in
the order A B B A (1 s fio runs, or RUNTIME), the next pair B A A B; the ratio is each
pair's B mean over its A mean, and the median over the pairs with its quartiles is what
it prints. A checkout's extensions must be built in place (`python setup.py build_ext
--inplace` there). The same checkout as A and B is the control: 1.00 with quartiles
about 0.95-1.04 for 16 pairs of 64 KiB random x8 on a 2-core machine.

    python bench/ab.py DIR_A DIR_B [PAIRS [BS_KIB [JOBS [RW [RUNTIME [TABLE]]]]]]
        (default 16 pairs, 64 KiB, 8 jobs, randread, 1 s, TABLE default; `pool` or
        `inline` pins every class's threshold on both servers; `TABLE_A,TABLE_B` gives
        each its own)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fiorun  # noqa: E402
import images  # noqa: E402
import servers  # noqa: E402

SIZE = 512 << 20


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    a_dir, b_dir = Path(argv[1]).resolve(), Path(argv[2]).resolve()
    pairs = int(argv[3]) if len(argv) > 3 else 16
    bs = (int(argv[4]) if len(argv) > 4 else 64) << 10
    jobs = int(argv[5]) if len(argv) > 5 else 8
    rw = argv[6] if len(argv) > 6 else "randread"
    runtime = float(argv[7]) if len(argv) > 7 else 1.0
    table = argv[8] if len(argv) > 8 else "default"
    tables = {"default": [], "pool": servers.pool_options(), "inline": servers.inline_options()}
    a_table, _, b_table = table.partition(",")
    options = {"A": tables[a_table], "B": tables[b_table or a_table]}
    image = images.random_image(SIZE)
    images.warm(image.data)
    images.warm(image.hash)
    job = fiorun.Job(rw, bs, numjobs=jobs, runtime=runtime)
    ratios, rates = [], {"A": [], "B": []}
    for i in range(pairs):
        pair = {"A": servers.checkout_server("A", image, a_dir, options["A"]),
                "B": servers.checkout_server("B", image, b_dir, options["B"])}
        try:
            for started in pair.values():
                started.start(timeout=120)
            order = ["A", "B", "B", "A"] if i % 2 == 0 else ["B", "A", "A", "B"]
            got: dict = {"A": [], "B": []}
            for name in order:
                got[name].append(fiorun.run(pair[name].uri("@be"), job, SIZE).mb_s)
        finally:
            for started in pair.values():
                started.stop()
        a, b = statistics.fmean(got["A"]), statistics.fmean(got["B"])
        rates["A"].append(a)
        rates["B"].append(b)
        ratios.append(b / a)
    low, _, high = statistics.quantiles(ratios, n=4) if pairs > 1 else (ratios[0],) * 3
    print(f"{job.label()}, table {table}: B/A {statistics.median(ratios):.3f} (quartiles {low:.3f}-"
          f"{high:.3f}) over {pairs} pairs; MB/s A {statistics.median(rates['A']):.0f}, "
          f"B {statistics.median(rates['B']):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
