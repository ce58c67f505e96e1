import pytest
import torch
import torch.nn.functional as F

from ember.ops.attention import group_by_length, rows_attention, varlen_attention
from ember.ops.linear import ACTIVATIONS, PackedLinear, linear_act, onednn_bf16, onednn_f32, pack_linears
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


def test_rows_attention_equals_those_rows_of_the_whole():
    torch.manual_seed(0)
    seqlens = [7, 131, 1, 40]
    T = sum(seqlens)
    q, k, v = torch.randn(T, 4, 32), torch.randn(T, 2, 32), torch.randn(T, 2, 32)
    last = torch.tensor([6, 137, 138, 178])  # each sequence's last token
    some = torch.tensor([0, 7, 100, 138, 150])  # any rows: a first token, a middle one
    whole = _reference(q, k, v, seqlens, True)
    for rows in (last, some):
        got = rows_attention(q, k, v, seqlens, rows)
        torch.testing.assert_close(got, whole.index_select(0, rows), atol=1e-5, rtol=1e-5)
    # a row's result does not depend on the batch around it
    alone = rows_attention(q[7:138], k[7:138], v[7:138], [131], torch.tensor([130]))
    assert torch.equal(alone[0], rows_attention(q, k, v, seqlens, last)[1])


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


needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="no oneDNN bf16 matmul on this CPU / torch build")


@needs_onednn_bf16
@pytest.mark.parametrize("act", [None, *ACTIVATIONS])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_fuses_bias_and_activation(act, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=bias).bfloat16()
    x = torch.randn(37, 96, dtype=torch.bfloat16)
    b = None if lin.bias is None else lin.bias.float()
    ref = F.linear(x.float(), lin.weight.float(), b)  # float32, rounded once at the end
    ref = ACTIVATIONS[act](ref) if act else ref
    packed = PackedLinear(lin)
    got = linear_act(packed, x, act) if act else packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 160)
    torch.testing.assert_close(got.float(), ref, atol=0.02, rtol=0.01)  # bf16 rounding of the output only
    eager = linear_act(lin, x, act) if act else lin(x)  # the unpacked layer: the same up to that rounding
    torch.testing.assert_close(got.float(), eager.float(), atol=0.03, rtol=0.02)
    torch.testing.assert_close(packed(x[:1]), packed(x)[:1], atol=0, rtol=0)  # alone == in a batch


@needs_onednn_bf16
def test_pack_linears_replaces_bf16_linears_only():
    from ember.ops.quant import Int8Linear, onednn_int8

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).bfloat16()
    float32 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    packed = 2 if onednn_f32() else 0  # float32: oneDNN's on AMD CPUs, else left to oneMKL
    assert pack_linears(float32, torch.float32) == packed
    assert type(float32[0]) is (PackedLinear if packed else torch.nn.Linear)
    if onednn_int8():
        net[2] = Int8Linear(net[2], torch.bfloat16)
    before = net(torch.ones(3, 8, dtype=torch.bfloat16))
    assert pack_linears(net, torch.bfloat16) == (1 if onednn_int8() else 2)
    assert isinstance(net[0], PackedLinear)
    assert isinstance(net[2], Int8Linear if onednn_int8() else PackedLinear)
    torch.testing.assert_close(net(torch.ones(3, 8, dtype=torch.bfloat16)), before, atol=0.02, rtol=0.01)


@pytest.mark.parametrize(
    ("seqlens", "window"), [([5, 40, 3, 17], 4), ([100], 8), ([9, 9], 8), ([64, 129, 200], 64), ([1], 4)]
)
def test_local_attention_equals_a_band_masked_reference(seqlens, window):
    """Token i sees j of its sequence when |i - j| <= window; short sequences whole, long ones in bands."""
    from ember.ops.window import local_attention

    g = torch.Generator().manual_seed(len(seqlens) * window)
    T = sum(seqlens)
    q, k, v = (torch.randn(T, h, 16, generator=g) * 3 for h in (4, 2, 2))
    got = local_attention(q, k, v, seqlens, window)
    start = 0
    for n in seqlens:
        i = torch.arange(n)
        band = (i[:, None] - i[None, :]).abs() <= window
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, enable_gqa=True)
        torch.testing.assert_close(got[start : start + n], want.transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += n
