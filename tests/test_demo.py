"""`make demo` is what a newcomer runs first: run the whole walkthrough as a test."""

import subprocess
import sys


def test_demo_walkthrough_succeeds(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nbd_verity.demo", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo OK" in done.stdout
    # The corrupted block fails and only it; the mounted corrupted file reports EIO.
    assert "read data block 12345: Input/output error" in done.stdout
    assert "Input/output error" in done.stdout.split("fsc-mnt/payload.bin")[-1]
    # Signed from sidecars: served and read back; unsigned and wrongly signed: refused.
    trust = done.stdout.split("Make a signing key with openssl")[-1]
    assert "read back over NBD: the same bytes as data.img" in trust
    assert "require-signatures: the root hash is not signed" in trust
    assert "is not a trusted certificate" in trust
    # FEC: a destroyed block read back intact, the repair counted, the status still V.
    fec = done.stdout.split("Format again with --fec-device")[-1]
    assert "read data block 12345: the original bytes" in fec
    assert "fec_corrected 1  fec_failed 0" in fec
    # S3: a flipped byte in the bucket fails its block, and only it.
    s3 = done.stdout.split("a local S3 store")[-1]
    assert "read data block 12345 over S3: Input/output error" in s3
    assert "read data block 12346 over S3: ok" in s3
    with open("/proc/mounts") as mounts:
        assert str(tmp_path) not in mounts.read(), "the demo left a mount behind"
