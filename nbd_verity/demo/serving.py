"""The demo's serving steps: serve the image over NBD, tune it live, catch corruption,
and mount a verified ext4 filesystem through nbdfuse and a read-only loop device.

Every server is started and stopped by nbd_verity.launch (by its pid), and every mount,
loop device and FUSE mount is undone, even when a step fails.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import VerityError
from ..launch import Launched
from .walkthrough import CORRUPT_DATA_BLOCK, StepFailed, Walkthrough, flip_byte

READY_TIMEOUT_S = 30


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def shell(w: Walkthrough, *argv, check: bool = True) -> subprocess.CompletedProcess:
    """Run a system command, show it and its output."""
    w.say("$ " + " ".join(str(a) for a in argv))
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          errors="replace", check=False)
    for line in (done.stdout + done.stderr).splitlines():
        w.say(f"    {line}")
    if check and done.returncode:
        raise StepFailed(f"`{argv[0]}` exited {done.returncode}")
    return done


def wait_until(ready, what: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Poll ready() until true (a readiness check, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out waiting for {what}")
        time.sleep(0.05)


def served(w: Walkthrough, name: str, data: Path, hash_image: Path, root: str):
    """`nbd-verity serve DATA HASH ROOT` in the background; yields (nbd socket, control
    socket)."""
    return served_with(w, name, [data.name, hash_image.name, root])


@contextlib.contextmanager
def served_with(w: Walkthrough, name: str, args: list[str]):
    """`nbd-verity serve ARGS` in the background; yields (nbd socket, control socket)."""
    sock, ctl, pid_file = (w.workdir / f"{name}.sock", w.workdir / f"{name}.ctl",
                           w.workdir / f"{name}.pid")
    for path in (sock, pid_file):
        path.unlink(missing_ok=True)
    argv = ["serve", *args, "--unix", sock.name, "--control", ctl.name,
            "--pid-file", pid_file.name]
    w.say(f"$ nbd-verity {' '.join(argv)} &")
    server = Launched([w.cli, *argv], socket=sock, pid_file=pid_file, control=ctl,
                      log_path=w.workdir / f"{name}.log", cwd=w.workdir, name="the server")
    try:
        server.start(timeout=READY_TIMEOUT_S)
    except VerityError as e:
        server.stop()
        raise StepFailed(str(e)) from None
    with server:  # stopped by its own pid: serve exec'd nbdkit
        yield sock, ctl


def nbd_connect(sock: Path, export: str = ""):
    import nbd  # libnbd's Python bindings (Debian python3-libnbd)
    h = nbd.NBD()
    h.set_export_name(export)
    h.connect_unix(str(sock))
    return h


def serve_and_read_back(w: Walkthrough) -> None:
    """Serve the image over NBD and read it all back with nbdcopy: every byte verified."""
    with served(w, "demo", w.data, w.hash, w.root) as (sock, _ctl):
        out = w.workdir / "read-back.img"
        shell(w, "nbdcopy", f"nbd+unix:///?socket={sock}", out)
        ours, theirs = sha256_of(out), sha256_of(w.data)
        w.say(f"sha256 read over NBD: {ours}\nsha256 of data.img:   {theirs}")
        if ours != theirs:
            raise StepFailed("the bytes served differ from the image")
        out.unlink()


def _be_row(w: Walkthrough, ctl: Path) -> dict:
    import json
    done = w.run("ctl", "--control", ctl.name, "stats", "--json")
    return json.loads(done.stdout)["stats"]["classes"]["be"]


def live_thresholds(w: Walkthrough) -> None:
    """Move the inline/pool line while serving: a 64 KiB read changes path."""
    with served(w, "demo", w.data, w.hash, w.root) as (sock, ctl):
        h = nbd_connect(sock)
        w.run("ctl", "--control", ctl.name, "thresholds")
        h.pread(65536, 0)
        before = _be_row(w, ctl)
        w.run("ctl", "--control", ctl.name, "thresholds", "be=32768")
        h.pread(65536, 65536)
        after = _be_row(w, ctl)
        w.run("ctl", "--control", ctl.name, "stats")
        h.shutdown()
        if (before["inline"]["requests"], after["pool"]["requests"]) != (1, 1):
            raise StepFailed("the 64 KiB reads did not go inline, then to the pool")
        w.say("the first 64 KiB read was verified inline (be=1048576, the default), the "
              "second across the pool (be=32768)")


def serve_corrupted(w: Walkthrough) -> None:
    """Serve a copy with one flipped byte: exactly that block fails with EIO."""
    import nbd
    copy = w.workdir / "corrupt-data.img"
    shutil.copyfile(w.data, copy)
    flip_byte(copy, CORRUPT_DATA_BLOCK * 4096 + 100)
    w.say(f"flipped byte 100 of data block {CORRUPT_DATA_BLOCK} in {copy.name}")
    try:
        with served(w, "corrupt", copy, w.hash, w.root) as (sock, ctl):
            h = nbd_connect(sock)
            results = {}
            for block in range(CORRUPT_DATA_BLOCK - 1, CORRUPT_DATA_BLOCK + 2):
                try:
                    h.pread(4096, block * 4096)
                    results[block] = "ok"
                except nbd.Error as e:
                    results[block] = os.strerror(e.errnum) if e.errnum else str(e)
                w.say(f"read data block {block}: {results[block]}")
            h.shutdown()
            done = w.run("ctl", "--control", ctl.name, "status")
            w.expect_in("C", done.stdout.split()[0])
            expected = {CORRUPT_DATA_BLOCK - 1: "ok", CORRUPT_DATA_BLOCK + 1: "ok",
                        CORRUPT_DATA_BLOCK: os.strerror(errno.EIO)}
            if results != expected:
                raise StepFailed(f"expected EIO on block {CORRUPT_DATA_BLOCK} only")
    finally:
        copy.unlink(missing_ok=True)


@contextlib.contextmanager
def mounted(w: Walkthrough, sock: Path, name: str):
    """nbdfuse exposes the export as a file, `losetup -r` makes it a block device, and
    ext4 is mounted read-only from it; yields the mount point. Undone in reverse."""
    fuse_dir, mnt = w.workdir / f"{name}-nbd", w.workdir / f"{name}-mnt"
    fuse_dir.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    with contextlib.ExitStack() as undo:
        w.say(f"$ nbdfuse -r {fuse_dir.name} --unix {sock.name} &")
        fuse = subprocess.Popen(["nbdfuse", "-r", str(fuse_dir), "--unix", str(sock)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        undo.callback(_stop_fuse, fuse, fuse_dir)
        wait_until(lambda: fuse.poll() is not None or (fuse_dir / "nbd").exists(),
                   "nbdfuse to mount")
        if fuse.poll() is not None:
            raise StepFailed("nbdfuse exited")
        loop = shell(w, "losetup", "-r", "-f", "--show", fuse_dir / "nbd").stdout.strip()
        undo.callback(subprocess.run, ["losetup", "-d", loop], check=False)
        shell(w, "mount", "-t", "ext4", "-o", "ro,noload", loop, mnt)
        undo.callback(subprocess.run, ["umount", str(mnt)], check=False)
        yield mnt


def _stop_fuse(fuse: subprocess.Popen, fuse_dir: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(fuse_dir)], check=False,
                   stderr=subprocess.DEVNULL)
    try:
        fuse.wait(10)
    except subprocess.TimeoutExpired:
        fuse.kill()
        fuse.wait()


def make_filesystem(w: Walkthrough) -> tuple[Path, Path, str, bytes]:
    """A 16 MiB ext4 image holding two files, its tree, and its root hash."""
    src = w.workdir / "fs-src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    (src / "hello.txt").write_text("hello from a verified filesystem\n")
    payload = hashlib.sha256(b"demo").digest() * (65536 // 32)  # 64 KiB, 16 blocks
    (src / "payload.bin").write_bytes(payload)
    image, tree = w.workdir / "fs.img", w.workdir / "fs.hash"
    image.unlink(missing_ok=True)
    tree.unlink(missing_ok=True)
    shell(w, "mkfs.ext4", "-q", "-F", "-b", "4096", "-d", src, image, "16M")
    done = w.run("format", image.name, tree.name)
    root = next(line.split()[-1] for line in done.stdout.splitlines()
                if line.startswith("Root hash:"))
    return image, tree, root, payload


def mount_verified_filesystem(w: Walkthrough) -> None:
    """Mount a served ext4 image (nbdfuse + losetup -r), read its files; then corrupt one
    block of a file and watch the read fail with an I/O error and the status go to C."""
    image, tree, root, payload = make_filesystem(w)
    with served(w, "fs", image, tree, root) as (sock, _ctl), mounted(w, sock, "fs") as mnt:
        shell(w, "ls", "-l", mnt)
        shell(w, "cat", mnt / "hello.txt")
        if (mnt / "payload.bin").read_bytes() != payload:
            raise StepFailed("payload.bin read through the verified mount differs")
        w.say("payload.bin read back intact (64 KiB)")
    block = int(shell(w, "debugfs", "-R", "bmap /payload.bin 3", image).stdout.split()[-1])
    corrupt = w.workdir / "fs-corrupt.img"
    shutil.copyfile(image, corrupt)
    flip_byte(corrupt, block * 4096 + 10)
    w.say(f"flipped one byte of filesystem block {block} (block 3 of payload.bin) "
          f"in {corrupt.name}")
    try:
        with served(w, "fsc", corrupt, tree, root) as (sock, ctl), \
                mounted(w, sock, "fsc") as mnt:
            shell(w, "cat", mnt / "hello.txt")
            done = shell(w, "dd", f"if={mnt / 'payload.bin'}", "of=/dev/null", "bs=4096",
                         check=False)
            if done.returncode == 0 or "Input/output error" not in done.stderr:
                raise StepFailed("reading the corrupted file did not fail with EIO")
            status = w.run("ctl", "--control", ctl.name, "status")
            if not status.stdout.startswith("C"):
                raise StepFailed("the server's status did not go to C")
    finally:
        corrupt.unlink(missing_ok=True)


STEPS = (serve_and_read_back, live_thresholds, serve_corrupted, mount_verified_filesystem)
