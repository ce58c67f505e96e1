"""JSON responses written by orjson, which serialises float32 numpy arrays without Python floats."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Response

__all__ = ["JSONBytes", "usage"]


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def usage(tokens: int) -> dict[str, Any]:
    """OpenAI's usage block: every token is a prompt token."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}
