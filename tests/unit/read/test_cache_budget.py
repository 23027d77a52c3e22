"""The hash-block cache: every level inside one byte budget, lower levels evicted first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nbd_verity.read.cache import HashBlockCache

HBS = 4096


def block(n: int) -> bytes:
    return n.to_bytes(8, "little") * (HBS // 8)


def test_budget_counts_every_level():
    cache = HashBlockCache(HBS, 3 * HBS)
    cache.put(1000, 2, block(1000))
    cache.put(900, 1, block(900))
    cache.put(1, 0, block(1))
    cache.put(2, 0, block(2))  # full: the oldest level-0 block goes
    assert len(cache) == 3 and not cache.contains(1) and cache.contains(2)
    assert cache.contains(1000) and cache.contains(900)  # one block of each level


def test_upper_levels_are_kept_in_preference_to_level_0():
    cache = HashBlockCache(HBS, 2 * HBS)
    cache.put(1000, 1, block(1000))
    cache.put(1001, 1, block(1001))
    cache.put(5, 0, block(5))  # no room: level 0 is evicted, here the new block itself
    assert cache.contains(1000) and cache.contains(1001) and not cache.contains(5)
    cache.put(1002, 1, block(1002))  # level 1 alone over budget: its LRU block goes
    assert not cache.contains(1000) and cache.contains(1002)


def test_lru_order_within_a_level():
    cache = HashBlockCache(HBS, 2 * HBS)
    cache.put(1, 0, block(1))
    cache.put(2, 0, block(2))
    assert cache.get(1) == block(1)  # 1 is now the most recent
    cache.put(3, 0, block(3))
    assert cache.contains(1) and not cache.contains(2)
    assert (cache.hits, cache.evictions) == (1, 1)


def test_put_twice_counts_once():
    cache = HashBlockCache(HBS, 2 * HBS)
    cache.put(7, 0, block(7))
    cache.put(7, 0, block(7))
    assert len(cache) == 1


def model_put(levels: list[list[int]], capacity: int, number: int, level: int) -> None:
    """The policy written out plainly: per-level LRU lists, lowest level evicted first."""
    while len(levels) <= level:
        levels.append([])
    if number in levels[level]:
        levels[level].remove(number)
    levels[level].append(number)
    while sum(map(len, levels)) > capacity:
        next(lru for lru in levels if lru).pop(0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16),
       st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3)), max_size=300))
def test_matches_the_policy_and_never_exceeds_the_budget(capacity, puts):
    cache = HashBlockCache(HBS, capacity * HBS)
    model: list[list[int]] = []
    level_of: dict[int, int] = {}
    for number, level in puts:
        level = level_of.setdefault(number, level)  # a block has one level
        cache.put(number, level, block(number))
        model_put(model, capacity, number, level)
        assert len(cache) <= capacity
        assert len(cache) == sum(map(len, model))  # the same blocks as the model holds
        assert all(cache.contains(n) for lru in model for n in lru)
