"""One connection's Merkle readahead: which level-0 hash blocks to fetch before a read.

After the kernel's page-cache readahead (mm/readahead.c, file_ra_state) and fs-verity's
Merkle-tree readahead (docs/server.md, "Merkle readahead"), counted in level-0 hash
blocks ("leaves"; one covers 128 data blocks at 4 KiB/SHA-256):
- a sequential stream (a request that starts where the connection's last one ended)
  reads ahead a window of leaves beyond the request in one read; the window starts at
  INITIAL_LEAVES and doubles each time the stream reaches past what was read ahead, up
  to max_leaves; a stream of 4 KiB requests thus needs a hash read every 32 MiB instead
  of every 512 KiB, and never one per request;
- a large request that is not sequential reads its own leaves plus those of a quarter
  of its length beyond it (fs-verity's rule), and starts no stream;
- anything else reads nothing ahead (a random 4 KiB read needs one leaf at most).
The reads are synchronous, in the request's thread: one read of a window costs one
round trip where the stream would otherwise pay one per leaf.
On a data source that reads ahead (sources/ahead.py: an image read over a network, slow
lately), a sequential stream also starts the data reads of its next DATA_AHEAD requests
of the same size, so that a connection whose requests nbdkit serves one at a time finds
its next request's bytes on their way (they are verified when that request comes).

The state is per connection and unlocked: nbdkit may run a connection's requests in
parallel, and a race between two of them costs at most a duplicate readahead, never a
wrong byte (prefetch caches only blocks verified against their parents).
"""

from __future__ import annotations

from ..format.blocks import block_span

DATA_AHEAD = 8  # a stream's next requests whose data reads start ahead (a client's QD8)
DATA_AHEAD_BYTES = 4 << 20  # ... at most this far ahead
INITIAL_LEAVES = 2  # the first window of a sequential stream, beyond the request
MAX_LEAVES = 64  # the largest window: 256 KiB of hash blocks, 32 MiB of data at 4K/SHA-256


class Readahead:
    """Decides, before each read of one connection, which leaves the verifier prefetches."""

    def __init__(self, verifier, min_size: int, max_leaves: int = MAX_LEAVES) -> None:
        self.verifier = verifier
        self.min_size = min_size  # a non-sequential request this large reads ahead
        # Never read ahead more than a quarter of what the level-0 cache holds, or the
        # window would evict the leaves the stream is about to use.
        self.max_leaves = max(0, min(max_leaves, verifier.cache.capacity // 4))
        self.last_end = -1  # where the connection's previous request ended
        # the threads serving this connection's requests now (serve/callbacks.py pread
        # adds and discards; set.add and set.discard are atomic under the GIL)
        self.in_flight: set[int] = set()
        self.next_leaf = -1  # the first leaf past the stream's last readahead
        self.window = 0  # leaves in the stream's next readahead (0: no stream yet)
        geo = verifier.geo
        # data bytes one leaf covers (0: no level 0, nothing to read ahead)
        self.leaf_bytes = geo.data_block_size * geo.hashes_per_block if geo.levels else 0

    def random(self, offset: int, length: int) -> bool:
        """before_read for a request that reads nothing ahead (it does not continue the
        stream and is shorter than min_size): noted, True. Any other: False, nothing
        noted (before_read's). serve/fastpath.py's remote read asks it."""
        if offset == self.last_end or length >= self.min_size or not self.leaf_bytes:
            return False
        self.last_end = offset + length
        self.window, self.next_leaf = 0, -1
        return True

    def deep(self) -> bool:
        """Whether other requests of the connection are in flight beside this one (the
        parallel model): then the client's own depth keeps the storage busy, the prefetch
        cluster brings the hash blocks (read/beside.py), and nothing more is read ahead,
        which in the parallel model cost more than it gained (docs/server.md)."""
        return len(self.in_flight) > 1

    def before_read(self, offset: int, length: int) -> None:
        """Prefetch what this request (offset, length) and its stream will need; nothing
        while other requests of the connection are in flight (deep)."""
        if self.deep():
            return
        sequential = offset == self.last_end
        self.last_end = end = offset + length
        data = self.verifier.data
        if sequential and getattr(data, "waits", None) is not None and data.waits():
            size = self.verifier.geo.data_size
            for i in range(min(DATA_AHEAD, max(1, DATA_AHEAD_BYTES // length))):
                start = end + i * length
                if start + length > size:
                    break
                data.ahead(start, length)
        if not self.leaf_bytes:
            return
        last_leaf = (end - 1) // self.leaf_bytes
        if sequential and last_leaf < self.next_leaf:
            return  # the fast path: the window read ahead already covers this request
        geo = self.verifier.geo
        first, blocks = block_span(offset, length, geo.data_block_size)
        if not sequential:
            self.window, self.next_leaf = 0, -1
            if length >= self.min_size:
                self.verifier.prefetch(first, blocks + blocks // 4)
            return
        self.window = min(INITIAL_LEAVES if self.window == 0 else self.window * 2,
                          self.max_leaves)
        start = max(geo.parent_slot(first)[0], self.next_leaf)
        end = last_leaf + self.window
        self.verifier.prefetch_leaves(start, end)
        self.next_leaf = end + 1
