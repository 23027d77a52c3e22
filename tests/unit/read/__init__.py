"""Unit tests: the read mechanism (nbd_verity/read/)."""
