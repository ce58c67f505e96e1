from ember.engine.scheduler import plan_batches


def test_batches_respect_token_and_sequence_budgets():
    lengths = [5, 100, 30, 30, 7, 64, 1]
    batches = plan_batches(lengths, max_tokens=100, max_seqs=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 100


def test_a_sequence_longer_than_the_budget_runs_alone():
    assert plan_batches([500, 10, 10], max_tokens=100, max_seqs=8) == [[0], [1, 2]]
