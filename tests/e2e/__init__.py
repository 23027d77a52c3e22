"""Real-kernel end-to-end tests: Debian's kernel in a QEMU guest reads /dev/nbd0."""
