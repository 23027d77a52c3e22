"""The read mechanism: verify a byte range against the tree (verifier, cache, Merkle
readahead, FEC repair, counters)."""
