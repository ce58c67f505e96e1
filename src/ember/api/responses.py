"""JSON responses written by orjson, which serialises float32 numpy arrays without Python floats."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Response

__all__ = ["JSONBytes"]


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
