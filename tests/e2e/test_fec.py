"""FEC against the kernel: damaged veritysetup images read over /dev/nbdN and through the
guest kernel's own dm-verity with --fec-device, in the same order, on the same bytes.

Every image is made by `veritysetup format --fec-device --fec-roots` (fecimages.py), then
damaged where the kernel's codeword arithmetic says. Each case of a boot is one image:
its data, hash and FEC files become three read-only virtio disks, opened by
`veritysetup open --fec-device --fec-roots`, and one `nbd-verity serve --fec-device
--fec-roots` reached as /dev/nbdN. Each case asserts that the kernel's answer is the one
the damage predicts (the original bytes where repairable, EIO on exactly the predicted
blocks where not), and that ours is the kernel's: no case can pass by both being wrong
alike, or by nothing being damaged.

Damage is a flip of 16 bytes of a block (bytes 0..15 unless said otherwise), so only the
codewords of those byte positions see an error; parity is changed by XOR with non-zero
bytes. The images are 8 MiB (2048 data blocks, 17 hash blocks after the superblock, so
2065 message blocks and 9 rounds for both roots 2 and roots 24).
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nbd_verity.launch import Launched

from .fecimages import FecImage, ddrescue_map, error_table, fec_format, sha256_with_zeros
from .harness import NBD_VERITY, SERVER_START_S, Export, GuestRun, Server, guest_run
from .images import BLOCK_SIZE

SIZE = 8 * 1024 * 1024
FIRST_PORT = 10840
CHUNK_BLOCKS = 1024 * 1024 // BLOCK_SIZE  # block_scan's first reads


@dataclass
class Case:
    """One image in one boot: what the guest does with it, what the damage predicts."""

    name: str
    image: FecImage
    # Guest shell run with $nbd and $dm set to the two devices' names.
    steps: str
    # Blocks block_scan_sha must find failing (EIO) on both devices; None: no scan.
    failing: list[int] | None = field(default_factory=list)
    # read_block results ("ok"/"failed") of an explicit read order, on both devices.
    reads: list[str] | None = None
    # dmsetup status's V or C, and our ctl status's, after the case's reads.
    kernel_status: str = "V"
    our_status: str = "V"
    # Data blocks that cannot be read at all: under the kernel's verity an `error`
    # segment of a device-mapper table over the data disk, under ours an NBD source
    # (nbdkit's file plugin and ddrescue filter) that fails every read touching them.
    unreadable: list[int] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        """What block_scan_sha must hash: the original data, failing blocks as zeros."""
        return sha256_with_zeros(self.image.original, self.failing or [])


def scan(chunk: int | None = None) -> str:
    tail = f" {chunk}" if chunk else ""
    return (f'block_scan_sha "$nbd" "$name.nbd"{tail}\n'
            f'block_scan_sha "$dm" "$name.dm"{tail}\n')


def read_order(blocks: list[int]) -> str:
    """read_block each of blocks in turn on /dev/nbdN, then the same on the kernel's."""
    lines = []
    for side, dev in (("nbd", "$nbd"), ("dm", "$dm")):
        words = " ".join(f'"$(read_block {dev} {b})"' for b in blocks)
        lines.append(f'echo {words} >"$E2E_WORK/$name.{side}.reads"')
    return "\n".join(lines) + "\n"


def disk_name(index: int) -> str:
    return "vd" + "abcdefghijklmnopqrstuvwxyz"[index]


def boot_script(cases: list[Case]) -> str:
    parts = []
    for i, case in enumerate(cases):
        data, hash_dev, fec = (disk_name(3 * i + j) for j in range(3))
        img = case.image
        source = close_source = ""
        if case.unreadable:
            # dm_name: the dm-N node devtmpfs made (no udev, no /dev/mapper links).
            probes = " ".join(f'"$(read_block "${data}" {b})"' for b in case.unreadable)
            source = (f'dmsetup create "$name-src" "$E2E_WORK/$name.errors"\n'
                      f'{data}=$(dm_name "$name-src")\n'
                      f'echo {probes} >"$E2E_WORK/$name.src.reads"\n')
            close_source = 'dmsetup remove "$name-src"\n'
            data = f'"${data}"'
        parts.append(f"""
name={case.name}
nbd=nbd{i}
nbd_attach "$nbd" {FIRST_PORT + i}
{source}dm=$(verity_open_fec "$name" {data} {hash_dev} {fec} {img.roots} {img.root_hash})
dmsetup table "$name" >"$E2E_WORK/$name.table"
{case.steps}
dmsetup status "$name" >"$E2E_WORK/$name.status"
verity_close "$name"
{close_source}nbd_detach "$nbd"
""")
    parts.append('dmesg >"$E2E_WORK/dmesg.txt"\n')
    return "".join(parts)


def failing_blocks(run: GuestRun, name: str) -> list[int]:
    """The blocks a block_scan_sha listed, checking that each failed with EIO."""
    failures = [tuple(map(int, line.split())) for line in run.lines(name)]
    wrong = [(index, code) for index, code in failures if code != errno.EIO]
    assert not wrong, f"{name}: blocks failed with errors other than EIO: {wrong}"
    return [index for index, _ in failures]


def ctl_status(control: Path) -> dict:
    out = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(control), "status",
                          "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["status"]


@dataclass
class Outcome:
    """What one case gave on both sides."""

    kernel_status: str  # dmsetup status's V or C, after the case's reads
    ours: dict  # our ctl status --json "status" object
    table: str
    kernel_failing: list[int] | None = None
    nbd_failing: list[int] | None = None
    kernel_sha: str | None = None
    nbd_sha: str | None = None
    kernel_reads: list[str] | None = None
    nbd_reads: list[str] | None = None


def run_cases(cases: list[Case], work: Path) -> tuple[dict[str, Outcome], str]:
    """One boot for all cases; returns each case's outcome and the guest's dmesg."""
    disks, servers = [], {}
    with ExitStack() as stack:
        for i, case in enumerate(cases):
            img = case.image
            disks += [img.data, img.hash, img.fec]
            data: Path | str = img.data
            if case.unreadable:
                data = stack.enter_context(failing_source(case, work))
                (work / f"{case.name}.errors").write_text(error_table(
                    f"/dev/{disk_name(3 * i)}", img.data.stat().st_size // 512,
                    case.unreadable))
            control = work / f"{case.name}.ctl"
            servers[FIRST_PORT + i] = Server(
                Export(data=data, hash=img.hash, root_hash=img.root_hash),
                extra_args=("--fec-device", str(img.fec), "--fec-roots", str(img.roots),
                            "--control", str(control)))
        return _boot(cases, disks, servers, work)


@contextmanager
def failing_source(case: Case, work: Path) -> Iterator[str]:
    """nbdkit serving the case's data file, failing reads of its unreadable blocks; yields
    its nbd+unix URI (started, and stopped by its pid, here)."""
    sock, pid = work / f"{case.name}-src.sock", work / f"{case.name}-src.pid"
    mapfile = ddrescue_map(work / f"{case.name}.map", case.image.data.stat().st_size,
                           case.unreadable)
    argv = ["nbdkit", "--exit-with-parent", "-f", "-r", "-U", str(sock), "--pidfile",
            str(pid), "--filter=ddrescue", "file", str(case.image.data),
            f"ddrescue-mapfile={mapfile}"]
    source = Launched(argv, socket=sock, pid_file=pid, log_path=work / f"{case.name}-src.log",
                      name=f"{case.name} source")
    with source.start(timeout=SERVER_START_S):
        yield f"nbd+unix:///?socket={sock}"


def _boot(cases: list[Case], disks: list[Path], servers: dict[int, Server],
          work: Path) -> tuple[dict[str, Outcome], str]:
    outcomes = {}
    with guest_run(boot_script(cases), disks, servers, work) as run:
        for case in cases:
            o = Outcome(kernel_status=run.read(f"{case.name}.status").split()[3],
                        ours=ctl_status(work / f"{case.name}.ctl"),
                        table=run.read(f"{case.name}.table"))
            if case.failing is not None:
                o.kernel_failing = failing_blocks(run, f"{case.name}.dm.failing")
                o.nbd_failing = failing_blocks(run, f"{case.name}.nbd.failing")
                o.kernel_sha = run.read(f"{case.name}.dm.sha256")
                o.nbd_sha = run.read(f"{case.name}.nbd.sha256")
            if case.reads is not None:
                o.kernel_reads = run.read(f"{case.name}.dm.reads").split()
                o.nbd_reads = run.read(f"{case.name}.nbd.reads").split()
            outcomes[case.name] = o
        dmesg = run.read("dmesg.txt")
    for case in cases:
        o = outcomes[case.name]
        print(f"{case.name}: kernel status {o.kernel_status}, ours {json.dumps(o.ours)}\n"
              f"  kernel failing {o.kernel_failing} reads {o.kernel_reads}\n"
              f"  nbd    failing {o.nbd_failing} reads {o.nbd_reads}\n"
              f"  predicted failing {case.failing} reads {case.reads}")
    return outcomes, dmesg


def check(case: Case, o: Outcome) -> None:
    """The kernel did what the damage predicts, and we did what the kernel did."""
    img = case.image
    assert f" fec_blocks {img.fec_blocks} " in o.table + " ", (
        f"{case.name}: the kernel's table {o.table!r} disagrees with fec_blocks "
        f"{img.fec_blocks}")
    if case.failing is not None:
        assert o.kernel_failing == case.failing, f"{case.name}: the kernel's failing blocks"
        assert o.kernel_sha == case.sha256, f"{case.name}: the kernel's bytes"
        assert o.nbd_failing == o.kernel_failing, f"{case.name}: /dev/nbdN's failing blocks"
        assert o.nbd_sha == o.kernel_sha, f"{case.name}: /dev/nbdN's bytes"
    if case.reads is not None:
        assert o.kernel_reads == case.reads, f"{case.name}: the kernel's reads"
        assert o.nbd_reads == o.kernel_reads, f"{case.name}: /dev/nbdN's reads"
    assert o.kernel_status == case.kernel_status, f"{case.name}: dmsetup status"
    assert o.ours["status"] == case.our_status, f"{case.name}: our ctl status"


def kernel_logged(dmesg: str, message: str) -> bool:
    return any(line.endswith(message) for line in dmesg.splitlines())


def test_fec_roots_2(e2e_host, tmp_path: Path):
    """roots 2: one error per codeword, or two erasures, and no more.

    r2hash pins what status says after a hash block is repaired. Observed with Debian's
    6.1.0-57: the kernel repairs level-0 hash block H (every read succeeds, the bytes are
    the original's) and yet ends with status C and logs "metadata block H is corrupted"
    (ten times, then the rate limit): its first, errors-only, attempt already looks up
    the digest of every data block of H's group (fec_read_bufs calls
    verity_hash_for_block for each, to skip zero blocks), some of those sit under H
    itself, and those nested lookups end in verity_handle_err, which counts and sets
    hash_failed. We decode errors-only without looking anything up, repair H, count no
    corruption and stay V: no read failed and nothing was wrong that was not repaired.
    Where a nested lookup of ours does fail (r2order, r2erasure: looking for erasures)
    we count a corruption as the kernel does, and both say C. r2fix and r2unread (only
    data damage, all repaired) stay V on both.
    """
    base = fec_format(tmp_path / "base", "r2", SIZE, roots=2, seed=20241201)
    work = tmp_path / "run"
    cases = []

    # First in the boot: the kernel's log of it is not held back by the rate limit of
    # the cases before.
    hashed = base.copy(work, "r2hash")
    leaf = hashed.level0(9)
    hashed.damage_hash(leaf.hash_block_index)
    cases.append(Case("r2hash", hashed, scan(), kernel_status="C", our_status="V"))

    # Repairable: one damaged data block in each of rounds 1-3 (one error per codeword,
    # errors-only), two in round 0 (two errors: repaired only as two erasures), and round
    # 4's parity smashed whole with its data intact (never needed).
    fix = base.copy(work, "r2fix")
    pair = [fix.data_group(0)[20], fix.data_group(0)[150]]
    singles = [fix.data_group(1)[40], fix.data_group(2)[100], fix.data_group(3)[200]]
    for block in pair + singles:
        fix.damage_data(block)
    fix.smash_parity(4, seed=4)
    cases.append(Case("r2fix", fix, scan()))

    # Beyond the parity: three damaged data blocks of round 5 (three erasures, roots 2),
    # and a damaged data block of round 6 whose parity is smashed whole.
    fail = base.copy(work, "r2fail")
    triple = fail.data_group(5)[30:33]
    smashed = fail.data_group(6)[60]
    for block in [*triple, smashed]:
        fail.damage_data(block)
    fail.smash_parity(6, seed=6)
    cases.append(Case("r2fail", fail, scan(), failing=sorted([*triple, smashed]),
                      kernel_status="C", our_status="C"))

    # Only data blocks are erasures: a damaged level-0 hash block H and a damaged data
    # block P of H's round, not under H. Two erasures would repair both (r2fix's pair);
    # but H is an unknown error (two parity bytes' worth) beside one erasure, P: neither
    # repairs, and every block under H fails with it.
    era = base.copy(work, "r2erasure")
    leaf = era.level0(1)
    leaf_round = era.round_of(era.message_of_hash_block(leaf.hash_block_index))
    partner = [b for b in era.data_group(leaf_round) if b not in leaf.covered][-1]
    era.damage_hash(leaf.hash_block_index)
    era.damage_data(partner)
    cases.append(Case("r2erasure", era, scan(), failing=sorted([partner, *leaf.covered]),
                      kernel_status="C", our_status="C"))

    # Read order: D and X, damaged data blocks of round 0 (repairable only as two
    # erasures), X under level-0 hash block H (damaged, repairable alone), D not. Read
    # first, D fails: X's digest is under H, whose repair is not attempted from inside
    # D's, so X is no erasure. Reading E (intact, under H) repairs H; then D repairs.
    order = base.copy(work, "r2order")
    leaf = order.level0(1)
    x = next(b for b in order.data_group(0) if b in leaf.covered)
    d = next(b for b in order.data_group(0) if b > 1024)
    e = next(b for b in leaf.covered if b != x)
    order.damage_hash(leaf.hash_block_index)
    order.damage_data(d)
    order.damage_data(x)
    cases.append(Case("r2order", order, read_order([d, e, d]) + scan(),
                      reads=["failed", "ok", "ok"], kernel_status="C", our_status="C"))

    # Unreadable data blocks (two, in distinct rounds): rebuilt from their groups.
    unread = base.copy(work, "r2unread")
    cases.append(Case("r2unread", unread, scan(),
                      unreadable=[unread.data_group(7)[50], unread.data_group(8)[180]]))

    outcomes, dmesg = run_cases(cases, work)
    for case in cases:
        check(case, outcomes[case.name])
    block = hashed.level0(9).hash_block_index
    assert kernel_logged(dmesg, f"metadata block {block} is corrupted"), dmesg
    # r2unread: both really met the read errors (the kernel's data device fails those
    # blocks when read on its own), and rebuilt the blocks.
    unread_case = cases[-1]
    src_reads = (work / f"{unread_case.name}.src.reads").read_text().split()
    assert src_reads == ["failed"] * len(unread_case.unreadable)
    ours = (work / f"server-{FIRST_PORT + len(cases) - 1}.log").read_text()
    for block in unread_case.unreadable:
        assert f"data block {block} repaired with FEC after a read error" in ours, ours


def test_fec_roots_24(e2e_host, tmp_path: Path):
    """roots 24: up to 12 errors per codeword, or 24 erasures, and no more.

    r24hash: the same status split as r2hash (kernel C, ours V, every read repaired).
    """
    base = fec_format(tmp_path / "base", "r24", SIZE, roots=24, seed=20241202)
    work = tmp_path / "run"
    cases = []

    hashed = base.copy(work, "r24hash")
    leaf = hashed.level0(4)
    hashed.damage_hash(leaf.hash_block_index)
    cases.append(Case("r24hash", hashed, scan(), kernel_status="C", our_status="V"))

    # Repairable: 24 damaged data blocks of round 0 (24 erasures, the most roots 24
    # allow), and one in each of rounds 1-3 (errors-only).
    fix = base.copy(work, "r24fix")
    many = fix.data_group(0)[100:124]
    singles = [fix.data_group(1)[40], fix.data_group(2)[100], fix.data_group(3)[200]]
    for block in many + singles:
        fix.damage_data(block)
    cases.append(Case("r24fix", fix, scan()))

    # Beyond the parity: 25 damaged data blocks of round 0, all in one 1 MiB chunk.
    # And a smashed parity fails a block whose damaged codewords are decodable: D (round
    # 2) damaged in bytes 0..15 only, round 2's parity smashed for bytes 100..199 only
    # (codewords where D is intact, now undecodable): D fails. D2 (round 3), damaged
    # alike with its parity intact, repairs; the other blocks of round 2 never need
    # their parity.
    fail = base.copy(work, "r24fail")
    chunk = 3
    in_chunk = [b for b in fail.data_group(0)
                if chunk * CHUNK_BLOCKS <= b < (chunk + 1) * CHUNK_BLOCKS]
    too_many = in_chunk[:25]
    assert len(too_many) == 25
    d, d2 = fail.data_group(2)[150], fail.data_group(3)[170]
    for block in [*too_many, d, d2]:
        fail.damage_data(block)
    fail.smash_parity(2, 100, 200, seed=2)
    cases.append(Case("r24fail", fail, scan(), failing=sorted([*too_many, d]),
                      kernel_status="C", our_status="C"))

    outcomes, dmesg = run_cases(cases, work)
    for case in cases:
        check(case, outcomes[case.name])
    assert kernel_logged(dmesg, f"metadata block {leaf.hash_block_index} is corrupted"), dmesg
