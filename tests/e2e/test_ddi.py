"""A Discoverable Disk Image through the real kernel: the same DDI served as /dev/nbd0 and
opened by the guest kernel's own dm-verity from its partitions.

systemd-repart builds a signed DDI (tests/server/ddiimages.py); `nbd-verity serve DDI`
finds the triple in its GPT and checks the signature partition against the test's
certificate. The guest sees the DDI as a virtio disk whose kernel reads the GPT itself
(vda1 data, vda2 verity, vda3 signature), opens vda1/vda2 with `veritysetup open` and
repart's root hash, and mounts both ext4 file systems read-only: the devices and every
file must be the same, and the data partition's own bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..pki import make_identity
from ..server.ddiimages import FILES, make_ddi
from .harness import Export, Server, guest_run

PORT = 10870


def test_a_signed_ddi_mounts_from_nbd_and_from_the_kernels_verity(e2e_host, tmp_path: Path):
    signer = make_identity(tmp_path, "ddi-signer", "ec")
    ddi = make_ddi(tmp_path / "ddi", "root", signer)
    partition = hashlib.sha256(ddi.data.read(ddi.path)).hexdigest()
    script = f"""
nbd_attach nbd0 {PORT}
dev_sha256 nbd0 nbd.sha256
for part in vda1 vda2 vda3; do
    [ -e "/sys/block/vda/$part" ] || {{ echo "the kernel found no $part in the GPT" >&2; exit 1; }}
done
dm=$(verity_open kroot vda1 vda2 {ddi.root})
dev_sha256 "$dm" dm.sha256
mkdir -p /run/ours /run/kernel
mount -t ext4 -o ro /dev/nbd0 /run/ours
mount -t ext4 -o ro "/dev/$dm" /run/kernel
for side in ours kernel; do
    (cd "/run/$side" && sha256sum {' '.join(sorted(FILES))}) >"$E2E_WORK/$side.sums"
done
umount /run/ours /run/kernel
verity_close kroot
nbd_detach nbd0
"""
    served = Export(data=ddi.path, hash=None, root_hash="")
    server = Server(served, extra_args=("--trusted-certs", str(signer.cert),
                                        "--require-signatures"))
    with guest_run(script, [ddi.path], {PORT: server}, tmp_path / "run") as run:
        assert run.read("dm.sha256") == partition, "the kernel's verity is not the partition"
        assert run.read("nbd.sha256") == partition
        expected = {name: hashlib.sha256(content).hexdigest()
                    for name, content in FILES.items()}
        for side in ("ours", "kernel"):
            sums = dict(reversed(line.split()) for line in run.lines(f"{side}.sums"))
            assert sums == expected, side
