"""Heads belong to the model: a family with a head of its own is one class in models/ plus a registry line, and the
engine and API follow what the head declares."""

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from checkpoints.builders import build_bert
from ember.api.pooling import pooling_tasks
from ember.errors import InputError
from ember.models import registry
from ember.models.bert import BertModel
from ember.models.heads import Head, HeadContext
from ember.offline import Embedder
from ember.types import HeadSpec, Output


class _TokenNormHead(Head):
    """A made-up family's head: embed is the max over tokens of the states, token_classify each token's L2 norm."""

    spec = HeadSpec(outputs=("embed", "token_classify"))

    def __call__(self, hidden, seqlens, owners=None):
        return torch.stack([s.float().amax(0) for s in hidden.split(seqlens)])

    def tokens(self, states: torch.Tensor, output: Output) -> torch.Tensor:
        return states.float().norm(dim=-1)


class _ToyModel(BertModel):
    def head(self, ctx: HeadContext) -> Head:
        return _TokenNormHead(ctx.pooling.method, self.hidden_size)


@pytest.fixture(scope="module")
def toy(tmp_path_factory, monkeypatch_module):
    path = build_bert(tmp_path_factory.mktemp("toy"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["ToyModel"]}))
    monkeypatch_module.setitem(registry.ARCHITECTURES, "ToyModel", _ToyModel)  # the one registry line
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_a_family_with_its_own_head_needs_nothing_in_engine_or_api(toy):
    ours = Embedder(str(toy), dtype="float32", enforce_eager=True)
    plain = Embedder(str(toy), dtype="float32", enforce_eager=True, hf_overrides={"architectures": ["BertModel"]})
    assert ours.info.head.outputs == ("embed", "token_classify") and pooling_tasks(ours.info) == ours.info.head.outputs
    texts = ["a short text", "another, somewhat longer text to embed"]
    states = [_states(plain, t) for t in texts]
    vectors = ours.embed(texts, normalize=False).vectors
    np.testing.assert_allclose(vectors, np.stack([s.max(0) for s in states]), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="does not give token_embed; it gives embed, token_classify"):
        ours.embed_tokens(texts)


def test_the_api_derives_the_tasks_from_the_head(toy):
    from ember.api.app import create_app
    from ember.config import EngineConfig, ServerConfig
    from ember.engine.engine import AsyncEngine

    ours = Embedder(str(toy), dtype="float32", enforce_eager=True)
    runner = ours._loaded.runner
    engine = AsyncEngine(runner, ours.tokenizer, EngineConfig(compile_kernels=False), None)
    with TestClient(create_app(engine, ServerConfig(("toy",)))) as client:
        r = client.post("/pooling", json={"model": "toy", "input": "x y", "task": "token_embed"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "Unsupported task: 'token_embed' Supported tasks: ('embed', 'token_classify')"
        )
        r = client.post("/pooling", json={"model": "toy", "input": "hello world", "task": "embed"})
        assert r.status_code == 200 and len(r.json()["data"][0]["data"]) == ours.info.dimension


def _states(embedder: Embedder, text: str) -> np.ndarray:
    """The encoder's last hidden states (tokens, hidden) for one text, through the model itself."""
    runner = embedder._loaded.runner
    ids = embedder.tokenizer.encode(text)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), [len(ids)])
    return hidden.float().numpy()
