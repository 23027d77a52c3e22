"""Unit tests: nbdkit's face (nbd_verity/serve/)."""
