"""Weight matrices on huge pages (ember.ops.pages): which ranges are moved, the fallback where Linux refuses, and
that a layer computes exactly the same after its weights moved."""

import torch
from torch import nn

from ember.ops.pages import MADV_COLLAPSE, MADV_HUGEPAGE, collapse, huge_page_size, huge_pages, weight_spans

PAGE = 2 << 20


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2048, 1024)  # 8 MB, read a few rows at a time
        self.proj = nn.Linear(1024, 3000)  # 12 MB of weights
        self.again = nn.Linear(1024, 3000)
        self.again.weight = self.proj.weight  # the same storage twice
        self.small = nn.Linear(64, 64)


def test_spans_are_whole_huge_pages_inside_each_weight_once_and_skip_embedding_tables():
    model = _Tied()
    spans = weight_spans(model, PAGE)
    w = model.proj.weight
    start, end = w.data_ptr(), w.data_ptr() + w.nbytes
    assert len(spans) == 1  # the tied weight once; the embedding table, the biases and the small layer not at all
    lo, hi = spans[0]
    assert lo % PAGE == 0 and hi % PAGE == 0
    assert start <= lo < hi <= end
    assert lo - start < PAGE and end - hi < PAGE  # every whole huge page inside the weight


def test_opaque_onednn_weights_are_left_where_they_are():
    model = nn.Module()
    model.register_buffer("packed", torch.randn(2048, 1024).to_mkldnn())  # as oneDNN's reordered bf16 weights
    model.plain = nn.Linear(1024, 3000)
    assert len(weight_spans(model, PAGE)) == 1
    assert huge_pages(model).name == "huge_pages"  # and nothing raised


def test_collapse_advises_where_collapsing_is_refused():
    calls = []

    def madvise(address, length, advice):
        calls.append((address, length, advice))
        return -1 if advice == MADV_COLLAPSE and address == 4 * PAGE else 0

    spans = [(0, 2 * PAGE), (4 * PAGE, 5 * PAGE)]
    assert collapse(spans, madvise) == (2 * PAGE, PAGE)
    assert calls == [(0, 2 * PAGE, MADV_COLLAPSE), (4 * PAGE, PAGE, MADV_COLLAPSE), (4 * PAGE, PAGE, MADV_HUGEPAGE)]


def test_a_layer_computes_the_same_once_its_weights_moved():
    torch.manual_seed(0)
    layer = nn.Linear(1024, 6144)  # 24 MB: several whole huge pages
    x = torch.randn(5, 1024)
    with torch.inference_mode():
        before = layer(x)
        status = huge_pages(layer)
        after = layer(x)
    assert torch.equal(before, after)
    assert status.name == "huge_pages"
    page = huge_page_size()
    if status.active:  # Linux moved them: the weight's whole pages now count as anonymous huge pages
        assert page is not None and f"on {page // 1024} KB pages" in status.detail
        assert _anon_huge_kb(layer.weight.data_ptr()) >= page // 1024
    else:  # no huge pages here, or Linux refused them: said so, and nothing else changed
        assert "huge pages" in status.detail or "refused" in status.detail


def test_a_model_without_large_weights_reports_nothing_to_move():
    status = huge_pages(nn.Linear(64, 64), page=PAGE)
    assert not status.active and status.detail == "no weight matrix spans a huge page"


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0
