"""The sentence-transformers Dense module: a linear projection and activation after pooling."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ember.errors import CheckpointError, UnsupportedModelError
from ember.models.checkpoint import iter_weights

__all__ = ["Dense"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.SiLU": nn.SiLU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}


class Dense(nn.Module):
    """Linear (+ bias) then activation, applied in float32 to pooled vectors (B, in) -> (B, out)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))

    @classmethod
    def load(cls, path: Path) -> Dense:
        """Read a Dense module directory (config.json and its weights)."""
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read the Dense module config in {path}: {e}") from None
        if cfg.get("use_residual"):
            raise UnsupportedModelError(f"{path}: a Dense module with use_residual is not supported")
        act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act_name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{path}: Dense activation {act_name!r} is not supported")
        dense = cls(cfg["in_features"], cfg["out_features"], cfg.get("bias", True), _ACTIVATIONS[act_name]())
        state = {name: t.float() for name, t in iter_weights(path)}
        try:
            dense.load_state_dict(state, strict=False)
            missing = set(dense.state_dict()) - set(state)
        except RuntimeError as e:
            raise CheckpointError(f"{path}: Dense weights do not match its config: {e}") from None
        if missing:
            raise CheckpointError(f"{path}: Dense weights are missing {sorted(missing)}")
        return dense.eval()
