"""One server, many verified images: `nbd-verity serve --exports DIR`, real nbdkit, real
clients (libnbd, nbdinfo). Every image's tree comes from veritysetup."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import nbd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..pki import make_identity
from .serverlib import (
    MIB,
    NBD_VERITY,
    connect,
    control_request,
    error_number,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    wait_for,
)

NBDINFO = "/usr/bin/nbdinfo"
SIZE = 2 * MIB


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Three images of different contents; 'same' is 'one''s data with another tree."""
    base = tmp_path_factory.mktemp("exports-images")
    made = {name: make_image(base / name, random_bytes(40 + i, SIZE))
            for i, name in enumerate(("one", "two", "three"))}
    made["same"] = make_image(base / "same", made["one"].expected(),
                              "--salt=" + "ab" * 32)  # same bytes, another tree and root
    return made


def write_export(directory: Path, name: str, image, args: str = "") -> Path:
    path = directory / f"{name}.conf"
    tmp = directory / f".{name}.tmp"
    tmp.write_text(f"DATA={image.data}\nHASH={image.hash}\nROOT_HASH={image.root}\n"
                   f"ARGS={args}\n")
    os.replace(tmp, path)  # as an admin's editor or config tool would: whole
    return path


@pytest.fixture
def exports_dir(tmp_path, images):
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "one", images["one"])
    write_export(directory, "two", images["two"])
    return directory


@pytest.fixture
def served(exports_dir, servers, sockdir):
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(exports_dir), "--control", control])
    server.control = control
    return server


def read_all(h) -> bytes:
    return b"".join(h.pread(256 << 10, o) for o in range(0, h.get_size(), 256 << 10))


def exports(server) -> dict:
    reply = control_request(server.control, {"cmd": "exports"})
    return {item["name"]: item for item in reply["exports"]}


def reload(server) -> dict:
    return control_request(server.control, {"cmd": "exports", "reload": True})["reload"]


def test_every_export_reads_back_its_own_image(served, images):
    for name in ("one", "two"):
        h = connect(served, name)
        assert h.get_size() == SIZE
        assert read_all(h) == images[name].expected()
    h = connect(served, "two@idle")  # NAME@CLASS still picks a class (not above be)
    assert h.pread(4096, 0) == images["two"].expected(0, 4096)
    stats = control_request(served.control, {"cmd": "stats", "export": "two"})["stats"]
    assert stats["classes"]["idle"]["inline"]["requests"] + \
        stats["classes"]["idle"]["pool"]["requests"] >= 1


def test_listing_is_refused_unless_the_server_allows_it(served):
    """NBD_OPT_LIST is answered only with --list-exports (nbd-server's allowlist): by
    default nbdinfo --list gets an error and no name, while a name still connects."""
    run = subprocess.run([NBDINFO, "--list", "--json", served.uri], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode != 0 and "one" not in run.stdout, run
    assert "list" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert read_all(connect(served, "one"))
    assert "listing exports is off (serve --list-exports turns it on)" in served.log()


def test_nbdinfo_lists_every_export_with_a_description(exports_dir, servers, images):
    listing = servers.serve_cli(["--exports", str(exports_dir), "--list-exports"])
    run = subprocess.run([NBDINFO, "--list", "--json", listing.uri], capture_output=True,
                         text=True, timeout=60, check=True)
    listed = {e["export-name"]: e for e in json.loads(run.stdout)["exports"]}
    assert sorted(listed) == ["one", "two"]
    for name in listed:
        assert listed[name]["export-size"] == SIZE
        description = listed[name]["description"]
        assert f"root hash {images[name].root[:16]}" in description, description
        assert "unsigned" in description


def test_an_unknown_name_is_refused_in_the_handshake(served):
    """The server answers NBD_OPT_GO with ENOENT and keeps the connection: the same
    client then picks a name that is served."""
    h = nbd.NBD()
    served.handles.append(h)
    h.set_opt_mode(True)
    h.connect_unix(served.socket)
    h.set_export_name("nope")
    with pytest.raises(nbd.Error) as caught:
        h.opt_go()
    assert error_number(caught.value) == errno.ENOENT, caught.value
    h.set_export_name("one")
    h.opt_go()
    assert h.get_size() == SIZE
    run = subprocess.run([NBDINFO, f"nbd+unix:///nope?socket={served.socket}"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode != 0 and "No such file or directory" in run.stderr, run.stderr


def test_corruption_in_one_export_fails_only_its_own_block(tmp_path, images, servers,
                                                           sockdir):
    directory = tmp_path / "exports"
    directory.mkdir()
    damaged = images["two"].copy(tmp_path / "two")
    flip_byte(damaged.data, 5 * 4096 + 7)  # data block 5
    write_export(directory, "one", images["one"])
    write_export(directory, "two", damaged)
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control])
    server.control = control
    two, one = connect(server, "two"), connect(server, "one")
    expect_eio(two, 4096, 5 * 4096)
    assert two.pread(4096, 4 * 4096) == damaged.expected(4 * 4096, 4096)
    assert read_all(one) == images["one"].expected()
    listing = exports(server)
    assert (listing["one"]["status"], listing["one"]["corruptions"]) == ("V", 0)
    assert (listing["two"]["status"], listing["two"]["corruptions"]) == ("C", 1)


def test_same_data_image_with_two_trees(tmp_path, images, servers, sockdir):
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "a", images["one"])
    write_export(directory, "b", images["same"])
    server = servers.serve_cli(["--exports", str(directory)])
    for name in ("a", "b"):
        assert read_all(connect(server, name)) == images["one"].expected()


def bad_files(directory: Path, images, signer) -> dict[str, str]:
    """Export files that must each be refused, and a word of each one's line."""
    good = images["one"]
    (directory / "missing.conf").write_text(f"DATA={directory}/nothing.img\n"
                                            f"HASH={good.hash}\nROOT_HASH={good.root}\n")
    wrong = good.root[:-1] + ("0" if good.root[-1] != "0" else "1")
    (directory / "wrongroot.conf").write_text(f"DATA={good.data}\nHASH={good.hash}\n"
                                              f"ROOT_HASH={wrong}\n")
    bad_sig = directory / "bad.p7s"
    bad_sig.write_bytes(b"0\x03\x02\x01\x00")
    (directory / "badsig.conf").write_text(
        f"DATA={good.data}\nHASH={good.hash}\nROOT_HASH={good.root}\n"
        f"ARGS=--root-hash-signature {bad_sig} --trusted-certs {signer.cert}\n")
    os.mkfifo(directory / "fifo.conf")
    (directory / "dir.conf").mkdir()
    (directory / "server.conf").write_text(f"DATA={good.data}\nHASH={good.hash}\n"
                                           f"ROOT_HASH={good.root}\nARGS=--workers 2\n")
    return {"missing": "No such file", "wrongroot": "does not match",
            "badsig": "--trusted-certs is the server's", "fifo": "not a regular file",
            "dir": "not a regular file", "server": "--workers is the server's"}


def test_bad_export_files_are_refused_and_the_others_serve(served, exports_dir, images,
                                                           tmp_path):
    signer = make_identity(tmp_path, "exports-signer")
    expected = bad_files(exports_dir, images, signer)
    h = connect(served, "one")
    report = reload(served)
    refused = {Path(path).name.removesuffix(".conf"): why
               for path, why in report["refused"].items()}
    assert sorted(refused) == sorted(expected)
    for name, word in expected.items():
        assert word in refused[name], (name, refused[name])
        assert "\n" not in refused[name]
    assert sorted(exports(served)) == ["one", "two"]
    assert read_all(h) == images["one"].expected()
    ctl = subprocess.run([str(NBD_VERITY), "ctl", "--control", served.control, "exports",
                          "reload"], capture_output=True, text=True, timeout=60, check=False)
    assert ctl.returncode == 1 and "6 export file(s) refused" in ctl.stderr, ctl
    assert "Traceback" not in ctl.stderr + ctl.stdout


def test_add_change_remove_under_load(served, exports_dir, images):
    """A client of `one` reads all the time; `three` is added, `two` changed to another
    image, then `three` removed. No read of `one` fails, a changed export's connected
    client keeps its image, and a removed export refuses new clients at once."""
    failures: list[str] = []
    stop = threading.Event()
    reads = [0]

    def reader():
        h = nbd.NBD()
        h.set_export_name("one")
        h.connect_unix(served.socket)
        expected = images["one"].expected()
        while not stop.is_set():
            for offset in range(0, SIZE, 128 << 10):
                try:
                    if h.pread(128 << 10, offset) != expected[offset:offset + (128 << 10)]:
                        failures.append(f"wrong bytes at {offset}")
                except nbd.Error as e:
                    failures.append(f"{offset}: {e}")
                reads[0] += 1
        h.shutdown()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_for(lambda: reads[0] > 20, "reads of one")
        old_two = connect(served, "two")
        write_export(exports_dir, "three", images["three"])
        assert reload(served)["added"] == ["three"]
        three = connect(served, "three")
        assert read_all(three) == images["three"].expected()

        write_export(exports_dir, "two", images["same"])  # `two` now serves another image
        assert reload(served)["changed"] == ["two"]
        assert read_all(connect(served, "two")) == images["one"].expected()
        assert read_all(old_two) == images["two"].expected()  # its client keeps its own

        (exports_dir / "three.conf").unlink()
        assert reload(served)["removed"] == ["three"]
        with pytest.raises(nbd.Error):
            connect(served, "three")
        assert three.pread(4096, 0) == images["three"].expected(0, 4096)  # still served
        wait_for(lambda: reads[0] > 200, "more reads of one")
    finally:
        stop.set()
        thread.join(60)
    assert failures == []
    assert sorted(exports(served)) == ["one", "two"]


def test_stats_and_metrics_carry_the_export(served, images):
    read_all(connect(served, "one"))
    text = subprocess.run([str(NBD_VERITY), "ctl", "--control", served.control, "metrics"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    families = {f.name: f for f in text_string_to_metric_families(text)}
    verified = {s.labels["export"]: s.value
                for s in families["nbd_verity_data_blocks_verified"].samples}
    assert verified["one"] >= SIZE // 4096 and verified["two"] == 0
    stats = control_request(served.control, {"cmd": "stats"})["stats"]
    assert sorted(stats["exports"]) == ["one", "two"]
    assert stats["exports"]["one"]["totals"]["data_blocks_verified"] >= SIZE // 4096
    shown = subprocess.run([str(NBD_VERITY), "ctl", "--control", served.control, "stats"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "export one" in shown and "export two" in shown


def test_thresholds_are_the_servers_for_every_export(served):
    control_request(served.control, {"cmd": "thresholds", "set": {"be": 0}})
    connect(served, "one").pread(8192, 0)
    connect(served, "two").pread(8192, 0)
    stats = control_request(served.control, {"cmd": "stats"})["stats"]
    for name in ("one", "two"):
        assert stats["exports"][name]["thresholds"]["be"] == 0
        assert stats["exports"][name]["classes"]["be"]["pool"]["requests"] >= 1


def test_export_file_alone_as_the_template_units_serve_it(images, servers, tmp_path):
    path = write_export(tmp_path, "solo", images["two"], "--cache-size 4M --workers 1")
    server = servers.serve_cli(["--export-file", str(path)])
    h = server.connect()
    assert read_all(h) == images["two"].expected()
