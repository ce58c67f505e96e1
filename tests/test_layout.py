"""The package's shape: its public API, function and module sizes, and an import layer for every module."""

import ast
import tomllib
from pathlib import Path

import ember

SRC = Path(__file__).resolve().parents[1] / "src" / "ember"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _modules():
    return sorted(SRC.rglob("*.py"))


def test_the_public_api_is_exactly_what_is_meant_to_be_public():
    assert sorted(ember.__all__) == ["Embedder", "Embeddings", "Reranker", "TokenEmbeddings", "__version__"]
    for name in ember.__all__:
        assert getattr(ember, name) is not None


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_module_is_longer_than_about_four_hundred_lines():
    assert [p.name for p in _modules() if len(p.read_text().splitlines()) > MAX_MODULE_LINES] == []


def test_every_module_opens_with_a_docstring():
    assert [str(p.relative_to(SRC)) for p in _modules() if ast.get_docstring(ast.parse(p.read_text())) is None] == []


def test_every_top_level_module_has_a_place_in_the_import_layers():
    config = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    layers = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    top = {f"ember.{p.stem}" for p in SRC.glob("*.py") if p.stem != "__init__"}
    top |= {f"ember.{p.name}" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert top - named == set()


def test_the_wheel_ships_no_test_scaffolding():
    assert not (SRC / "testing").exists()
    assert not any("checkpoints" in p.parts or p.stem.startswith("test_") for p in _modules())
