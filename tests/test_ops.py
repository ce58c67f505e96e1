import torch
import torch.nn.functional as F

from ember.ops.attention import group_by_length, varlen_attention
from ember.ops.pooling import pool


def _reference(q, k, v, seqlens, causal):
    outs, start = [], 0
    for n in seqlens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        rep = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = (qs @ ks.transpose(-1, -2)) / qs.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def test_packed_attention_equals_per_sequence_reference():
    torch.manual_seed(0)
    # Causal lengths from 64 up that are not multiples of 16 are attended padded with the next sequence's
    # tokens (131 before 5 and 200; not 129 at the end, too few follow); bidirectional groups that are
    # padded anyway round their width up too, with the key mask ([65, 3, 77]).
    cases = ([7], [131], [3, 9, 9, 1, 40, 38, 2], [16, 16, 16], [131, 5, 200, 129], [70, 70, 70], [65, 3, 77])
    for seqlens in cases:
        T = sum(seqlens)
        q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
        for causal in (True, False):
            got = varlen_attention(q, k, v, seqlens, causal)
            torch.testing.assert_close(got, _reference(q, k, v, seqlens, causal), atol=1e-5, rtol=1e-5)


def test_groups_cover_every_sequence_once_and_limit_padding():
    seqlens = [1, 500, 480, 3, 3, 4, 250, 2]
    groups = group_by_length(seqlens)
    assert sorted(i for g in groups for i in g) == list(range(len(seqlens)))
    for g in groups:
        longest = max(seqlens[i] for i in g)
        assert sum(seqlens[i] for i in g) >= 0.75 * longest * len(g)


def test_pooling_methods_on_packed_states():
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)  # two sequences: 2 and 4 tokens
    assert pool(hidden, [2, 4], "CLS").tolist() == [[0, 1], [4, 5]]
    assert pool(hidden, [2, 4], "LAST").tolist() == [[2, 3], [10, 11]]
    torch.testing.assert_close(pool(hidden, [2, 4], "MEAN"), torch.tensor([[1.0, 2.0], [7.0, 8.0]]))
    assert F.normalize(pool(hidden.bfloat16(), [2, 4], "MEAN"), dim=-1).dtype == torch.float32


def test_token_slices_equal_the_whole():
    from ember.ops.tokenwise import by_token_slices

    x, y = torch.randn(10, 4), torch.randn(10, 4)
    fn = lambda a, b: a * 2 + b.sum(-1, keepdim=True)  # noqa: E731
    torch.testing.assert_close(by_token_slices(fn, x, y, size=3), fn(x, y))
