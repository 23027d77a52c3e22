"""Many exports from one server against one server per image (docs/benchmarks.md,
"Many exports from one server"): memory, the time to add an export, and throughput.

    python bench/exports.py [ROUNDS]      (default 3; make bench runs it)

- Memory: one `serve --exports` server with 1, 10 and 50 exports of distinct 64 MiB
  random images, each read once whole by a client, against the sum of 1, 10 and 50
  single-image servers read the same way (VmRSS of each nbdkit). Target: 50 exports cost
  at most 1 MiB each above the one-export server.
- Add: the time from `ctl exports reload` to the first verified read of a new export, for
  a local file and for an http:// image (lighttpd, nbdkit's curl plugin).
- Throughput: 8 fio clients (nbd engine) spread over 4 exports against the same 8 on one
  export: 4 KiB random and 512 KiB sequential. Target: >= 0.95.
Rounds interleave the sides; the report gives each figure's median and range.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import fiorun
import images
import nbd
from servers import NBD_VERITY, Server

from nbd_verity.demo.remote import Lighttpd  # servers put the project on sys.path

SIZE = 64 << 20
COUNTS = (1, 10, 50)


def export_dir(imgs, count: int) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="nvx-"))
    for i, image in enumerate(imgs[:count]):
        (directory / f"img{i}.conf").write_text(
            f"DATA={image.data}\nHASH={image.hash}\nROOT_HASH={image.root}\n")
    return directory


class ExportsServer(Server):
    """`nbd-verity serve --exports DIR`, its control socket, by pid."""

    def __init__(self, directory: Path):
        self.directory = directory
        super().__init__(f"exports of {directory}", "verity", [])

    def _argv(self, tail, threads):
        return [NBD_VERITY, "serve", "--exports", str(self.directory), "--unix", self.socket,
                "--pid-file", self.pid_file, "--control", self.control,
                "--exit-with-parent"]


def read_whole(uri: str, size: int) -> None:
    h = nbd.NBD()
    h.connect_uri(uri)
    for offset in range(0, size, 4 << 20):
        h.pread(4 << 20, offset)
    h.shutdown()


def memory_round(imgs) -> dict:
    out = {}
    for count in COUNTS:
        directory = export_dir(imgs, count)
        with ExportsServer(directory).start(timeout=120) as server:
            for i in range(count):
                read_whole(server.uri(f"img{i}"), SIZE)
            out[f"one server, {count} exports"] = server.rss_kib() / 1024
        shutil.rmtree(directory)
        singles = []
        try:
            total = 0.0
            for image in imgs[:count]:
                server = Server("single", "verity", [str(image.data), str(image.hash),
                                                     image.root])
                singles.append(server)
                server.start(timeout=120)
                read_whole(server.uri(), SIZE)
                total += server.rss_kib() / 1024
            out[f"{count} single servers"] = total
        finally:
            for server in singles:
                server.stop()
    return out


def add_round(imgs, web: Lighttpd, docroot: Path) -> dict:
    directory = export_dir(imgs, 1)
    out = {}
    with ExportsServer(directory).start(timeout=120) as server:
        for name, kind, conf in (
                ("newfile", "local file", f"DATA={imgs[1].data}\nHASH={imgs[1].hash}\n"),
                ("newhttp", "http:// image", f"DATA={web.url('data.img')}\n"
                                             f"HASH={web.url('data.hash')}\n")):
            (directory / f"{name}.conf").write_text(conf + f"ROOT_HASH={imgs[1].root}\n")
            started = time.perf_counter()
            server.ctl({"cmd": "exports", "reload": True})
            h = nbd.NBD()
            h.set_export_name(name)
            h.connect_unix(server.socket)
            h.pread(4096, 0)
            out[f"add: {kind}"] = (time.perf_counter() - started) * 1000
            h.shutdown()
    shutil.rmtree(directory)
    return out


def throughput_round(imgs) -> dict:
    out = {}
    directory = export_dir(imgs, 4)
    with ExportsServer(directory).start(timeout=120) as server:
        for job in (fiorun.Job("randread", 4096, numjobs=2, runtime=5),
                    fiorun.Job("read", 512 << 10, numjobs=2, runtime=5)):
            for spread in (1, 4):
                names = [f"img{i % spread}" for i in range(4)]  # 4 fio x 2 jobs = 8 clients
                label = "4 KiB random" if job.rw == "randread" else "512 KiB sequential"
                out[f"{label}, 8 clients on {spread} export(s) (MB/s)"] = \
                    side_by_side([server.uri(n) for n in names], job)
    shutil.rmtree(directory)
    return out


def side_by_side(uris: list[str], job: fiorun.Job) -> float:
    """fio against each URI at once; their MB/s summed."""
    results: list = [None] * len(uris)

    def one(i: int) -> None:
        results[i] = fiorun.run(uris[i], job, SIZE)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(uris))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r.mb_s for r in results)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    imgs = [images.random_image_named(f"exports-{i}", SIZE) for i in range(max(COUNTS))]
    docroot = Path(tempfile.mkdtemp(prefix="nvx-www-"))
    os.symlink(imgs[1].data, docroot / "data.img")
    os.symlink(imgs[1].hash, docroot / "data.hash")
    web = Lighttpd(docroot, Path(tempfile.mkdtemp(prefix="nvx-lighttpd-"))).start()
    figures: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for part in (memory_round(imgs), add_round(imgs, web, docroot),
                         throughput_round(imgs)):
                for key, value in part.items():
                    figures.setdefault(key, []).append(value)
    finally:
        web.stop()
        shutil.rmtree(docroot, ignore_errors=True)
    report(figures, rounds)


def report(figures: dict[str, list[float]], rounds: int) -> None:
    def cell(values, digits: int = 1):
        return (f"{statistics.median(values):.{digits}f} "
                f"({min(values):.{digits}f}-{max(values):.{digits}f})")
    print(f"## Many exports from one server ({rounds} rounds: median (min-max))")
    print("| figure | value |\n|---|---|")
    for key, values in figures.items():
        unit = " MiB RSS" if "server" in key and "MB/s" not in key else (
            " ms" if key.startswith("add") else "")
        print(f"| {key}{unit} | {cell(values)} |")
    one, fifty = figures["one server, 1 exports"], figures["one server, 50 exports"]
    per = [(b - a) / 49 for a, b in zip(one, fifty, strict=True)]
    print(f"| per export above one (50 exports) MiB | {cell(per, 2)} |")
    for label in ("4 KiB random", "512 KiB sequential"):
        spread = figures[f"{label}, 8 clients on 4 export(s) (MB/s)"]
        single = figures[f"{label}, 8 clients on 1 export(s) (MB/s)"]
        ratio = [s / o for s, o in zip(spread, single, strict=True)]
        print(f"| {label}: 4 exports / 1 export | {cell(ratio, 2)} |")
    print(json.dumps(figures), file=sys.stderr)


if __name__ == "__main__":
    main()
