"""The harness itself: a failing guest fails the test loudly, with the guest's console."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from . import harness
from .guestkernel import (
    GuestKernel,
    builtin_modules,
    builtin_parameters,
    load_order,
    module_bytes,
    stored_name,
)
from .harness import GuestFailed, Server, boot_guest, guest_run
from .images import level0_hash_block, random_file, verity_format


def test_failing_scenario_raises_with_console_log(e2e_host, tmp_path: Path):
    with pytest.raises(GuestFailed) as failed:
        boot_guest("echo scenario-marker-42\nfalse\necho never-here\n", [], tmp_path)
    message = str(failed.value)
    assert "failed with status 1" in message
    assert "scenario-marker-42" in message
    assert "never-here" not in message


def test_a_guest_without_init_is_booted_once_more(e2e_host, tmp_path: Path, monkeypatch):
    # No guest reaches init in 10 ms: the first is stopped, the second runs the scenario.
    monkeypatch.setattr(harness, "INIT_TIMEOUT_S", 0.01)
    run = boot_guest("echo scenario-marker-43\n", [], tmp_path)
    assert "scenario-marker-43" in run.console
    assert harness.INIT_LINE not in (tmp_path / "console.no-init.log").read_text(errors="replace")
    assert "booted again" in harness.BOOTS[-1]


class _Interrupted(BaseException):
    """As an interrupt (Ctrl-C, a test's timeout) arrives: not an Exception."""


def test_an_interrupt_while_waiting_for_init_stops_the_guest(e2e_host, tmp_path: Path,
                                                              monkeypatch):
    # The first pause of the wait for init raises: the QEMU launched is stopped then,
    # not left running to its own timeout.
    launched = []
    launch = harness.LiveGuest._launch

    def recording_launch(guest) -> None:
        launch(guest)
        launched.append(guest._proc)

    def interrupted(_seconds: float) -> None:
        raise _Interrupted()

    monkeypatch.setattr(harness.LiveGuest, "_launch", recording_launch)
    monkeypatch.setattr(harness, "time", SimpleNamespace(monotonic=time.monotonic,
                                                         sleep=interrupted))
    with pytest.raises(_Interrupted):
        harness.LiveGuest("echo never-run\n", [], tmp_path)
    assert len(launched) == 1
    assert launched[0].poll() is not None  # stopped, and waited for
    assert not (tmp_path / "exit-status").exists()


@pytest.mark.parametrize(("data_blocks", "k", "expected"), [
    # 64 MiB: levels [128, 1]; superblock block, 1 level-1 block, then level 0.
    (16384, 0, (2, 0, 128)),
    (16384, 127, (129, 16256, 128)),
    # A partial last level-0 block covers only what is left.
    (1000, 7, (9, 896, 104)),
    # Three levels: 128*128+1 blocks -> [129, 2, 1].
    (16385, 128, (1 + 1 + 2 + 128, 16384, 1)),
])
def test_level0_hash_block(data_blocks, k, expected):
    block = level0_hash_block(data_blocks, k)
    assert (block.hash_block_index, block.first_data_block, block.data_blocks) == expected


def test_level0_hash_block_rejects_a_tree_without_level0():
    with pytest.raises(ValueError, match="no hash blocks"):
        level0_hash_block(1, 0)


def test_the_guest_reaches_only_its_servers(e2e_host, tmp_path: Path):
    """restrict=on: a listener on the host's loopback is out of the guest's reach (QEMU's
    gateway 10.0.2.2 would be the way to it), while a guestfwd port reaches its server."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    export = verity_format(random_file(tmp_path / "d.img", 1 << 20, seed=3), tmp_path / "h.img")
    script = f"""
if socat -T 3 /dev/null TCP:10.0.2.2:{port},connect-timeout=3 2>"$E2E_WORK/host.err"; then
    echo connected >"$E2E_WORK/host"
else
    echo refused >"$E2E_WORK/host"
fi
nbd_attach nbd0 10809
dev_sha256 nbd0 nbd.sha256
nbd_detach nbd0
"""
    try:
        with guest_run(script, [], {10809: Server(export)}, tmp_path / "run") as run:
            assert run.read("host") == "refused", run.read("host.err")
            assert run.read("nbd.sha256") == hashlib.sha256(export.data.read_bytes()).hexdigest()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever arrived
    finally:
        listener.close()


def fake_module(depends: str) -> bytes:
    """The smallest 64-bit ELF that guestkernel reads: a .shstrtab and a .modinfo."""
    names = b"\0.shstrtab\0.modinfo\0"
    modinfo = f"license=GPL\0depends={depends}\0".encode()
    shoff = 64 + len(names) + len(modinfo)
    shoff += -shoff % 8
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)  # entry size, count, .shstrtab's index

    def section(name: int, kind: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQ", name, kind, 0, 0, offset, size).ljust(64, b"\0")

    body = bytes(header) + names + modinfo
    return (body.ljust(shoff, b"\0") + bytes(64) + section(1, 3, 64, len(names))
            + section(11, 1, 64 + len(names), len(modinfo)))


def test_built_in_drivers_are_not_loaded_and_compressed_modules_are_unpacked(tmp_path):
    """As in Debian 13's 6.12: merged /usr, virtio_pci and nbd built in (nbd only here, for
    its parameter), modules in .ko.xz; plain .ko and .ko.gz as well."""
    version = "6.12.0-test-amd64"
    modules = tmp_path / "usr" / "lib" / "modules" / version
    (modules / "kernel" / "drivers").mkdir(parents=True)
    (modules / "modules.builtin").write_text(
        "kernel/drivers/virtio/virtio_pci.ko\nkernel/drivers/block/nbd.ko\n")
    (modules / "kernel" / "drivers" / "dm-verity.ko.xz").write_bytes(
        lzma.compress(fake_module("dm-bufio,virtio_pci"), format=lzma.FORMAT_XZ))
    (modules / "kernel" / "drivers" / "dm-bufio.ko").write_bytes(fake_module("dm-mod"))
    (modules / "kernel" / "drivers" / "dm-mod.ko.gz").write_bytes(
        gzip.compress(fake_module("")))
    kernel = GuestKernel(package=f"linux-image-{version}", version=version, root=tmp_path)
    wanted = (("virtio_pci", ""), ("nbd", "nbds_max=16 max_part=0"), ("dm-verity", ""))

    assert kernel.modules == modules
    assert builtin_modules(kernel) == {"virtio_pci", "nbd"}
    order = load_order(kernel, wanted)
    assert [stored_name(path) for path, _ in order] == ["dm-mod.ko", "dm-bufio.ko",
                                                         "dm-verity.ko"]
    assert all(module_bytes(path)[:4] == b"\x7fELF" for path, _ in order)
    assert builtin_parameters(kernel, wanted) == ["nbd.nbds_max=16", "nbd.max_part=0"]
    with pytest.raises(ValueError, match="has no module loop, built in or not"):
        load_order(kernel, (("loop", ""),))
    (modules / "kernel" / "drivers" / "ext4.ko.zst").write_bytes(b"")
    with pytest.raises(ValueError, match=r"ext4\.ko\.zst: a module compressed in a way"):
        load_order(kernel, wanted)
