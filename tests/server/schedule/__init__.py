"""Server tests: the scheduling policy (nbd_verity/schedule/)."""
