"""`ember embed --url`: a job's texts sent to running servers (ember, vLLM, any OpenAI-compatible `/v1/embeddings`).

Texts go in requests of `batch_size` to a shared queue that `concurrency` workers per URL take from, so a faster
server takes more of the work. A 429 or 503 puts the request back in the queue and its worker waits the server's
`Retry-After` (or a growing back-off when none is sent); so do a dropped connection and a 5xx, up to
`max_attempts` per request. A 400 or 413 halves the request until the text at fault stands alone, and only that
text is refused (counted in the job's summary). A 401 or 404 ends the job: the key or the model is wrong.
Vectors travel as base64 float32 (a quarter of the JSON's bytes).
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import random
import time
from typing import Any

import httpx
import numpy as np

from ember.batch.backend import Embedded, refusal, stack_rows
from ember.config import REMOTE_BATCH_SIZE
from ember.errors import ConfigError, EmberError

__all__ = ["RemoteEmbedder"]

_RETRY = {429, 502, 503, 504}
_FATAL = {401, 403, 404}


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    return url + "/embeddings" if url.endswith("/v1") else url + "/v1/embeddings"


def retry_after(header: str | None, attempt: int) -> float:
    """Seconds to wait: the server's Retry-After (seconds or an HTTP date), else 0.5 s doubling, with jitter."""
    if header:
        try:
            return max(0.0, float(header))
        except ValueError:
            when = email.utils.parsedate_to_datetime(header)
            if when is not None:
                return max(0.0, when.timestamp() - time.time())
    return min(30.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0)


class _Batch:
    def __init__(self, start: int, texts: list[str]) -> None:
        self.start, self.texts, self.attempts = start, texts, 0


class RemoteEmbedder:
    """Embed by POSTing to `/v1/embeddings` on one or more servers; call it with texts, close it when done."""

    def __init__(
        self,
        urls: list[str],
        model: str | None = None,
        *,
        api_key: str | None = None,
        batch_size: int = REMOTE_BATCH_SIZE,
        concurrency: int = 4,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt_name: str | None = None,
        timeout: float = 600.0,
        max_attempts: int = 10,
    ) -> None:
        if not urls:
            raise ConfigError("--url needs at least one server")
        self.endpoints = [_endpoint(u) for u in urls]
        self.batch_size, self.concurrency, self.max_attempts = batch_size, concurrency, max_attempts
        self.options = {"dimensions": dimensions, "normalize": normalize, "prompt_name": prompt_name}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.retries = 0
        """Requests sent again (after a 429/503, a 5xx or a dropped connection): the job's log reports it."""
        self._runner = asyncio.Runner()
        self.model = model or self._runner.run(self._first_model())

    async def _first_model(self) -> str:
        url = self.endpoints[0].rsplit("/embeddings", 1)[0] + "/models"
        async with httpx.AsyncClient(timeout=30, headers=self.headers) as client:
            try:
                response = await client.get(url)
                response.raise_for_status()
                return str(response.json()["data"][0]["id"])
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"cannot ask {url} for its model ({e}); pass --model") from None

    def __call__(self, texts: list[str]) -> Embedded:
        return self._runner.run(self._embed(texts))

    def close(self) -> None:
        self._runner.close()

    async def _embed(self, texts: list[str]) -> Embedded:
        out = _Results(len(texts))
        queue: asyncio.Queue[_Batch] = asyncio.Queue()
        for start in range(0, len(texts), self.batch_size):
            queue.put_nowait(_Batch(start, texts[start : start + self.batch_size]))
        limits = httpx.Limits(max_connections=self.concurrency * len(self.endpoints))
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers, limits=limits) as client:
            workers = [
                asyncio.create_task(self._worker(client, url, queue, out))
                for url in self.endpoints
                for _ in range(self.concurrency)
            ]
            joined = asyncio.create_task(queue.join())
            try:
                await asyncio.wait([joined, *workers], return_when=asyncio.FIRST_COMPLETED)
                for w in workers:
                    if w.done() and w.exception() is not None:
                        raise w.exception()  # type: ignore[misc]
            finally:
                for task in (joined, *workers):
                    task.cancel()
        return out.embedded()

    async def _worker(self, client: httpx.AsyncClient, url: str, queue: asyncio.Queue[_Batch], out: _Results) -> None:
        while True:
            batch = await queue.get()
            try:
                wait = await self._send(client, url, batch, queue, out)
            finally:
                queue.task_done()
            if wait:
                await asyncio.sleep(wait)

    async def _send(
        self, client: httpx.AsyncClient, url: str, batch: _Batch, queue: asyncio.Queue[_Batch], out: _Results
    ) -> float:
        """Send one request; returns how long this worker should wait before its next one."""
        body: dict[str, Any] = {"model": self.model, "input": batch.texts, "encoding_format": "base64"}
        body.update({k: v for k, v in self.options.items() if v is not None})
        try:
            response = await client.post(url, json=body)
        except httpx.TransportError as e:
            return self._again(batch, queue, None, f"{url}: {e!r}")
        if response.status_code == 200:
            out.put(batch.start, response.json())
            return 0.0
        if response.status_code in _RETRY or response.status_code >= 500:
            return self._again(batch, queue, response.headers.get("retry-after"), f"{url}: {response.status_code}")
        message = _message(response)
        if response.status_code in _FATAL:
            key = "; pass the server's key with --api-key" if response.status_code in (401, 403) else ""
            raise ConfigError(f"{url} answered {response.status_code}: {message}{key}")
        if len(batch.texts) == 1:  # 400, 413, 422: this text is at fault
            out.refuse(batch.start, refusal(Exception(message)), message)
            return 0.0
        half = len(batch.texts) // 2
        queue.put_nowait(_Batch(batch.start, batch.texts[:half]))
        queue.put_nowait(_Batch(batch.start + half, batch.texts[half:]))
        return 0.0

    def _again(self, batch: _Batch, queue: asyncio.Queue[_Batch], header: str | None, why: str) -> float:
        batch.attempts += 1
        if batch.attempts >= self.max_attempts:
            raise EmberError(f"gave up after {batch.attempts} attempts ({why}); run the same command again to resume")
        self.retries += 1
        queue.put_nowait(batch)
        return retry_after(header, batch.attempts)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


class _Results:
    """Vectors by position as answers arrive, in any order."""

    def __init__(self, n: int) -> None:
        self.rows: list[np.ndarray | None] = [None] * n
        self.refused: dict[int, str] = {}
        self.messages: dict[int, str] = {}
        self.tokens = 0

    def put(self, start: int, answer: dict[str, Any]) -> None:
        for item in answer["data"]:
            vector = item["embedding"]
            row = (
                np.frombuffer(base64.b64decode(vector), "<f4")
                if isinstance(vector, str)
                else np.asarray(vector, np.float32)
            )
            self.rows[start + int(item["index"])] = row
        self.tokens += int(answer.get("usage", {}).get("prompt_tokens", 0))

    def refuse(self, index: int, why: str, message: str) -> None:
        self.refused[index], self.messages[index] = why, message

    def embedded(self) -> Embedded:
        return Embedded(stack_rows(self.rows), None, self.tokens, self.refused, self.messages)
