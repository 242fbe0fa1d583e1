"""``chunks/guard.py``: deadlines, the circuit breaker and its log lines, over a
real ``file://`` chunk store whose calls the test slows down or breaks."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from hurraykv.chunks.guard import Guarded
from hurraykv.chunks.urls import open_store


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def guarded(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="test.guard")
    clock = Clock()
    opened = []

    def open_():
        opened.append(open_store((tmp_path / "kv").as_uri()))
        return opened[-1]

    g = Guarded(open_, url="file:///kv", what="lookup", timeout=0.05, failures=3,
                backoff=1.0, max_backoff=4.0, log=logging.getLogger("test.guard"),
                clock=clock)
    g.warm()  # opened before the first call's deadline, as the connector does at start
    yield g, clock, opened, caplog
    g.close(wait=0.1)


def lines(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_answers_in_time_and_misses_on_any_error(guarded):
    g, _, opened, caplog = guarded
    assert g.call("locate", lambda s: s.locate(["ab" * 16]), "miss") == [None]

    def broken(store):
        raise ConnectionError("reset by peer")  # not a HurrayError: still a miss

    assert g.call("locate", broken, "miss") == "miss"
    assert g.stats["failures"] == 1 and not g.down and lines(caplog, "is failing") == 0
    assert g.call("locate", lambda s: 7, "miss") == 7  # a success ends the run of failures
    assert len(opened) == 2  # the broken call's connection was not trusted again


def test_down_after_failures_skipped_during_backoff_then_probed(guarded):
    g, clock, _, caplog = guarded
    calls = []

    def failing(store):
        calls.append(1)
        raise OSError("unreachable")

    for _ in range(5):
        assert g.call("locate", failing, None) is None
    assert len(calls) == 3 and g.down and g.stats["skipped"] == 2
    assert lines(caplog, "is failing") == 1
    clock.now += 1.0  # the backoff passed: one probe, failing: the next wait doubles
    assert g.call("locate", failing, None) is None and len(calls) == 4
    clock.now += 1.5
    assert g.call("locate", failing, None) is None and len(calls) == 4  # 2 s now
    clock.now += 0.6
    assert g.call("locate", lambda s: "ok", None) == "ok"
    assert not g.down and lines(caplog, "is back") == 1 and lines(caplog, "is failing") == 1


def test_a_hung_call_never_holds_the_caller_past_its_deadline(guarded):
    g, clock, _, caplog = guarded
    release = threading.Event()
    started = time.monotonic()
    assert g.call("locate", lambda s: release.wait(5), "late") == "late"
    for _ in range(4):  # still running: no queueing behind it, and no failure of theirs
        assert g.call("locate", lambda s: "never", "late") == "late"
    assert time.monotonic() - started < 1.0
    assert g.stats["failures"] == 1 and g.stats["skipped"] == 4 and not g.down
    # the hung call is charged once more per deadline it runs past: down at 3
    clock.now += 0.11
    assert g.call("locate", lambda s: "never", "late") == "late"
    assert g.stats["failures"] == 2 and not g.down
    clock.now += 0.05
    assert g.call("locate", lambda s: "never", "late") == "late"
    assert g.down and g.stats["timeouts"] == 1 and lines(caplog, "is failing") == 1
    assert "has not returned for" in caplog.records[-1].getMessage()
    release.set()


def test_calls_from_several_threads_queue_and_none_fails_for_another(guarded):
    """Issue 30: a call that found another in flight was a failure of its own ("an
    earlier call has not returned"), so a healthy but busy store was declared down."""
    g, _, _, _ = guarded
    g.timeout = 2.0
    results: list = []

    def slow(store):
        time.sleep(0.03)  # each call takes most of the old 50 ms deadline
        return store.locate(["ab" * 16])

    def caller():
        for _ in range(5):
            results.append(g.call("locate", slow, "miss"))

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[None]] * 20
    assert g.stats["failures"] == 0 and g.stats["skipped"] == 0 and not g.down


def test_a_bounded_store_is_called_on_the_callers_thread_and_its_errors_still_count(
        tmp_path):
    """A store whose calls return within their deadlines by themselves (``BOUNDED``: a
    ``mem://`` pool, a stack whose every tier is behind a guard of its own) is called on
    the caller's thread, no hand-over to the guard's and back (a hit from memory is a
    few hundred microseconds); an error is still the default and still counts; a store
    that may hang (a directory) is called on the guard's thread."""
    from hurraykv.chunks.guarded_tier import GuardedTier
    from hurraykv.chunks.stack import StackedChunks

    log = logging.getLogger("test.guard")
    file_url = (tmp_path / "kv").as_uri()
    cases = {"mem://bounded-guard": True, file_url: False}
    for url, bounded in cases.items():
        g = Guarded(lambda u=url: open_store(u, **({"max_bytes": 1 << 20} if u.startswith(
            "mem") else {})), url=url, what="load", timeout=1.0, failures=2, log=log)
        g.warm()
        g.call("warm", lambda s: None, None)  # the first waits for the opening
        here = threading.get_ident()
        assert (g.call("get", lambda s: threading.get_ident(), None) == here) is bounded

        def broken(store):
            raise OSError("gone")

        assert g.call("get", broken, "miss") == "miss" and g.stats["failures"] == 1
        g.close()
    tiers = [GuardedTier(lambda: open_store(file_url), url=file_url,
                         timeouts={"lookup": 1, "load": 1, "save": 1}, log=log)]
    assert StackedChunks(tiers).BOUNDED and not StackedChunks([open_store(file_url)]).BOUNDED
    tiers[0].close()


def test_a_call_the_stores_objects_make_later_counts_toward_its_breaker(guarded):
    """``watched``: a call made outside ``call`` (an ``s3://`` load's page fetch) raises
    as it did, and its failures take the store down like a call's; a return ends the
    run of failures."""
    g, _, _, _ = guarded

    def fetch(fail: bool) -> str:
        if fail:
            raise ConnectionError("reset by peer")
        return "fetched"

    watched = g.watched("fill", fetch)
    with pytest.raises(ConnectionError):
        watched(True)
    assert watched(False) == "fetched" and g.stats["failures"] == 1 and not g.down
    for _ in range(3):
        with pytest.raises(ConnectionError):
            watched(True)
    assert g.down and g.call("locate", lambda s: 1, "skipped") == "skipped"
