"""Real-kernel end-to-end tests: Debian's kernel in a QEMU guest reads nbd-verity through /dev/nbd0."""
