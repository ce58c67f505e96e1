"""The reference implementation on the same weights and inputs: transformers (or sentence-transformers)."""

from __future__ import annotations

import time

import torch

from ember.cli.bench import WORKLOADS
from ember.engine.cpu import set_threads
from ember.models.checkpoint import resolve_model
from ember.resources import cpu_budget

# The reference is 3-5x slower: it runs a slice of each workload, enough for a stable rate.
SLICE = {"bulk": 16, "mixed": 32, "queries": 50, "long": 1, "chunked": 0}


def reference_tokens_per_s(model: str, dtype: str, keys: list[str], st: bool = False) -> dict[str, float]:
    set_threads(cpu_budget().usable)
    path = str(resolve_model(model))
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if st:
        from sentence_transformers import SentenceTransformer

        m = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": dt})
        encode = lambda texts, bs: m.encode(texts, batch_size=bs)  # noqa: E731
        # sentence-transformers truncates at max_seq_length: count what it really embedded
        count = lambda texts: sum(min(m.max_seq_length, len(m.tokenizer(t)["input_ids"])) for t in texts)  # noqa: E731
    else:
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        net = AutoModel.from_pretrained(path, dtype=dt).eval()

        def encode(texts: list[str], bs: int) -> None:
            for i in range(0, len(texts), bs):
                enc = tok(texts[i : i + bs], padding=True, return_tensors="pt")
                with torch.inference_mode():
                    net(**enc).last_hidden_state[:, -1]  # LAST pooling (right padding aside: timing only)

        count = lambda texts: sum(len(tok(t)["input_ids"]) for t in texts)  # noqa: E731
    out = {}
    for k in keys:
        n = SLICE.get(k, 0)
        if not n:
            continue
        w = WORKLOADS[k]
        texts = w.texts()[:n]
        encode(texts[:1], 1)  # warm up
        bs = 1 if k == "queries" else 16
        start = time.perf_counter()
        encode(texts, bs)
        out[k] = count(texts) / (time.perf_counter() - start)
    return out
