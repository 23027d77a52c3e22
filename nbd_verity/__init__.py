"""nbd-verity: a userspace NBD server that verifies every byte against a dm-verity tree."""

__version__ = "0.1.0"
