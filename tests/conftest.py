import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeRunner, minilm_tokenizer


def pytest_configure(config):
    """EMBER_MAX_ISA=avx512_bf16|avx512|avx2 runs the suite as a CPU of that tier would (as `ember serve` does):
    an AMX machine then checks the AVX-512 BF16 and AVX2 paths too."""
    import os

    from ember.cli.runtime import cap_isa

    cap_isa(os.environ.get("EMBER_MAX_ISA") or None)


@pytest.fixture(scope="session")
def tokenizer():
    return minilm_tokenizer()


@pytest.fixture
def runner(tokenizer):
    return FakeRunner(tokenizer.vocab_size)


@pytest.fixture
def client(runner, tokenizer):
    """The HTTP app over the fake runner, serving it as model "m"."""
    from fastapi.testclient import TestClient

    from ember.api.app import create_app
    from ember.config import EngineConfig, ServerConfig
    from ember.engine.engine import AsyncEngine

    engine = AsyncEngine(runner, tokenizer, EngineConfig(), None)
    with TestClient(create_app(engine, ServerConfig(served_model_names=("m",))), raise_server_exceptions=False) as c:
        yield c
