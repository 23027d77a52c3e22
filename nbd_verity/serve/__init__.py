"""The server: nbdkit's callbacks (plugin), the device they serve, its configuration,
dispatch by I/O class, the verifier and its cache, readahead, counters, and launching."""
