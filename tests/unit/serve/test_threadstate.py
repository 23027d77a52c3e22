"""keep() and release() on Python's own threads (_threadstate.c): Python deletes such
a thread's state itself, and the marker in the state makes the count follow."""

from __future__ import annotations

import threading

import pytest

from nbd_verity.serve import threadstate

native = threadstate._threadstate
pytestmark = pytest.mark.skipif(native is None, reason="the _threadstate extension was not built")


def on_a_thread(work) -> list:
    out: list = []
    t = threading.Thread(target=lambda: out.extend(work()))
    t.start()
    t.join()
    return out


def test_keep_once_per_thread_and_the_count_follows_the_thread():
    before = native.kept()
    seen = on_a_thread(lambda: [native.keep(), native.keep(), native.kept()])
    assert seen == [True, False, before + 1]
    assert native.kept() == before  # Python ended the thread and its state with it


def test_release_gives_back_only_what_was_kept():
    before = native.kept()
    seen = on_a_thread(lambda: [native.release(), native.keep(), native.release(),
                                native.kept()])
    assert seen == [False, True, True, before + 1]  # released: deleted when Python is done
    assert native.kept() == before


def test_many_threads_leave_nothing_behind():
    before = native.kept()
    threads = [threading.Thread(target=native.keep) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert native.kept() == before
