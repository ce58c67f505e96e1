"""Vectors on the wire as vLLM sends them: JSON floats, base64, or a raw body (`bytes`, `bytes_only`), in the
`embed_dtype` and `endianness` the request names; and the compact types vector stores keep (`quantize`).

`embed_dtype` is float32 (default), float16, bfloat16 or an fp8 format; each vector is cast to it and its bytes
are sent as they are (bfloat16 and fp8 as their raw bits: 2 and 1 bytes per value). `native` endianness is the
server's byte order. With `bytes`, the `metadata` header holds JSON with each vector's `start`/`end` offsets in the
body, its `shape`, `embed_dtype` and `endianness`, and `usage`, as vLLM's does; `bytes_only` sends the body alone.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any, Literal

import ml_dtypes
import numpy as np
from fastapi import Response

from ember.errors import InputError

__all__ = [
    "COMPACT_TYPES",
    "EMBED_DTYPES",
    "METADATA_ITEMS",
    "CompactType",
    "EmbedDType",
    "Endianness",
    "bytes_response",
    "check_metadata",
    "encode",
    "quantize",
    "to_bytes",
]

EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]

EMBED_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}
"""Each embed_dtype as a numpy type (ml_dtypes for those numpy lacks; it rounds as torch does, as vLLM casts)."""


CompactType = Literal["int8", "uint8", "binary", "ubinary"]
COMPACT_TYPES = ("int8", "uint8", "binary", "ubinary")


def quantize(vectors: np.ndarray, kind: str, param: str) -> np.ndarray:
    """Vectors (..., D) float32 as `kind`, along the last axis: `ubinary` is one bit per value (`v >= 0`), packed
    most-significant bit first (D/8 uint8, D a multiple of 8); `binary` is ubinary - 128 (int8), as vLLM and
    Cohere; `int8` scales each vector so its largest |value| is 127 and rounds; `uint8` is int8 + 128. The scale
    depends on the vector alone, so a text has the same codes alone or in any batch, and decoded codes keep the
    vector's direction up to rounding (cosine to the float vector >= 0.999 at D >= 64)."""
    vectors = np.asarray(vectors, np.float32)
    if kind in ("binary", "ubinary"):
        if vectors.shape[-1] % 8:
            raise InputError(
                f"Embedding dimension must be a multiple of 8 for binary embedding types, but got {vectors.shape[-1]}.",
                param,
            )
        packed = np.packbits(vectors >= 0, axis=-1)
        return (packed.astype(np.int16) - 128).astype(np.int8) if kind == "binary" else packed
    scale = 127.0 / np.maximum(np.abs(vectors).max(axis=-1, keepdims=True), 1e-12)
    codes = np.clip(np.rint(vectors * scale), -127, 127).astype(np.int8)
    return (codes.astype(np.int16) + 128).astype(np.uint8) if kind == "uint8" else codes


def to_bytes(vector: np.ndarray, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """One vector's values as `embed_dtype`, in `endianness` byte order (compact codes: their bytes as they are)."""
    if vector.dtype in (np.int8, np.uint8):
        return np.ascontiguousarray(vector).tobytes()
    raw = np.ascontiguousarray(vector, np.float32).astype(EMBED_DTYPES[embed_dtype])
    if endianness not in ("native", sys.byteorder) and raw.itemsize > 1:
        raw = raw.view(f"u{raw.itemsize}").byteswap()
    return raw.tobytes()


def encode(vector: np.ndarray, encoding_format: str | None, embed_dtype: str, endianness: str) -> Any:
    """A vector for a JSON body: float32 numbers (orjson writes the array) or base64 of its bytes."""
    if encoding_format == "base64":
        return base64.b64encode(to_bytes(vector, embed_dtype, endianness)).decode("ascii")
    return vector


METADATA_ITEMS = 400
"""Most vectors `bytes` describes in its `metadata` header: ~130 bytes each keeps the header under 56 KiB, inside
what clients read in one header line (requests: 64 KiB; httpx: 100 KiB for the whole head; aiohttp only 8 KiB,
some 60 vectors, unless raised with max_field_size). `bytes_only` has no such bound."""


def check_metadata(count: int) -> None:
    """Refuse `bytes` for more vectors than its header can describe, before any is computed."""
    if count > METADATA_ITEMS:
        raise InputError(
            f"encoding_format 'bytes' describes each vector in a `metadata` response header, which clients cannot read "
            f"for {count} vectors (at most {METADATA_ITEMS}): use 'bytes_only' (the same body: vectors back to back "
            "in input order, each dimension x the embed_dtype's size), or send fewer inputs per request",
            "encoding_format",
        )


def bytes_response(
    vectors: list[np.ndarray], envelope: dict[str, Any], encoding_format: str, embed_dtype: str, endianness: str
) -> Response:
    """The vectors back to back as the body; with `bytes`, where each one lies in a `metadata` header."""
    body, items, offset = [], [], 0
    for index, vector in enumerate(vectors):
        raw = to_bytes(vector, embed_dtype, endianness)
        kind = str(vector.dtype) if vector.dtype in (np.int8, np.uint8) else embed_dtype
        items.append(
            {
                "index": index,
                "embed_dtype": kind,
                "endianness": endianness,
                "start": offset,
                "end": offset + len(raw),
                "shape": list(np.shape(vector)),
            }
        )
        body.append(raw)
        offset += len(raw)
    headers = None
    if encoding_format == "bytes":
        meta = {k: envelope[k] for k in ("id", "created", "model", "usage")}
        headers = {"metadata": json.dumps({**meta, "data": items})}
    return Response(b"".join(body), media_type="application/octet-stream", headers=headers)
