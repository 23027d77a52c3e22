"""`nbd-verity tune`: measure the inline/pool crossover per class and recommend thresholds.

Against a running server (`--control PATH --socket PATH`), or against a pair of images it
serves itself for the length of the run (`tune DATA HASH ROOT_HASH`). The measuring is
nbd_verity.control.tune's; this module finds the server, shows progress, prints the sweep, draws
the plot and finally applies the result (`--apply`) or puts back the table it found.
Every bad argument is one line on stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile

import click

from ..control.protocol import checked_request
from ..control.table import INLINE, POOL
from ..control.tune import ClassSweep, Clients, Settings, median_noise, parse_classes, sweep_class
from ..errors import ConfigError, VerityError
from ..files import write_atomically
from ..ioclass import CLASSES
from ..launch import Launched, nbdkit_command
from ..limits import MAX_REQUEST_SIZE
from ..prepare.config import parse_size, plugin_pairs
from ..serve.startup import check_device
from ..sources.remote import is_uri, is_url, redact
from .common import EXIT_ERROR, edge, say


class TuneError(click.ClickException):
    """A bad argument: one line (common.say), exit status 2 (not click's usage block)."""

    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:
        say(f"tune: {self.format_message()}")


class OneLineCommand(click.Command):
    """click's own parse errors (bad types, missing values) as one line too."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise TuneError(e.format_message()) from None


def size_text(size: int) -> str:
    """4k, 512k, 2M: the spelling --sizes takes."""
    if size and size % (1 << 20) == 0:
        return f"{size >> 20}M"
    return f"{size >> 10}k" if size and size % 1024 == 0 else str(size)


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of request sizes (4k,64k,...), ascending, each 1..32 MiB."""
    try:
        sizes = sorted({parse_size("sizes", part) for part in text.split(",") if part.strip()})
    except ConfigError as e:
        raise TuneError(str(e)) from None
    if not sizes:
        raise TuneError("sizes: no size given")
    if sizes[0] < 1 or sizes[-1] > MAX_REQUEST_SIZE:
        raise TuneError(f"sizes: each size must be 1..{MAX_REQUEST_SIZE} bytes")
    return tuple(sizes)


# -- the server we talk to ------------------------------------------------------------


class Target:
    """A server's NBD socket and control socket."""

    def __init__(self, nbd_socket: str, control: str) -> None:
        self.socket = nbd_socket
        self.control = control

    def request(self, request: dict) -> dict:
        return checked_request(self.control, request)

    def table(self) -> dict[str, int]:
        return self.request({"cmd": "thresholds"})["thresholds"]

    def set_table(self, table: dict[str, int]) -> dict[str, int]:
        return self.request({"cmd": "thresholds", "set": table})["thresholds"]

    def set_threshold(self, io_class: str, value: int) -> None:
        self.set_table({io_class: value})

    def connect(self, export: str):
        import nbd  # libnbd's bindings (python3-libnbd): imported only when tune runs
        h = nbd.NBD()
        h.set_export_name(export)
        try:
            h.connect_unix(self.socket)
        except nbd.Error as e:
            raise VerityError(f"socket: {self.socket}: {e}") from None
        return h


def granted(target: Target, clients: Clients, io_class: str) -> None:
    """Refuse to sweep a class the server did not give the connections named for it (a
    class above its default needs `serve --allow-class`): its counters must count one
    read of each."""
    def counted() -> int | None:
        row = target.request({"cmd": "stats"})["stats"].get("classes", {}).get(io_class)
        return None if row is None else row["inline"]["requests"] + row["pool"]["requests"]
    before = counted()
    for h in clients.handles:
        h.pread(4096, 0)
    after = counted()
    if before is not None and after is not None and after - before < len(clients.handles):
        raise TuneError(f"class {io_class}: the server gave these connections another "
                        f"class (naming a class above its default needs `serve "
                        f"--allow-class {io_class}`)")


@contextlib.contextmanager
def served(data: str, hash_image: str, root_hash: str, workers: int | None,
           threads: int | None):
    """Serve the images with our plugin for the length of the run; stop it by pid. An
    http(s) or s3 image needs the captive upstream `serve` starts: refused here."""
    for role, text in (("data", data), ("hash", hash_image)):
        if is_url(text) and not is_uri(text):
            raise TuneError(f"{role}: {redact(text)}: tune serves paths and NBD URIs itself; "
                            f"serve this image with `nbd-verity serve` and tune that "
                            f"server (--control, --socket)")
    workdir = tempfile.mkdtemp(prefix="nv-tune-")  # short: sun_path holds 108 bytes
    target = Target(os.path.join(workdir, "nbd.sock"), os.path.join(workdir, "ctl.sock"))
    pairs = plugin_pairs({"data": data, "hash_image": hash_image, "root_hash": root_hash,
                          "control": target.control, "workers": workers,
                          "allow_classes": ("rt",)})  # its own private socket: tune's alone
    check_device(pairs)  # as serve does: a wrong root hash is one line
    argv = nbdkit_command(pairs, {"unix": target.socket, "threads": threads,
                                  "exit_with_parent": True})
    server = Launched(argv, socket=target.socket, control=target.control,
                      log_path=os.path.join(workdir, "server.log"))
    try:
        with server.start():
            yield target
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- output ---------------------------------------------------------------------------


def sweep_text(sweep: ClassSweep) -> str:
    """The sweep table of one class, the recommendation marked."""
    chosen = sweep.recommendation
    lines = [f"{'size':>6} {'inline MB/s':>12} {'pool MB/s':>10} {'inline/pool':>12} "
             f"{'noise':>7}"]
    for size in sweep.sizes:
        mark = "  <- threshold" if size == chosen else ""
        lines.append(f"{size_text(size):>6} {sweep.mb_s(size, INLINE):>12.1f} "
                     f"{sweep.mb_s(size, POOL):>10.1f} {sweep.ratio(size):>11.2f}x "
                     f"{'±' + format(sweep.noise(size) * 100, '.1f') + '%':>7}{mark}")
    return "\n".join(lines)


def verdict(sweep: ClassSweep) -> str:
    """The recommendation in words, and whether it is within noise of its neighbours."""
    chosen = sweep.recommendation
    if chosen == 0:
        text = (f"{sweep.io_class}: recommend 0 (every request to the pool): the pool is "
                f"faster from {size_text(sweep.sizes[0])} on")
    else:
        text = (f"{sweep.io_class}: recommend {chosen} ({size_text(chosen)}): the largest "
                f"size where inline is at least as fast as the pool")
    if chosen == sweep.sizes[-1]:
        text += " (the largest size swept: any crossover lies above it)"
    close = sweep.close_calls()
    if close:
        shown = ", ".join(f"{size_text(s)} ({sweep.ratio(s):.2f}x ±{sweep.noise(s) * 100:.1f}%)"
                          for s in close)
        text += f"\n{sweep.io_class}: within noise at {shown}: a neighbouring size is as good"
    return text


def plot(path: str, sweeps: list[ClassSweep], title: str) -> None:
    """MB/s inline and pool against the request size, one panel per class."""
    try:
        import matplotlib
    except ImportError:
        raise VerityError("plot: matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.5 * len(sweeps), 3.8), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        for mode, style in ((INLINE, "o-"), (POOL, "s--")):
            ax.plot(sweep.sizes, [sweep.mb_s(s, mode) for s in sweep.sizes], style, label=mode)
        if sweep.recommendation:
            ax.axvline(sweep.recommendation, color="grey", linestyle=":", label="threshold")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sweep.sizes, [size_text(s) for s in sweep.sizes], fontsize=7)
        ax.set_title(f"class {sweep.io_class}")
        ax.set_xlabel("request size")
        ax.set_ylabel("MB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        image = io.BytesIO()
        fig.savefig(image, dpi=100, format=os.path.splitext(path)[1][1:].lower() or "png")
        write_atomically(path, image.getvalue())
    except (OSError, ValueError) as e:
        raise VerityError(f"plot: {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


@contextlib.contextmanager
def progress(total: int):
    """A progress bar on stderr when it is a terminal; a no-op step otherwise."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    with click.progressbar(length=total, label="Measuring", file=sys.stderr) as bar:
        yield lambda: bar.update(1)


# -- the command ----------------------------------------------------------------------


def _settings(sizes: str, duration: float, repeat: int, connections: int,
              span: str) -> Settings:
    """Check the measuring options, each with its own message."""
    swept = parse_sizes(sizes)
    if not 0 < duration <= 3600:
        raise TuneError(f"duration: {duration} is not within (0, 3600] seconds")
    if not 1 <= repeat <= 100:
        raise TuneError(f"repeat: {repeat} is not within 1..100")
    if not 1 <= connections <= 64:
        raise TuneError(f"connections: {connections} is not within 1..64")
    try:
        span_size = parse_size("span", span)
    except ConfigError as e:
        raise TuneError(str(e)) from None
    if span_size < swept[-1]:
        raise TuneError(f"span: {span_size} is smaller than the largest size {swept[-1]}")
    return Settings(swept, duration, repeat, connections, span_size)


def _check_target(images: tuple[str, ...], control, nbd_socket, apply, workers, threads):
    if images and len(images) != 3:
        raise TuneError("give DATA HASH ROOT_HASH, or --control PATH --socket PATH")
    if images and (control or nbd_socket):
        raise TuneError("give DATA HASH ROOT_HASH or --control/--socket, not both")
    if not images and not (control and nbd_socket):
        raise TuneError("a running server needs both --control PATH and --socket PATH "
                        "(or give DATA HASH ROOT_HASH)")
    if apply and images:
        raise TuneError("--apply changes a running server: use --control and --socket")
    if (workers is not None or threads is not None) and not images:
        raise TuneError("--workers and --threads apply only when tune serves DATA HASH itself")


def _measure(target: Target, classes, settings: Settings) -> list[ClassSweep]:
    import nbd
    sweeps = []
    with progress(settings.steps(len(classes))) as step:
        for number, io_class in enumerate(classes):
            clients = Clients(target.connect, io_class, settings)
            try:
                granted(target, clients, io_class)
                if number == 0:
                    clients.warm()
                sweeps.append(sweep_class(clients, io_class, target.set_threshold, settings,
                                          step))
            except nbd.Error as e:  # a read failed: EIO from corruption, a server gone
                raise VerityError(f"read from {target.socket}: {e}") from None
            finally:
                clients.close()
    return sweeps


@click.command("tune", cls=OneLineCommand)
@click.argument("images", nargs=-1, metavar="[DATA HASH ROOT_HASH]")
@click.option("--control", default=None, metavar="PATH", help="A running server's control socket.")
@click.option("--socket", "nbd_socket", default=None, metavar="PATH",
              help="The same server's NBD Unix socket.")
@click.option("--class", "classes", multiple=True, metavar="CLASS",
              help="Tune this class (none, rt, be, idle; repeatable); default all.")
@click.option("--sizes", default=",".join(size_text(s) for s in Settings().sizes),
              show_default=True, help="Request sizes to sweep.")
@click.option("--duration", type=float, default=Settings().duration, show_default=True,
              help="Seconds per measurement.")
@click.option("--repeat", type=int, default=Settings().repeat, show_default=True,
              help="Repetitions of each point (inline and pool alternate who goes first).")
@click.option("--connections", type=int, default=Settings().connections, show_default=True,
              help="Concurrent client connections.")
@click.option("--span", default="256M", show_default=True,
              help="Random offsets fall in this many first bytes of the device.")
@click.option("--plot", "plot_path", default=None, metavar="FILE",
              help="Save a PNG plot of the sweep (needs matplotlib).")
@click.option("--apply", is_flag=True, help="Set the recommended thresholds on the server.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--workers", type=int, default=None, help="Pool size of a self-served run.")
@click.option("--threads", type=int, default=None, help="nbdkit threads of a self-served run.")
@edge
def tune_cmd(images, control, nbd_socket, classes, sizes, duration, repeat, connections, span,
             plot_path, apply, as_json, workers, threads) -> None:
    """Find each class's inline threshold by measurement (against a running server with
    --control and --socket, or serving DATA HASH ROOT_HASH itself)."""
    _check_target(images, control, nbd_socket, apply, workers, threads)
    settings = _settings(sizes, duration, repeat, connections, span)
    try:
        chosen_classes = parse_classes(classes)
    except ConfigError as e:
        raise TuneError(str(e)) from None
    if images:
        context = served(*images, workers, threads)
    else:
        context = contextlib.nullcontext(Target(nbd_socket, control))
    with context as target:
        found = target.table()
        sweeps: list[ClassSweep] = []
        try:
            sweeps = _measure(target, chosen_classes, settings)
        finally:  # also on errors and ^C: never leave a class forced inline or to the pool
            final = target.set_table(
                {**found, **{s.io_class: s.recommendation for s in sweeps}}
                if apply and len(sweeps) == len(chosen_classes) else found)
    noise = median_noise(sweeps)
    if plot_path:
        plot(plot_path, sweeps, f"nbd-verity tune: {settings.connections} connection(s), "
             f"{settings.repeat} x {settings.duration:g} s per point")
    if as_json:
        click.echo(json.dumps({"classes": [s.as_dict() for s in sweeps], "noise": noise,
                               "applied": apply, "table": final}))
        return
    _print(sweeps, settings, noise, apply, final, bool(images))


def _print(sweeps, settings: Settings, noise: float, apply: bool, final: dict,
           self_served: bool) -> None:
    click.echo(f"{settings.connections} connection(s), {settings.repeat} x "
               f"{settings.duration:g} s per point, random reads in the first "
               f"{settings.span >> 20} MiB")
    for sweep in sweeps:
        click.echo(f"\nclass {sweep.io_class}")
        click.echo(sweep_text(sweep))
        click.echo(verdict(sweep))
    click.echo(f"\nnoise: ±{noise * 100:.1f}% (median coefficient of variation of MB/s "
               f"across {settings.repeat} repetitions; the noise column is that of the "
               f"inline/pool ratio, each repetition's two runs paired)")
    recommended = " ".join(f"{s.io_class}={s.recommendation}" for s in sweeps)
    if apply:
        click.echo(f"applied: {recommended}")
    elif self_served:
        click.echo("serve with: " + " ".join(f"--threshold {s.io_class}={s.recommendation}"
                                             for s in sweeps))
    else:
        click.echo("not applied (use --apply); table restored: "
                   + " ".join(f"{c}={final[c]}" for c in CLASSES))
