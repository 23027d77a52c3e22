"""The streaming builder: its tuning knobs never change the tree, and verify's report."""

from __future__ import annotations

import mmap
import random
import threading
from pathlib import Path

import pytest

from nbd_verity.cli import main
from nbd_verity.errors import DataCorruption, HashCorruption, ImageIOError
from nbd_verity.format import builder
from nbd_verity.format.params import VerityParams
from nbd_verity.sources.source import ImageFile

from ...cli_runner import cli_runner


def make_data(path: Path, size: int, seed: int = 7) -> Path:
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


@pytest.fixture
def image(tmp_path):
    """3 MiB + 3 blocks of random data, 4096-byte blocks, 512-byte hash blocks."""
    data = make_data(tmp_path / "data", (3 << 20) + 3 * 4096)
    params = VerityParams(data_blocks=771, hash_block_size=512, salt=b"salt",
                          uuid=bytes(16)).check()
    reference = tmp_path / "reference.hash"
    root = builder.build_tree(str(data), str(reference), params)
    return data, params, reference.read_bytes(), root


def children() -> list[str]:
    """Child processes of this one that are still around (zombies included)."""
    return [pid for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()]


@pytest.mark.parametrize(("window", "workers", "may_fork"), [
    (64 << 10, 1, True),           # everything in this process
    (64 << 10, 2, True),           # this process and one forked worker
    (64 << 10, 3, True),           # workers get windows 0, 3, 6.. / 1, 4, 7.. / 2, 5, 8..
    (4096, 4, True),               # one block per window
    (64 << 10, 4, False),          # another thread runs: no fork
    (32 << 20, 4, True),           # a single window: no fork
])
def test_window_and_worker_counts_do_not_change_the_tree(
        tmp_path, image, monkeypatch, window, workers, may_fork):
    data, params, reference, root = image
    monkeypatch.setattr(builder, "WINDOW_SIZE", window)
    monkeypatch.setattr(builder, "default_workers", lambda: workers)
    monkeypatch.setattr(builder, "_may_fork", lambda: may_fork)
    out = tmp_path / "out.hash"
    assert builder.build_tree(str(data), str(out), params) == root
    assert out.read_bytes() == reference
    assert builder.verify_image(str(data), str(out), params, root).ok
    assert children() == []


def test_workers_are_forked_only_while_no_other_thread_runs():
    assert builder._may_fork()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not builder._may_fork()
    finally:
        stop.set()
        other.join()


def test_a_failing_worker_fails_the_build_and_no_process_is_left(tmp_path, image,
                                                                 monkeypatch):
    data, params, _, _ = image
    monkeypatch.setattr(builder, "WINDOW_SIZE", 64 << 10)
    monkeypatch.setattr(builder, "default_workers", lambda: 2)
    real_view = builder.WindowReader.view

    def fail_in_window_5(self, start, count):
        if start == 5 * 16:  # window 5 (16 blocks each) belongs to the forked worker
            raise ImageIOError("data: Input/output error (reading at byte 327680)")
        return real_view(self, start, count)

    monkeypatch.setattr(builder.WindowReader, "view", fail_in_window_5)
    with pytest.raises(ImageIOError, match=r"^data: Input/output error \(reading at byte "
                                           r"327680\)$"):
        builder.build_tree(str(data), str(tmp_path / "out"), params)
    assert children() == []
    assert not (tmp_path / "out").exists()


def test_a_caller_that_stops_early_leaves_no_process(image, monkeypatch):
    data, params, _, _ = image
    monkeypatch.setattr(builder, "WINDOW_SIZE", 64 << 10)
    monkeypatch.setattr(builder, "default_workers", lambda: 3)
    with ImageFile(str(data), "data") as image_file:
        chunks = builder.data_slot_chunks(image_file, params.geometry(), params.digester())
        assert next(chunks)[0] == 0
        assert len(children()) == 2
        chunks.close()
        assert children() == []


def test_images_that_cannot_be_mapped_are_read(tmp_path, image, monkeypatch):
    data, params, reference, root = image
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(builder, "WINDOW_SIZE", 1 << 20)
    out = tmp_path / "out.hash"
    assert builder.build_tree(str(data), str(out), params) == root
    assert out.read_bytes() == reference
    assert len(calls) == 1  # after the first refusal every window is read


def test_data_shorter_than_the_geometry(tmp_path):
    data = make_data(tmp_path / "data", 10 * 4096)
    params = VerityParams(data_blocks=11).check()
    with pytest.raises(ImageIOError, match="data: image ends at byte 40960, 45056 needed"):
        builder.build_tree(str(data), str(tmp_path / "hash"), params)


def test_progress_adds_up_to_the_data_size(tmp_path, image, monkeypatch):
    data, params, _, _ = image
    monkeypatch.setattr(builder, "WINDOW_SIZE", 1 << 20)
    seen = []
    builder.build_tree(str(data), str(tmp_path / "out"), params, seen.append)
    assert sum(seen) == 771 * 4096
    assert len(seen) == 4


def test_verify_reports_the_first_ten_and_counts_all(tmp_path, image):
    data, params, reference, root = image
    (tmp_path / "hash").write_bytes(reference)
    buf = bytearray(data.read_bytes())
    bad = [3, 4, 100, 200, 201, 202, 300, 400, 500, 600, 700, 769, 770]
    for block in bad:
        buf[block * 4096 + 11] ^= 1
    data.write_bytes(bytes(buf))
    report = builder.verify_image(str(data), str(tmp_path / "hash"), params, root)
    assert report.bad_count == len(bad)
    assert [e.block_index for e in report.bad] == bad[:10]
    assert all(isinstance(e, DataCorruption) for e in report.bad)


def test_a_corrupted_leaf_is_reported_instead_of_its_data_blocks(tmp_path, image):
    data, params, reference, root = image
    geo = params.geometry()
    leaf, _ = geo.slot_of(0, 40)  # the leaf holding data block 40's digest
    buf = bytearray(reference)
    buf[leaf * 512 + 3] ^= 1
    (tmp_path / "hash").write_bytes(bytes(buf))
    damaged = bytearray(data.read_bytes())
    damaged[40 * 4096] ^= 1  # under the bad leaf: cannot be judged, so not reported
    damaged[700 * 4096] ^= 1  # elsewhere: reported
    data.write_bytes(bytes(damaged))
    report = builder.verify_image(str(data), str(tmp_path / "hash"), params, root)
    assert [(type(e), e.block_index) for e in report.bad] == [
        (HashCorruption, leaf), (DataCorruption, 700)]
    assert report.bad[0].level == 0


def test_only_the_highest_bad_block_of_a_branch_is_reported(tmp_path, image):
    data, params, reference, root = image
    geo = params.geometry()  # 16 slots a hash block: levels of 49, 4 and 1 blocks
    bad_upper = geo.level_start[1] + 1  # covers leaves 16..31, data blocks 256..511
    buf = bytearray(reference)
    for block in (bad_upper, geo.level_start[0] + 20, geo.level_start[0] + 40):
        buf[block * 512 + 100] ^= 1  # leaf 20 sits under bad_upper, leaf 40 does not
    (tmp_path / "hash").write_bytes(bytes(buf))
    damaged = bytearray(data.read_bytes())
    for block in (300, 641, 700):  # under bad_upper, under leaf 40, under a good leaf
        damaged[block * 4096] ^= 1
    data.write_bytes(bytes(damaged))
    report = builder.verify_image(str(data), str(tmp_path / "hash"), params, root)
    assert [(type(e), e.block_index) for e in report.bad] == [
        (HashCorruption, bad_upper), (HashCorruption, geo.level_start[0] + 40),
        (DataCorruption, 700)]
    assert [getattr(e, "level", None) for e in report.bad] == [1, 0, None]
    assert report.bad_count == 3


def test_a_corrupted_top_block_is_the_only_report(tmp_path, image):
    data, params, reference, root = image
    top = params.geometry().level_start[-1]
    buf = bytearray(reference)
    for offset in (top * 512, len(buf) - 1):  # the top block and the last leaf
        buf[offset] ^= 1
    (tmp_path / "hash").write_bytes(bytes(buf))
    report = builder.verify_image(str(data), str(tmp_path / "hash"), params, root)
    assert [(type(e), e.block_index, e.level) for e in report.bad] == [
        (HashCorruption, top, 2)]
    assert report.bad_count == 1


def test_cli_prints_ten_blocks_then_a_count(tmp_path, image):
    data, _, reference, root = image
    hash_image = tmp_path / "hash"
    hash_image.write_bytes(reference)
    buf = bytearray(data.read_bytes())
    for block in range(13):
        buf[block * 4096] ^= 1
    data.write_bytes(bytes(buf))
    result = cli_runner().invoke(main, ["verify", str(data), str(hash_image), root.hex()])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        *(f"nbd-verity: data block {i} is corrupted" for i in range(10)),
        "nbd-verity: ... 3 more",
        "nbd-verity: verification failed: 13 corrupted block(s)"]


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_write_removes_only_a_hash_image_it_created(tmp_path, image, monkeypatch,
                                                              existed):
    data, params, _, _ = image
    out = tmp_path / "out.hash"
    if existed:
        out.write_bytes(b"kept")

    def disk_full(fd, buf, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(builder.os, "pwrite", disk_full)
    with pytest.raises(ImageIOError, match=r"out\.hash: No space left on device "
                                           r"\(writing at byte 0\)"):
        builder.build_tree(str(data), str(out), params)
    assert out.exists() == existed


def test_a_failed_read_names_the_data_image(tmp_path, image, monkeypatch):
    data, params, _, _ = image

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mmap, "mmap", broken)
    monkeypatch.setattr(builder.os, "pread", broken)
    with pytest.raises(ImageIOError, match=r"/data: Input/output error \(reading at byte 0\)"):
        builder.build_tree(str(data), str(tmp_path / "out"), params)
    assert not (tmp_path / "out").exists()
