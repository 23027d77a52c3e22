"""The real kernel reads nbd-verity: /dev/nbd0 in a QEMU guest, against its dm-verity.

Each test boots one guest (Debian's kernel under TCG, about 8 s) with nbd-verity serving
on a Unix socket of the host, and compares what the guest's kernel sees through `nbd-client` with
what the same kernel's own dm-verity sees on the same images: the same bytes, and EIO on
exactly the same blocks. See harness.py for how a run is put together.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import subprocess
from pathlib import Path

from .bench import read_fio, record, recording, render
from .conftest import Images
from .harness import NBD_VERITY, Export, GuestRun, Server, guest_run, guest_session
from .images import (
    corrupt_copy,
    ext4_file_blocks,
    ext4_image,
    level0_hash_block,
    random_file,
    verity_format,
)

PORT = 10809


def failing_blocks(run: GuestRun, name: str) -> list[int]:
    """The blocks a block_scan listed, checking that each failed with EIO."""
    failures = [tuple(map(int, line.split())) for line in run.lines(name)]
    wrong = [(index, code) for index, code in failures if code != errno.EIO]
    assert not wrong, f"{name}: blocks failed with errors other than EIO: {wrong}"
    return [index for index, _ in failures]


def scan_script(root_hash: str) -> str:
    """Scan every block of /dev/nbd0, then of dm-verity on the guest's vda/vdb."""
    return f"""
nbd_attach nbd0 {PORT}
block_scan nbd0 nbd.failing
nbd_detach nbd0
dm=$(verity_open vdata vda vdb {root_hash})
block_scan "$dm" dm.failing
verity_close vdata
"""


def test_nbd_and_kernel_verity_give_the_image(images: Images, tmp_path: Path):
    export = images.export
    script = f"""
nbd_attach nbd0 {PORT}
dev_size nbd0 nbd.size
dev_sha256 nbd0 nbd.sha256
dm=$(verity_open vdata vda vdb {export.root_hash})
dev_size "$dm" dm.size
dev_sha256 "$dm" dm.sha256
cmp /dev/nbd0 "/dev/$dm"
verity_close vdata
nbd_detach nbd0
"""
    with guest_run(script, [export.data, export.hash], {PORT: Server(export)}, tmp_path) as run:
        size = str(export.data.stat().st_size)
        assert run.read("nbd.size") == size
        assert run.read("dm.size") == size
        assert run.read("nbd.sha256") == images.sha256
        assert run.read("dm.sha256") == images.sha256


def test_corrupt_data_blocks_fail_alike(images: Images, tmp_path: Path):
    last = images.data_blocks - 1
    corrupted = [0, images.data_blocks // 2, last]
    data = corrupt_copy(images.export.data, tmp_path / "data-corrupt.img", corrupted)
    export = Export(data=data, hash=images.export.hash, root_hash=images.export.root_hash)
    with guest_run(scan_script(export.root_hash), [export.data, export.hash],
                   {PORT: Server(export)}, tmp_path / "run") as run:
        nbd = failing_blocks(run, "nbd.failing")
        kernel = failing_blocks(run, "dm.failing")
    assert kernel == corrupted, "the kernel's dm-verity disagrees with the corruption made"
    assert nbd == kernel


def test_corrupt_level0_hash_block_fails_alike(images: Images, tmp_path: Path):
    level0 = level0_hash_block(images.data_blocks, k=37)
    hash_image = corrupt_copy(images.export.hash, tmp_path / "hash-corrupt.img",
                              [level0.hash_block_index])
    export = Export(data=images.export.data, hash=hash_image,
                    root_hash=images.export.root_hash)
    with guest_run(scan_script(export.root_hash), [export.data, export.hash],
                   {PORT: Server(export)}, tmp_path / "run") as run:
        nbd = failing_blocks(run, "nbd.failing")
        kernel = failing_blocks(run, "dm.failing")
    assert kernel == level0.covered, "the kernel's dm-verity disagrees with the corruption made"
    assert nbd == kernel


def test_ext4_mounts_and_a_corrupt_file_gives_eio(e2e_host, tmp_path: Path):
    files = {
        "hello.txt": b"hello from nbd-verity\n",
        "random.bin": random_file(tmp_path / "random.src", 1024 * 1024, seed=7).read_bytes(),
    }
    good = ext4_image(tmp_path / "fs.img", 16 * 1024 * 1024, files, tmp_path / "staging")
    export = verity_format(good, tmp_path / "fs.hash")
    blocks = ext4_file_blocks(good, "random.bin")
    bad = Export(data=corrupt_copy(good, tmp_path / "fs-corrupt.img", [blocks[len(blocks) // 2]]),
                 hash=export.hash, root_hash=export.root_hash)
    script = f"""
nbd_attach nbd0 {PORT}
nbd_attach nbd1 {PORT + 1}
mkdir -p /run/good /run/bad
mount -t ext4 -o ro /dev/nbd0 /run/good
mount -t ext4 -o ro /dev/nbd1 /run/bad
(cd /run/good && sha256sum hello.txt random.bin) >"$E2E_WORK/good.sums"
cat /run/bad/hello.txt >"$E2E_WORK/bad-hello.txt"
if cat /run/bad/random.bin >/dev/null 2>"$E2E_WORK/bad-random.err"; then
    echo read >"$E2E_WORK/bad-random.status"
else
    echo failed >"$E2E_WORK/bad-random.status"
fi
umount /run/good /run/bad
nbd_detach nbd0
nbd_detach nbd1
"""
    servers = {PORT: Server(export), PORT + 1: Server(bad)}
    with guest_run(script, [], servers, tmp_path / "run") as run:
        sums = dict(reversed(line.split()) for line in run.lines("good.sums"))
        assert sums == {name: hashlib.sha256(content).hexdigest()
                        for name, content in files.items()}
        assert run.read("bad-hello.txt").encode() + b"\n" == files["hello.txt"]
        assert run.read("bad-random.status") == "failed"
        assert "Input/output error" in run.read("bad-random.err")


# fio job name -> (rw, block size, column title)
FIO_JOBS = {"randread-4k": ("randread", "4k", "4 KiB random read"),
            "read-512k": ("read", "512k", "512 KiB sequential read")}


def test_fio_figures(images: Images, tmp_path: Path):
    """fio on nbd-verity, on nbdkit's unverified file plugin and on kernel dm-verity.

    One round of every job in an ordinary run; three when recording the doc (the table
    then gives the median and the spread), the targets taking turns within each round."""
    export = images.export
    rounds = 3 if recording() else 1
    # result prefix -> (guest device, row title)
    targets = {"nbd0": ("nbd0", "/dev/nbd0: nbdkit file plugin (unverified baseline)"),
               "nbd1": ("nbd1", "/dev/nbd1: nbd-verity serve"),
               "dm": ('"$dm"', "kernel dm-verity on the guest's own disks")}
    jobs = "\n".join(f"fio_read {device} {rw} {bs} {prefix}-{job}-{r}.json"
                     for r in range(rounds)
                     for job, (rw, bs, _) in FIO_JOBS.items()
                     for prefix, (device, _) in targets.items())
    script = f"""
nbd_attach nbd0 {PORT}
nbd_attach nbd1 {PORT + 1}
dm=$(verity_open vdata vda vdb {export.root_hash})
{jobs}
verity_close vdata
nbd_detach nbd0
nbd_detach nbd1
"""
    servers = {PORT: Server(export, kind="nbdkit-file"), PORT + 1: Server(export)}
    with guest_run(script, [export.data, export.hash], servers, tmp_path / "run") as run:
        rows = {title: {job: [read_fio(run.work / f"{prefix}-{job}-{r}.json")
                              for r in range(rounds)] for job in FIO_JOBS}
                for prefix, (_, title) in targets.items()}
        guest_kernel = re.search(r"init up after \S+ s, kernel (\S+)", run.console).group(1)
    note = (f"fio in a QEMU guest (TCG, 2 vCPUs, Debian {guest_kernel}): psync, direct, "
            "2 jobs, 3 s each, 64 MiB random image, `nbd-client -b 4096` over QEMU's user "
            "network and socat to the server's Unix socket; dm-verity reads virtio disks. "
            + (f"Median of {rounds} rounds (the three targets take turns within a round), "
               "then the lowest and highest MB/s. " if rounds > 1 else "One round. ")
            + "The link into the guest bounds the NBD rows: "
            "compare servers with each other, not with dm-verity.")
    text = render(rows, {job: title for job, (_, _, title) in FIO_JOBS.items()}, note)
    record(text, run.work / "e2e-benchmarks.md")
    print(text)
    for title, results in rows.items():
        for job, rounds_of in results.items():
            for result in rounds_of:
                assert result.bw_bytes > 0, f"{title} {job}: no bytes read"


def test_status_turns_c_like_dmsetup(images: Images, tmp_path: Path):
    """`ctl status` says V, then C after a corrupt read, when the kernel's dmsetup does."""
    middle = images.data_blocks // 2
    # Only a middle block: attaching /dev/nbd0 reads the partition table at the start.
    data = corrupt_copy(images.export.data, tmp_path / "data-corrupt.img", [middle])
    export = Export(data=data, hash=images.export.hash, root_hash=images.export.root_hash)
    control = tmp_path / "ctl.sock"
    script = f"""
nbd_attach nbd0 {PORT}
verity_open vdata vda vdb {export.root_hash} >/dev/null
host_signal attached "$(dmsetup status vdata)"
host_wait checked
echo "$(read_block nbd0 {middle}) $(read_block "$(dm_name vdata)" {middle})" >"$E2E_WORK/reads"
host_signal read "$(dmsetup status vdata)"
host_wait checked-again
verity_close vdata
nbd_detach nbd0
"""
    server = Server(export, extra_args=("--control", str(control)))
    with guest_session(script, [export.data, export.hash], {PORT: server},
                       tmp_path / "run") as guest:
        assert guest.wait_for("attached").split()[3] == "V"
        assert server_status(control) == "V"
        guest.signal("checked")
        assert guest.wait_for("read").split()[3] == "C"
        assert server_status(control) == "C"
        guest.signal("checked-again")
        run = guest.finish()
    assert run.read("reads") == "failed failed"


def server_status(control: Path) -> str:
    """V or C from `nbd-verity ctl status` on the server's control socket."""
    out = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(control), "status", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["status"]["status"]


def test_two_exports_of_one_server_by_name_equal_the_kernels_verity(images: Images,
                                                                    tmp_path: Path):
    """`serve --exports`: /dev/nbd0 and /dev/nbd1 attached by name (nbd-client -N) to one
    server, each byte for byte what the guest kernel's dm-verity gives of its image, and a
    corrupted block of the second failing on both sides while the first stays whole."""
    other = random_file(tmp_path / "other.img", 16 * 1024 * 1024, seed=7)
    second = verity_format(other, tmp_path / "other.hash")
    bad_block = 1000
    damaged = corrupt_copy(other, tmp_path / "other-corrupt.img", [bad_block])
    directory = tmp_path / "exports"
    directory.mkdir()
    for name, export, data in (("first", images.export, images.export.data),
                               ("second", second, damaged)):
        (directory / f"{name}.conf").write_text(
            f"DATA={data}\nHASH={export.hash}\nROOT_HASH={export.root_hash}\n")
    script = f"""
nbd_attach nbd0 {PORT} first
nbd_attach nbd1 {PORT} second
dm0=$(verity_open vfirst vda vdb {images.export.root_hash})
dm1=$(verity_open vsecond vdc vdd {second.root_hash})
dev_sha256 nbd0 nbd0.sha256
dev_sha256 "$dm0" dm0.sha256
block_scan nbd1 nbd1.failing
block_scan "$dm1" dm1.failing
verity_close vsecond
verity_close vfirst
nbd_detach nbd1
nbd_detach nbd0
"""
    server = Server(Export(data=directory, hash=None, root_hash=""), "nbd-verity-exports")
    disks = [images.export.data, images.export.hash, damaged, second.hash]
    with guest_run(script, disks, {PORT: server}, tmp_path / "run") as run:
        assert run.read("nbd0.sha256") == images.sha256
        assert run.read("dm0.sha256") == images.sha256
        assert failing_blocks(run, "nbd1.failing") == [bad_block]
        assert failing_blocks(run, "dm1.failing") == [bad_block]
