"""Server tests: nbdkit's face (nbd_verity/serve/)."""
