"""Server tests: the read mechanism (nbd_verity/read/)."""
