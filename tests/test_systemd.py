"""The systemd units in systemd/: they verify, and their ExecStart really serves.

`systemd-analyze verify` checks syntax, dependencies and that each command exists. The
shipped units name /usr/local/bin/nbd-verity; the test verifies a copy where only that path
is replaced by this checkout's entry point, and asserts nothing else changed. Then the
service's own ExecStart line, expanded as systemd would expand it, runs under
`systemd-socket-activate` and serves a veritysetup image to a libnbd client.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbd  # python3-libnbd, a Debian package; the venv sees system site-packages
import pytest

from nbd_verity.launch import Launched

UNITS = Path(__file__).resolve().parent.parent / "systemd"
UNIT_FILES = ("nbd-verity@.service", "nbd-verity@.socket", "nbd-verity-attach@.service",
              "nbd-verity-exports.service", "nbd-verity-exports.socket",
              "nbd-verity-exports-attach@.service")
CONF_DIR = "/etc/nbd-verity"
SHIPPED_BIN = "/usr/local/bin/nbd-verity"
NBD_VERITY = Path(sys.executable).parent / "nbd-verity"
BLOCK = 4096


@pytest.fixture(scope="module")
def systemd_tools() -> None:
    """systemd-analyze and systemd-socket-activate (Debian package systemd), installed once."""
    if shutil.which("systemd-analyze") and shutil.which("systemd-socket-activate"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "systemd"],
                   check=True, env=env)


def unit_lines(name: str) -> list[str]:
    return (UNITS / name).read_text().splitlines()


def directive(name: str, key: str) -> list[str]:
    """Every value of key= in unit name (no continuation lines are used in ours)."""
    return [line.split("=", 1)[1] for line in unit_lines(name) if line.startswith(f"{key}=")]


def test_units_name_the_installed_paths():
    for unit in ("nbd-verity@.service", "nbd-verity-exports.service"):
        assert directive(unit, "ExecStart")[0].startswith(f"{SHIPPED_BIN} serve ")
    for unit in ("nbd-verity-attach@.service", "nbd-verity-exports-attach@.service"):
        for key in ("ExecStart", "ExecStop"):
            assert directive(unit, key)[0].startswith("/usr/sbin/nbd-client ")


def test_units_verify(systemd_tools, tmp_path: Path):
    for name in UNIT_FILES:
        text = (UNITS / name).read_text()
        copy = text.replace(SHIPPED_BIN, str(NBD_VERITY))
        # Only the one path differs from what ships.
        assert copy.replace(str(NBD_VERITY), SHIPPED_BIN) == text
        (tmp_path / name).write_text(copy)
    instances = [str(tmp_path / name.replace("@.", "@demo.")) for name in UNIT_FILES
                 if "@" in name]
    instances += [str(tmp_path / name) for name in UNIT_FILES if "@" not in name]
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *instances],
                         capture_output=True, text=True)
    # verify exits 0 on mere warnings (e.g. an unknown key): any output is a failure too.
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_every_unit_line_is_known(systemd_tools, tmp_path: Path):
    """verify must catch a bad key; otherwise test_units_verify proves nothing."""
    bad = (UNITS / "nbd-verity@.service").read_text().replace(SHIPPED_BIN, str(NBD_VERITY))
    (tmp_path / "nbd-verity@.service").write_text(bad + "ProtectEverything=yes\n")
    shutil.copy(UNITS / "nbd-verity@.socket", tmp_path)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          str(tmp_path / "nbd-verity@demo.service")],
                         capture_output=True, text=True)
    assert "Unknown key 'ProtectEverything'" in out.stderr


def expand_exec(line: str, env: dict[str, str], specifiers: dict[str, str]) -> list[str]:
    """An Exec*= line as systemd runs it: %-specifiers, then ${VAR} (one word) and $VAR
    (split on whitespace) from env. Only the forms our units use."""
    line = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], line)
    argv = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", word)
        if whole and whole.group(2):
            argv += env.get(whole.group(2), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def read_conf(path: Path) -> dict[str, str]:
    """An EnvironmentFile: KEY=value lines, # comments."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def test_example_conf_names_every_variable():
    conf = read_conf(UNITS / "nbd-verity.conf.example")
    used = set()
    for name in UNIT_FILES:
        for line in unit_lines(name):
            if line.startswith("Exec"):
                used |= set(re.findall(r"\$\{?(\w+)\}?", line))
    assert used <= set(conf), f"undocumented: {used - set(conf)}"


@pytest.fixture
def export(tmp_path: Path) -> dict[str, str]:
    """A 1 MiB random image, its veritysetup tree, and a config like /etc/nbd-verity/X.conf."""
    data = tmp_path / "data.img"
    data.write_bytes(random.Random(5).randbytes(256 * BLOCK))
    root_file = tmp_path / "root.txt"
    subprocess.run(["veritysetup", "format", str(data), str(tmp_path / "hash.img"),
                    f"--root-hash-file={root_file}"], check=True, capture_output=True)
    conf = read_conf(UNITS / "nbd-verity.conf.example")
    conf.update(DATA=str(data), HASH=str(tmp_path / "hash.img"),
                ROOT_HASH=root_file.read_text().strip())
    return conf


def write_conf(path: Path, conf: dict[str, str]) -> Path:
    path.write_text("".join(f"{key}={value}\n" for key, value in conf.items()))
    return path


def unit_argv(unit: str, key: str, specifiers: dict, conf_dir: Path, env=None) -> list[str]:
    """A unit's Exec line as systemd would run it, with this checkout's command and
    conf_dir in place of /etc/nbd-verity."""
    (line,) = directive(unit, key)
    argv = expand_exec(line, env or {}, specifiers)
    return [a.replace(SHIPPED_BIN, str(NBD_VERITY)).replace(CONF_DIR, str(conf_dir))
            for a in argv]


def test_socket_activated_service_serves(systemd_tools, export, tmp_path: Path):
    data = Path(export["DATA"])
    # Corrupt block 9 after formatting: the served image no longer matches its tree.
    with open(data, "r+b") as f:
        f.seek(9 * BLOCK)
        f.write(b"\xff" * 16)
    runtime = tmp_path / "run"
    (runtime / "nbd-verity" / "demo").mkdir(parents=True)  # the unit's RuntimeDirectory
    specifiers = {"i": "demo", "t": str(runtime), "%": "%"}
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    write_conf(conf_dir / "demo.conf", export)  # serve reads it itself (--export-file)
    argv = unit_argv("nbd-verity@.service", "ExecStart", specifiers, conf_dir)
    (listen,) = directive("nbd-verity@.socket", "ListenStream")
    sock = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], listen)
    control = runtime / "nbd-verity" / "demo" / "ctl.sock"
    # systemd-socket-activate execs the service on the first connection (the readiness
    # probe's); ready when the exec'd nbdkit's control socket answers (after_fork).
    server = Launched(["systemd-socket-activate", "-l", sock, "-E", "PATH", *argv],
                      socket=sock, control=control, log_path=tmp_path / "server.log",
                      env=os.environ)
    with server.start(timeout=30):
        h = nbd.NBD()
        h.connect_unix(sock)
        # The exec chain kept one pid: nbdkit's LISTEN_PID check passed.
        assert Path(f"/proc/{server.pid}/comm").read_text().strip() == "nbdkit"
        expected = data.read_bytes()
        assert h.pread(9 * BLOCK, 0) == expected[:9 * BLOCK]
        assert h.pread(246 * BLOCK, 10 * BLOCK) == expected[10 * BLOCK:]
        with pytest.raises(nbd.Error) as failed:
            h.pread(BLOCK, 9 * BLOCK)
        assert failed.value.errnum == errno.EIO
        h.shutdown()
        status = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(control), "status",
                                 "--json"], check=True, capture_output=True, text=True).stdout
        assert json.loads(status)["status"]["status"] == "C"


def test_socket_activated_exports_service_serves_each_by_name(systemd_tools, tmp_path: Path):
    """nbd-verity-exports.service as systemd runs it, on a directory of two export files;
    its ExecReload adds a third; each reads back its own image by name."""
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    images = {}
    for n, name in enumerate(("alpha", "beta", "gamma")):
        data = tmp_path / f"{name}.img"
        data.write_bytes(random.Random(n).randbytes(64 * BLOCK))
        root_file = tmp_path / f"{name}.root"
        subprocess.run(["veritysetup", "format", str(data), str(tmp_path / f"{name}.hash"),
                        f"--root-hash-file={root_file}"], check=True, capture_output=True)
        images[name] = {"DATA": str(data), "HASH": str(tmp_path / f"{name}.hash"),
                        "ROOT_HASH": root_file.read_text().strip()}
    for name in ("alpha", "beta"):
        write_conf(conf_dir / f"{name}.conf", images[name])
    runtime = tmp_path / "run"
    (runtime / "nbd-verity" / "exports").mkdir(parents=True)
    specifiers = {"t": str(runtime), "%": "%"}
    argv = unit_argv("nbd-verity-exports.service", "ExecStart", specifiers, conf_dir)
    (listen,) = directive("nbd-verity-exports.socket", "ListenStream")
    sock = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], listen)
    control = runtime / "nbd-verity" / "exports" / "ctl.sock"
    server = Launched(["systemd-socket-activate", "-l", sock, "-E", "PATH", *argv],
                      socket=sock, control=control, log_path=tmp_path / "server.log",
                      env=os.environ)
    with server.start(timeout=30):
        write_conf(conf_dir / "gamma.conf", images["gamma"])
        reload = unit_argv("nbd-verity-exports.service", "ExecReload", specifiers, conf_dir)
        done = subprocess.run(reload, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "gamma" in done.stdout, done
        for name, image in images.items():
            h = nbd.NBD()
            h.set_export_name(name)
            h.connect_unix(sock)
            assert h.pread(64 * BLOCK, 0) == Path(image["DATA"]).read_bytes()
            h.shutdown()
        (attach,) = directive("nbd-verity-exports-attach@.service", "ExecStart")
        assert " -N %i " in attach and "%t/nbd-verity/exports.sock" in attach
