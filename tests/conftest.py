import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeRunner, minilm_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return minilm_tokenizer()


@pytest.fixture
def runner(tokenizer):
    return FakeRunner(tokenizer.vocab_size)
