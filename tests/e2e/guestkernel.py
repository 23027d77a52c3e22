"""The guest's kernel and initramfs: Debian's own kernel, unpacked, never installed.

The kernel package is the one Debian's `linux-image-amd64` depends on (6.1.0-N-amd64 on
Debian 12, 6.12.N+deb13-amd64 on Debian 13). `apt-get download` fetches it once into a
cache folder and `dpkg-deb -x` unpacks it there; the host's /boot and /lib/modules are
never touched. The initramfs is built from that tree: busybox-static, the modules a run
needs with their dependencies (read from each module's own .modinfo section, since the
host has no depmod), and guest/initramfs-init.sh as /init, which loads them, mounts the
host's root over 9p read-only and hands over to guest/init.sh.

What the kernel builds in (`modules.builtin`: 6.12 builds virtio_pci, virtio and
virtio_ring in, which 6.1 ships as modules) is not loaded; a built-in's parameters go on
the kernel command line as `name.key=value` instead. Modules compressed by the package
(6.12's `.ko.xz`; 6.1's are plain `.ko`) are stored decompressed, since busybox's insmod
hands the kernel the file's bytes as they are.

Both are cached, keyed by the kernel package and by what went into the initramfs, so a
machine downloads the kernel once (about 70 MB) and later runs start at once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

GUEST_DIR = Path(__file__).resolve().parent / "guest"
CACHE_ENV = "NBD_VERITY_E2E_CACHE"
DEFAULT_CACHE = Path("/var/cache/nbd-verity/e2e")
BUSYBOX = Path("/bin/busybox")

# Modules the guest loads, in this order; each one's dependencies come first. Parameters
# are given here, where the harness decides them.
MODULES: tuple[tuple[str, str], ...] = (
    ("virtio_pci", ""),
    ("virtio_blk", ""),
    ("virtio_net", ""),
    ("9pnet_virtio", ""),
    ("9p", ""),
    ("nbd", "nbds_max=16"),
    ("dm-verity", ""),
    ("ext4", ""),
    # ext4 asks the crypto API for "crc32c" at mount; nothing in the guest can modprobe.
    ("crc32c_generic", ""),
    ("loop", ""),
)


@dataclass(frozen=True)
class GuestKernel:
    """An unpacked kernel package: its image, its modules folder and its version."""

    package: str
    version: str
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def modules(self) -> Path:
        """lib/modules/VERSION, under usr/ in a merged-/usr package (Debian 13's)."""
        for base in (self.root / "lib", self.root / "usr" / "lib"):
            if (base / "modules" / self.version).is_dir():
                return base / "modules" / self.version
        return self.root / "lib" / "modules" / self.version

    @property
    def config(self) -> Path:
        return self.root / "boot" / f"config-{self.version}"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _apt(argv: list[str], cwd: Path | None = None) -> str:
    """An apt command's output; on failure, once more after `apt-get update` (a machine
    whose package lists are missing or stale)."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"e2e: {' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def kernel_package() -> str:
    """The linux-image-6.1.0-N-amd64 package that linux-image-amd64 depends on."""
    out = _apt(["apt-cache", "depends", "linux-image-amd64"])
    for line in out.splitlines():
        word = line.strip()
        if word.startswith("Depends: linux-image-"):
            return word.split()[1]
    raise RuntimeError(f"e2e: linux-image-amd64 depends on no linux-image package:\n{out}")


def ensure_kernel(cache: Path | None = None) -> GuestKernel:
    """The guest kernel, downloaded and unpacked into the cache on first use."""
    cache = cache or cache_dir()
    package = kernel_package()
    root = cache / package
    version = package.removeprefix("linux-image-")
    done = root / ".unpacked"
    if not done.exists():
        cache.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            # apt-get download writes into the current folder; as root it warns that _apt
            # cannot reach it, which is harmless.
            _apt(["apt-get", "download", "-q", package], cwd=Path(tmp))
            (deb,) = Path(tmp).glob("*.deb")
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        done.write_text(package + "\n")
    kernel = GuestKernel(package=package, version=version, root=root)
    if not kernel.vmlinuz.exists():
        raise RuntimeError(f"e2e: {kernel.vmlinuz} missing from {package}")
    return kernel


def kernel_config(kernel: GuestKernel, name: str) -> str | None:
    """The value of CONFIG_name in the kernel's config (y, m, a string), or None."""
    for line in kernel.config.read_text().splitlines():
        if line.startswith(f"CONFIG_{name}="):
            return line.split("=", 1)[1]
    return None


MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz")  # plain, and as Debian's kernels compress


def module_name(filename: str) -> str | None:
    """The module name of a file name (dashes as underscores), or None if not a module."""
    for suffix in MODULE_SUFFIXES:
        if filename.endswith(suffix):
            return filename.removesuffix(suffix).replace("-", "_")
    return None


def module_paths(kernel: GuestKernel) -> dict[str, Path]:
    """Every module file of the kernel by its module name."""
    paths = {}
    for path in (kernel.modules / "kernel").rglob("*.ko*"):
        name = module_name(path.name)
        if name is None:
            raise ValueError(f"{path}: a module compressed in a way the harness cannot read")
        paths[name] = path
    return paths


def builtin_modules(kernel: GuestKernel) -> frozenset[str]:
    """The modules the kernel has built in, from its `modules.builtin` (may be absent)."""
    listing = kernel.modules / "modules.builtin"
    if not listing.exists():
        return frozenset()
    return frozenset(filter(None, (module_name(Path(line.strip()).name)
                                   for line in listing.read_text().splitlines())))


def module_bytes(path: Path) -> bytes:
    """A module file's ELF bytes, decompressed where the package compressed it."""
    if path.name.endswith(".xz"):
        return lzma.decompress(path.read_bytes())
    if path.name.endswith(".gz"):
        return gzip.decompress(path.read_bytes())
    return path.read_bytes()


def stored_name(path: Path) -> str:
    """The name a module has in the initramfs: always a plain .ko."""
    return path.name.removesuffix(".xz").removesuffix(".gz")


def modinfo_depends(path: Path) -> list[str]:
    """The `depends=` field of a module's .modinfo ELF section."""
    data = module_bytes(path)
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        end = data.index(b"\0", str_off + name)
        if data[str_off + name:end] == b".modinfo":
            for field in data[offset:offset + size].split(b"\0"):
                if field.startswith(b"depends="):
                    value = field[len(b"depends="):].decode()
                    return [d.replace("-", "_") for d in value.split(",") if d]
            return []
    raise ValueError(f"{path}: no .modinfo section")


def load_order(kernel: GuestKernel, wanted=MODULES) -> list[tuple[Path, str]]:
    """(module file, parameters) for wanted and their dependencies, dependencies first;
    built-in ones are left out (builtin_parameters gives their parameters)."""
    paths = module_paths(kernel)
    builtin = builtin_modules(kernel)
    order: list[tuple[Path, str]] = []
    seen: set[str] = set()

    def visit(name: str, params: str, stack: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        if name in seen or name in builtin:
            return
        if name in stack:
            raise ValueError(f"module dependency loop: {' -> '.join((*stack, name))}")
        if name not in paths:
            raise ValueError(f"{kernel.package} has no module {name}, built in or not")
        for dep in modinfo_depends(paths[name]):
            visit(dep, "", (*stack, name))
        seen.add(name)
        order.append((paths[name], params))

    for name, params in wanted:
        visit(name, params, ())
    return order


def builtin_parameters(kernel: GuestKernel, wanted=MODULES) -> list[str]:
    """Kernel command-line words (`name.key=value`) for the parameters of wanted modules
    that the kernel has built in, where insmod cannot pass them."""
    builtin = builtin_modules(kernel)
    return [f"{name.replace('-', '_')}.{param}" for name, params in wanted
            if name.replace("-", "_") in builtin for param in params.split()]


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, content) entries: what the kernel unpacks."""
    out = io.BytesIO()

    def pad(n: int) -> None:
        out.write(b"\0" * (-n % 4))

    for ino, (name, mode, content) in enumerate([*entries, ("TRAILER!!!", 0, b"")], 1):
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(content), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        out.write(header + encoded)
        pad(len(header) + len(encoded))
        out.write(content)
        pad(len(content))
    return out.getvalue()


def ensure_initramfs(kernel: GuestKernel, cache: Path | None = None) -> Path:
    """The initramfs for kernel (cached by its contents' digest)."""
    cache = cache or cache_dir()
    order = load_order(kernel)
    init = (GUEST_DIR / "initramfs-init.sh").read_bytes()
    busybox = BUSYBOX.read_bytes()
    load_list = "".join(f"{stored_name(p)} {params}\n" for p, params in order).encode()
    key = hashlib.sha256(init + load_list + hashlib.sha256(busybox).digest()
                         + kernel.package.encode()).hexdigest()[:16]
    path = cache / f"initramfs-{kernel.version}-{key}.cpio"
    if path.exists():
        return path
    directory = 0o040755
    entries = [("bin", directory, b""), ("lib", directory, b""), ("modules", directory, b""),
               ("proc", directory, b""), ("sys", directory, b""), ("dev", directory, b""),
               ("newroot", directory, b""),
               ("bin/busybox", 0o100755, busybox), ("init", 0o100755, init),
               ("modules/load", 0o100644, load_list)]
    entries += [(f"modules/{stored_name(p)}", 0o100644, module_bytes(p)) for p, _ in order]
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(_cpio_newc(entries))
    tmp.rename(path)
    for old in cache.glob("initramfs-*.cpio"):  # earlier builds: never used again
        if old != path:
            old.unlink()
    return path
