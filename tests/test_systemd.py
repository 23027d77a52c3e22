"""The systemd units in systemd/: they verify, and their ExecStart really serves.

`systemd-analyze verify` checks syntax, dependencies and that each command exists. The
shipped units name /usr/local/bin/nbd-verity; the test verifies a copy where only that path
is replaced by this checkout's entry point, and asserts nothing else changed. Then the
service's own ExecStart line, expanded as systemd would expand it, runs under
`systemd-socket-activate` and serves a veritysetup image to a libnbd client, in as much
of the unit's sandbox as this machine can set up without systemd as pid 1 (as_unit):
its account (User=, Group=: the sysusers file's, or an unused id where the account does
not exist), no capability, no new privileges, and a /proc of its own processes only,
reading the export file and the images through the group. That account cannot enter a
checkout in a private folder (root's home is 0700), so the command it runs is a copy laid
out as the package's is (staged_install): the nbd_verity package, with the required
packages the venv has and Debian's python3 does not, in a dist-packages folder, and an
entry point run by Debian's python3, in a folder anyone may traverse. `systemd-analyze
security` scores the server units' exposure.
"""

from __future__ import annotations

import compileall
import errno
import grp
import importlib.metadata
import json
import os
import pwd
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbd  # python3-libnbd, a Debian package; the venv sees system site-packages
import pytest

import nbd_verity
from nbd_verity.launch import Launched

UNITS = Path(__file__).resolve().parent.parent / "systemd"
SYSUSERS = UNITS / "nbd-verity.sysusers"  # debian/nbd-verity.sysusers is a link to it
SERVERS = ("nbd-verity@.service", "nbd-verity-exports.service")
# systemd-analyze security's overall exposure of each server unit, at most (0-10, lower
# is better): 0.6 with systemd 252 and 257; 1.6 when they ran as root with CAP_SYS_NICE.
EXPOSURE_BOUND = 0.6
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
    for unit in ("nbd-verity@.service", "nbd-verity-exports.service"):
        (stop,) = directive(unit, "ExecStop")  # the drain before SIGTERM, failure ignored
        assert stop.startswith(f"-{SHIPPED_BIN} ctl --control ") and stop.endswith(" stop")
    for unit in ("nbd-verity-attach@.service", "nbd-verity-exports-attach@.service"):
        assert directive(unit, "ExecStart")[0].startswith(f"{SHIPPED_BIN} attach ")
        # Stopping attach never detaches, and the device is not PartOf= its server.
        assert directive(unit, "ExecStop") == [] and directive(unit, "PartOf") == []
        assert directive(unit, "Type") == ["notify"]


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


def test_server_units_exposure_is_bounded(systemd_tools, tmp_path: Path):
    """Each server unit's overall exposure, as `systemd-analyze security` scores it."""
    for name in SERVERS:
        shutil.copy(UNITS / name, tmp_path / name)
        unit = tmp_path / name.replace("@.", "@demo.")
        if unit.name != name:
            (tmp_path / name).rename(unit)
        out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                              str(unit)], capture_output=True, text=True)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
        assert found, out.stdout + out.stderr
        assert float(found[1]) <= EXPOSURE_BOUND, f"{name}: exposure {found[1]}\n{out.stdout}"


def test_sysusers_makes_the_servers_account(systemd_tools, tmp_path: Path):
    """systemd-sysusers, given the package's file, makes the User= and Group= of both
    server units: a system account without a login."""
    assert (UNITS.parent / "debian" / "nbd-verity.sysusers").resolve() == SYSUSERS
    sysusers = tmp_path / "usr" / "lib" / "sysusers.d"
    sysusers.mkdir(parents=True)
    shutil.copy(SYSUSERS, sysusers / "nbd-verity.conf")
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "nbd-verity.conf"],
                   check=True, capture_output=True)
    users = {line.split(":")[0]: line.split(":") for line in
             (tmp_path / "etc" / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":")[2] for line in
              (tmp_path / "etc" / "group").read_text().splitlines()}
    for name in SERVERS:
        (user,), (group,) = directive(name, "User"), directive(name, "Group")
        entry = users[user]
        assert int(entry[2]) < 1000 and entry[6] == "/usr/sbin/nologin", entry
        assert groups[group] == entry[3]


def unit_ids(unit: str) -> tuple[int, int]:
    """The uid and gid of the unit's User= and Group=: the account's if this machine has
    it, else ids nobody has (the kernel needs no account to check permissions)."""
    (user,), (group,) = directive(unit, "User"), directive(unit, "Group")
    try:
        return pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid
    except KeyError:
        uid = next(n for n in range(64000, 65000) if not _known(pwd.getpwuid, n))
        gid = next(n for n in range(64000, 65000) if not _known(grp.getgrgid, n))
        return uid, gid


def _known(lookup, number: int) -> bool:
    try:
        lookup(number)
        return True
    except KeyError:
        return False


def as_unit(unit: str, argv: list[str]) -> list[str]:
    """argv in the unit's sandbox, as far as this machine allows without systemd as pid 1
    (PrivateUsers= and the mount namespaces are systemd's): User= and Group=,
    CapabilityBoundingSet=, NoNewPrivileges=, and a /proc mounted as ProtectProc= and
    ProcSubset= ask. exec all along: one pid."""
    uid, gid = unit_ids(unit)
    assert directive(unit, "CapabilityBoundingSet") == [""]  # none: what -all gives
    assert directive(unit, "NoNewPrivileges") == ["yes"]
    (hidepid,), (subset,) = directive(unit, "ProtectProc"), directive(unit, "ProcSubset")
    # /proc made private in the new namespace first: the new proc never reaches the
    # host's (in a chroot / is no mount point, so `--propagation private` cannot be had)
    mount = (f"mount --make-rprivate /proc && mount -t proc -o hidepid={hidepid},"
             f"subset={subset} proc /proc && exec \"$@\"")
    return ["unshare", "--mount", "--propagation", "unchanged", "--", "/bin/sh", "-c", mount,
            "sh", "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *argv]


@pytest.fixture(scope="module")
def staged_install():
    """nbd-verity installed as the package lays it out (/usr/lib/python3/dist-packages and
    /usr/bin/nbd-verity), under a 0755 folder of /var/tmp: the servers' account must read
    the code it runs, and the checkout (and its .venv) may sit where only root may go.
    The package is copied from the one under test, with its built extensions; so are the
    requirements the venv installed itself (not Debian's, which the system interpreter
    already sees). The entry point is a console script as the venv's is, run by the
    interpreter the venv was made from (Debian's python3, the one nbdkit embeds), with the
    staged dist-packages first on its path. Returns the entry point's path."""
    root = Path(tempfile.mkdtemp(prefix="nvsd-install-", dir="/var/tmp"))
    try:
        site = root / "dist-packages"
        shutil.copytree(Path(nbd_verity.__file__).resolve().parent, site / "nbd_verity",
                        ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.h", "*.o"))
        for requirement in importlib.metadata.requires("nbd-verity") or ():
            if "extra ==" in requirement:
                continue
            name = re.match(r"[A-Za-z0-9._-]+", requirement)[0]
            dist = importlib.metadata.distribution(name)
            where = Path(dist.locate_file("")).resolve()
            if not where.is_relative_to(Path(sys.prefix).resolve()):
                continue  # the system's (Debian's python3-*): the server sees it as it is
            for file in dist.files or ():
                if file.parts[0] == ".." or "__pycache__" in file.parts:
                    continue  # console scripts (bin/) and cached bytecode
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(where / file, site / file)
        # Bytecode now, as root: the account could not write it beside the sources.
        compileall.compile_dir(site, quiet=1)
        interpreter = Path(sys.executable).resolve()  # the venv's base: Debian's python3
        entry = root / "bin" / "nbd-verity"
        entry.parent.mkdir()
        entry.write_text(f"#!{interpreter}\n"
                         f"import sys\n"
                         f"sys.path.insert(0, {str(site)!r})\n"
                         f"from nbd_verity.cli import main\n"
                         f"if __name__ == '__main__':\n"
                         f"    sys.exit(main())\n")
        entry.chmod(0o755)
        subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(root)], check=True)
        yield entry
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shared_dir():
    """A folder other users may traverse (tmp_path's parents are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="nvsd-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def group_only(path: Path, gid: int, mode: int) -> Path:
    """path as the package's folder and an export file with a secret are: root's, the
    servers' group's, no one else's."""
    os.chown(path, 0, gid)
    path.chmod(mode)
    return path


def assert_runs_as_unit(pid: int, unit: str) -> None:
    """The process has the unit's ids and no capability."""
    uid, gid = unit_ids(unit)
    status = Path(f"/proc/{pid}/status").read_text()
    assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s+{uid}\s+{uid}$", status, re.M), status
    assert re.search(rf"^Gid:\s+{gid}\s+{gid}\s+{gid}\s+{gid}$", status, re.M), status
    assert re.search(r"^CapEff:\s+0+$", status, re.M), status


@pytest.fixture
def export(shared_dir: Path) -> dict[str, str]:
    """A 1 MiB random image, its veritysetup tree, and a config like /etc/nbd-verity/X.conf;
    the images readable by the servers' group alone."""
    _, gid = unit_ids("nbd-verity@.service")
    data = shared_dir / "data.img"
    data.write_bytes(random.Random(5).randbytes(256 * BLOCK))
    root_file = shared_dir / "root.txt"
    subprocess.run(["veritysetup", "format", str(data), str(shared_dir / "hash.img"),
                    f"--root-hash-file={root_file}"], check=True, capture_output=True)
    for image in (data, shared_dir / "hash.img"):
        group_only(image, gid, 0o640)
    conf = read_conf(UNITS / "nbd-verity.conf.example")
    conf.update(DATA=str(data), HASH=str(shared_dir / "hash.img"),
                ROOT_HASH=root_file.read_text().strip())
    return conf


def write_conf(path: Path, conf: dict[str, str]) -> Path:
    path.write_text("".join(f"{key}={value}\n" for key, value in conf.items()))
    return path


def unit_argv(unit: str, key: str, specifiers: dict, command: Path, conf_dir: Path,
              env=None) -> list[str]:
    """A unit's Exec line as systemd would run it, with command (staged_install's) in
    place of the shipped one and conf_dir in place of /etc/nbd-verity."""
    (line,) = directive(unit, key)
    argv = expand_exec(line, env or {}, specifiers)
    return [a.replace(SHIPPED_BIN, str(command)).replace(CONF_DIR, str(conf_dir))
            for a in argv]


def runtime_directory(runtime: Path, unit: str, name: str) -> None:
    """The unit's RuntimeDirectory= under runtime, as systemd makes it: its user's, 0700."""
    (mode,) = directive(unit, "RuntimeDirectoryMode")
    path = runtime / "nbd-verity" / name
    path.mkdir(parents=True)
    os.chown(path, *unit_ids(unit))
    path.chmod(int(mode, 8))


def conf_folder(parent: Path, unit: str) -> Path:
    """A folder like the package's /etc/nbd-verity: 0750 root:nbd-verity."""
    conf_dir = parent / "etc"
    conf_dir.mkdir()
    return group_only(conf_dir, unit_ids(unit)[1], 0o750)


def test_socket_activated_service_serves(systemd_tools, staged_install, export,
                                         shared_dir: Path):
    unit = "nbd-verity@.service"
    data = Path(export["DATA"])
    # Corrupt block 9 after formatting: the served image no longer matches its tree.
    with open(data, "r+b") as f:
        f.seek(9 * BLOCK)
        f.write(b"\xff" * 16)
    runtime = shared_dir / "run"
    runtime_directory(runtime, unit, "demo")
    specifiers = {"i": "demo", "t": str(runtime), "%": "%"}
    conf_dir = conf_folder(shared_dir, unit)
    # serve reads it itself (--export-file); 0640 root:nbd-verity, as one with a secret
    group_only(write_conf(conf_dir / "demo.conf", export), unit_ids(unit)[1], 0o640)
    argv = as_unit(unit, unit_argv(unit, "ExecStart", specifiers, staged_install, conf_dir))
    (listen,) = directive("nbd-verity@.socket", "ListenStream")
    sock = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], listen)
    control = runtime / "nbd-verity" / "demo" / "ctl.sock"
    # systemd-socket-activate execs the service on the first connection (the readiness
    # probe's); ready when the exec'd nbdkit's control socket answers (after_fork).
    server = Launched(["systemd-socket-activate", "-l", sock, "-E", "PATH", *argv],
                      socket=sock, control=control, log_path=shared_dir / "server.log",
                      env=os.environ)
    with server.start(timeout=30):
        h = nbd.NBD()
        h.connect_unix(sock)
        # The exec chain kept one pid: nbdkit's LISTEN_PID check passed.
        assert Path(f"/proc/{server.pid}/comm").read_text().strip() == "nbdkit"
        assert_runs_as_unit(server.pid, unit)
        # nbdkit runs the staged package's plugin, not the checkout's.
        plugin = str(staged_install.parent.parent / "dist-packages" / "nbd_verity")
        assert plugin in Path(f"/proc/{server.pid}/cmdline").read_text(), plugin
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


def test_socket_activated_exports_service_serves_each_by_name(systemd_tools, staged_install,
                                                              shared_dir: Path):
    """nbd-verity-exports.service as systemd runs it, on a directory of two export files;
    its ExecReload (as the unit's user too) adds a third; each reads back its own image
    by name."""
    unit = "nbd-verity-exports.service"
    conf_dir = conf_folder(shared_dir, unit)
    images = {}
    for n, name in enumerate(("alpha", "beta", "gamma")):
        data = shared_dir / f"{name}.img"
        data.write_bytes(random.Random(n).randbytes(64 * BLOCK))
        root_file = shared_dir / f"{name}.root"
        subprocess.run(["veritysetup", "format", str(data), str(shared_dir / f"{name}.hash"),
                        f"--root-hash-file={root_file}"], check=True, capture_output=True)
        images[name] = {"DATA": str(data), "HASH": str(shared_dir / f"{name}.hash"),
                        "ROOT_HASH": root_file.read_text().strip()}
        for image in (data, shared_dir / f"{name}.hash"):  # veritysetup's hash: 0600
            group_only(image, unit_ids(unit)[1], 0o640)
    for name in ("alpha", "beta"):
        write_conf(conf_dir / f"{name}.conf", images[name])
    runtime = shared_dir / "run"
    runtime_directory(runtime, unit, "exports")
    specifiers = {"t": str(runtime), "%": "%"}
    argv = as_unit(unit, unit_argv(unit, "ExecStart", specifiers, staged_install, conf_dir))
    (listen,) = directive("nbd-verity-exports.socket", "ListenStream")
    sock = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], listen)
    control = runtime / "nbd-verity" / "exports" / "ctl.sock"
    server = Launched(["systemd-socket-activate", "-l", sock, "-E", "PATH", *argv],
                      socket=sock, control=control, log_path=shared_dir / "server.log",
                      env=os.environ)
    with server.start(timeout=30):
        assert_runs_as_unit(server.pid, unit)
        write_conf(conf_dir / "gamma.conf", images["gamma"])
        reload = as_unit(unit, unit_argv(unit, "ExecReload", specifiers, staged_install,
                                         conf_dir))
        done = subprocess.run(reload, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "gamma" in done.stdout, done
        for name, image in images.items():
            h = nbd.NBD()
            h.set_export_name(name)
            h.connect_unix(sock)
            assert h.pread(64 * BLOCK, 0) == Path(image["DATA"]).read_bytes()
            h.shutdown()
        (attach,) = directive("nbd-verity-exports-attach@.service", "ExecStart")
        assert "nbd+unix:///%i?socket=%t/nbd-verity/exports.sock" in attach
