"""What the handlers share: the models served (each with its engine and the names clients send), the server's
configuration and its metrics, stored on app.state.ctx by create_app."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException, Request

from ember.api.metrics import Metrics
from ember.config import ServerConfig
from ember.engine.engine import AsyncEngine

__all__ = ["Context", "Served", "context"]


@dataclass(frozen=True)
class Served:
    """One model this server runs: its engine, the names clients may send as `model` (the first is reported), and
    the checkpoint it came from."""

    engine: AsyncEngine
    names: tuple[str, ...]
    path: str = ""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class Context:
    """The models in order (the first answers requests that name none), configuration and metrics."""

    models: tuple[Served, ...]
    config: ServerConfig
    metrics: Metrics
    created: int

    @property
    def engine(self) -> AsyncEngine:
        """The first model's engine."""
        return self.models[0].engine

    @property
    def model_name(self) -> str:
        return self.models[0].name

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        return tuple(m.engine for m in self.models)

    def served(self, model: str | None) -> Served:
        """The model a request names (None: the first); 404 for a name no model has."""
        if model is None:
            return self.models[0]
        for served in self.models:
            if model in served.names:
                return served
        raise HTTPException(404, f"The model `{model}` does not exist.")


def context(request: Request) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx
