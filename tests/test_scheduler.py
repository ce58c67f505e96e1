"""The scheduler on a clock the test moves: admission, EDF order, budgets and the batch-wait decision."""

import numpy as np
import pytest

from ember.config import EngineConfig
from ember.engine.results import answer_vectors
from ember.engine.scheduler import CONCURRENCY_MEMORY_SECONDS, SETTLE_SECONDS, Scheduler
from ember.errors import OverloadedError


def scheduler(**kw):
    return Scheduler(EngineConfig(**kw))


def admit(s, *lengths, now=0.0, token=7):
    """One request with one input per length."""
    return s.admit([[[token] * n] for n in lengths], list(lengths), now)


def run(s, batch, now, seconds=0.01):
    return s.complete(batch, np.zeros((len(batch), 4), np.float32), seconds, now)


def test_batches_respect_token_and_sequence_budgets():
    s = scheduler(max_num_batched_tokens=100, max_num_seqs=3)
    lengths = [5, 100, 30, 30, 7, 64, 1]
    admit(s, *lengths)
    batches = []
    while batch := s.next_batch(0.0):
        batches.append([len(it.ids) for it in batch])
    assert sorted(n for b in batches for n in b) == sorted(lengths)
    assert all(len(b) <= 3 and (len(b) == 1 or sum(b) <= 100) for b in batches)


def test_a_window_longer_than_the_budget_runs_alone():
    s = scheduler(max_num_batched_tokens=100)
    admit(s, 500, 10, 10)
    assert [len(it.ids) for it in s.next_batch(0.0)] == [500]
    assert [len(it.ids) for it in s.next_batch(0.0)] == [10, 10]


def test_short_queries_overtake_a_long_bulk_request():
    s = scheduler(max_num_batched_tokens=32, max_num_seqs=1, seconds_per_token=0.002)
    bulk = admit(s, *[30] * 20, now=0.0)
    queries = [admit(s, 2, now=0.01) for _ in range(3)]  # later, but due long before the bulk's 600 tokens
    order = [s.next_batch(0.02)[0].request for _ in range(23)]
    assert order[:3] == queries and order[3:] == [bulk] * 20


def test_bulk_work_is_not_starved_by_a_stream_of_queries():
    s = scheduler(max_num_batched_tokens=32, max_num_seqs=1, seconds_per_token=0.002)
    bulk = admit(s, 30, 30, now=0.0)  # due at 0.12
    for t in range(100):  # a query every 10 ms, each due 4 ms after it arrives
        admit(s, 2, now=0.01 * t)
    served = [s.next_batch(1.0)[0].request for _ in range(102)]
    assert served.index(bulk) < 20  # its deadline passes those of queries arriving after ~0.12 s


def test_a_cancelled_request_is_dropped_when_the_batch_is_formed():
    s = scheduler()
    gone, kept = admit(s, 4), admit(s, 2)
    s.release(gone)  # its caller went away before any of it ran
    batch = s.next_batch(0.0)
    assert [it.request for it in batch] == [kept] and not s.has_work


def test_overload_is_refused_with_retry_after_and_accepted_again_once_released():
    s = scheduler(max_queued_requests=2, max_queued_tokens=100)
    held = [admit(s, 10), admit(s, 10)]
    with pytest.raises(OverloadedError) as e:
        s.check_room()
    assert e.value.retry_after >= 1
    with pytest.raises(OverloadedError):
        admit(s, 10)
    for r in held:
        run(s, s.next_batch(0.0), 0.1)
        s.release(r)
    assert s.queued_requests == 0 and s.queued_tokens == 0
    admit(s, 10)


def test_the_queue_token_budget_refuses_a_second_request_but_never_the_first():
    s = scheduler(max_queued_tokens=50)
    admit(s, 30)
    with pytest.raises(OverloadedError):
        admit(s, 30)
    s2 = scheduler(max_queued_tokens=50)
    admit(s2, 80)  # alone in an empty queue: admitted


def test_completion_reports_finished_requests_and_their_pooled_windows():
    s = scheduler(max_num_batched_tokens=4)
    r = s.admit([[[1, 2], [3, 4]], [[5]]], [4, 1], 0.0)
    first = s.next_batch(0.0)
    assert run(s, first, 0.1) == []
    assert run(s, s.next_batch(0.1), 0.2) == [r]
    assert set(r.pooled) == {(0, 0), (0, 1), (1, 0)} and r.first_batch == 0.0


def test_a_failed_batch_fails_its_requests_and_nothing_else():
    s = scheduler(max_num_batched_tokens=4)
    a, b = admit(s, 4), admit(s, 4)
    failed = s.fail(s.next_batch(0.0), RuntimeError("boom"), 0.1)
    assert failed == [a] and a.done and a.failed is not None
    assert run(s, s.next_batch(0.1), 0.2) == [b] and b.failed is None


# The batch-wait decision. The engine asks wait_seconds(now) before each batch; 0 means start now.


def test_a_lone_client_starts_at_once_after_the_engine_has_been_busy():
    s = scheduler(batch_wait_seconds=5.0)
    r = admit(s, 3, now=0.0)
    assert s.wait_seconds(0.0) > 0  # an idle engine settles first ...
    assert s.wait_seconds(SETTLE_SECONDS) == 0  # ... for only the settle time, not the 5 s
    run(s, s.next_batch(SETTLE_SECONDS), 0.01)
    s.release(r)
    for i in range(3):  # busy now: one request in flight at the peak, so each starts without waiting
        r = admit(s, 3, now=0.02 + i)
        assert s.wait_seconds(0.02 + i) == 0
        run(s, s.next_batch(0.02 + i), 0.03 + i)
        s.release(r)


def test_a_burst_on_an_idle_engine_lands_in_one_batch():
    s = scheduler(batch_wait_seconds=5.0)
    step = SETTLE_SECONDS / 2  # each request lands before the previous one's settle time is up
    for i in range(4):
        admit(s, 2, now=i * step)
        assert s.wait_seconds(i * step) > 0
    assert s.wait_seconds(3 * step + SETTLE_SECONDS) == 0
    assert len(s.next_batch(3 * step + SETTLE_SECONDS)) == 4


def test_closed_loop_clients_share_one_batch_and_do_not_wait_for_more():
    s = scheduler(batch_wait_seconds=5.0)
    now = 0.0
    requests = [admit(s, 2, now=now) for _ in range(4)]  # four clients in flight at once
    run(s, s.next_batch(now), now + 0.01)
    for _ in range(3):  # each client sends its next request once answered
        now += 0.02
        for r in requests:
            s.release(r)
        requests = []
        for i in range(4):
            requests.append(admit(s, 2, now=now))
            assert s.wait_seconds(now) == (0 if i == 3 else pytest.approx(5.0))  # waits for all four, no more
        batch = s.next_batch(now)
        assert len(batch) == 4
        run(s, batch, now + 0.01)


def test_the_peak_of_concurrency_is_forgotten_after_a_while():
    s = scheduler(batch_wait_seconds=5.0)
    requests = [admit(s, 2, now=0.0) for _ in range(4)]
    run(s, s.next_batch(0.0), 0.5)
    for r in requests:
        s.release(r)
    later = 0.5 + CONCURRENCY_MEMORY_SECONDS / 2
    r = admit(s, 2, now=later)
    assert s.wait_seconds(later) > 0  # four were in flight half a second ago: wait for them
    run(s, s.next_batch(later + 5.0), later + 5.0)
    s.release(r)
    much_later = later + 5.0 + CONCURRENCY_MEMORY_SECONDS / 2  # the engine ran half a second ago
    admit(s, 2, now=much_later)
    assert s.wait_seconds(much_later) == 0  # the peak has aged out and the engine is busy: one is enough


def test_a_window_longer_than_the_budget_waits_the_whole_batch_wait_for_queries():
    s = scheduler(batch_wait_seconds=0.025, max_num_batched_tokens=16)
    admit(s, 40, now=0.0)
    assert s.wait_seconds(0.0) == pytest.approx(0.025)
    assert s.wait_seconds(0.01) == pytest.approx(0.015)
    assert s.wait_seconds(0.025) == 0


def test_a_full_budget_starts_at_once():
    s = scheduler(batch_wait_seconds=5.0, max_num_batched_tokens=8)
    admit(s, 4, 4, now=0.0)
    assert s.wait_seconds(0.0) == 0


def test_measured_cost_per_token_sets_later_deadlines_and_retry_after():
    s = scheduler(seconds_per_token=0.001)
    admit(s, 100)
    run(s, s.next_batch(0.0), 1.0, seconds=1.0)  # 10 ms a token measured
    assert s.seconds_per_token == pytest.approx(0.8 * 0.001 + 0.2 * 0.01)
    r = admit(s, 100, now=2.0)
    item = s.next_batch(2.0)[0]
    assert item.request is r and item.deadline == pytest.approx(2.0 + 100 * s.seconds_per_token)


def test_admission_by_time_refuses_what_would_wait_too_long_to_start_with_a_realistic_retry_after():
    s = scheduler(seconds_per_token=0.01, max_queue_seconds=8.0, max_queued_tokens=10**9)
    admit(s, 600)  # 6 s of work, due at 6
    admit(s, 300)  # 3 s, due at 3
    with pytest.raises(OverloadedError) as e:
        admit(s, 200, now=5.0)  # due at 7: both run first, 9 s before it starts > 8
    assert e.value.retry_after == 1  # the excess, rounded up: by then the work ahead fits the bound
    admit(s, 20, now=5.0)  # due at 5.2: only the 3 s request is before it: admitted
    with pytest.raises(OverloadedError) as e:
        admit(s, 5000, now=5.0)  # 50 s of its own, due last: 9.2 s ahead of it
    assert e.value.retry_after == 2  # what is ahead, not its own size: retried then, it starts as the bound allows


def test_an_empty_queue_admits_a_request_longer_than_the_time_bound():
    s = scheduler(seconds_per_token=0.01, max_queue_seconds=1.0)
    admit(s, 5000)  # 50 s alone: refusing it would refuse it for ever


def test_the_clients_own_timeout_counts_its_wait_and_its_work():
    s = scheduler(seconds_per_token=0.01, max_queue_seconds=30.0)
    admit(s, 500)  # due at 5
    s.admit([[[7] * 100]], [100], 4.0, max_seconds=10.0)  # due at 5: 5 s ahead + 1 of its own, within 10
    with pytest.raises(OverloadedError):
        s.admit([[[7] * 100]], [100], 4.0, max_seconds=6.5)  # 6 s ahead + 1 > 6.5


def test_the_answer_budget_refuses_a_request_whose_vectors_would_not_fit():
    s = scheduler(max_queued_vectors=10)
    admit(s, *[3] * 8)  # 8 vectors
    with pytest.raises(OverloadedError):
        admit(s, 3, 3, 3)  # 11 > 10
    admit(s, 3, 3)  # 10: fits
    r = scheduler().admit([[[7] * 5]], [5], 0.0, output="token_embed", vectors=answer_vectors("token_embed", 1, 5, 8))
    assert r.vectors == 5  # token_embed: a vector per token
    assert answer_vectors("token_classify", 2, 1000, 1024) == 2 + 8  # a weight and a sparse entry per token
    assert answer_vectors("embed", 3, 1000, 1024) == 3


def test_the_first_batch_does_not_count_before_its_cost_is_measured():
    s = scheduler(seconds_per_token=0.01, max_queue_seconds=5.0)
    admit(s, 5000)
    s.next_batch(0.0)  # running: 50 s at the default guess, which may be far off for this model
    admit(s, 10, now=0.1)  # not refused on a guess (nor told to retry in minutes)


def test_windows_the_cache_answered_take_no_room_in_the_token_budget():
    s = scheduler(max_queued_tokens=100)
    admit(s, 90)
    with pytest.raises(OverloadedError):  # 20 more tokens to compute: over the budget
        admit(s, 20)
    windows = [[[7] * 20], [[8] * 5]]
    cached = {(0, 0): np.zeros(4, np.float32)}
    request = s.admit(windows, [20, 5], 0.0, done=cached)  # only its 5 uncached tokens queue
    assert request.tokens == 5 and s.queued_tokens == 95
    whole = s.admit([[[7] * 20]], [20], 0.0, done=cached)  # all cached: admitted, done at once
    assert whole.done and whole.tokens == 0
    s.release(whole)
    s.release(request)
    assert s.queued_tokens == 90
