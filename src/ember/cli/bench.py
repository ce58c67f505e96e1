"""`ember bench`: the benchmark workloads, driven over HTTP against any OpenAI-compatible server.

Point it at ember or at a peer (e.g. vLLM's CPU build) with the same client and inputs, so
tokens/s and latencies compare like for like. `benchmarks/run.py` adds the in-process reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["WORKLOADS", "BenchError", "Result", "Workload", "add_parser", "make_texts", "run_workload"]

_WORDS = tuple(
    "retrieval embedding server vector search document query passage model token batch latency cluster "
    "kubernetes memory thread quota index answer question context chunk window merge cosine score rank "
    "the of and to in a is that for on with as by at from it be this are or an was which".split()
)


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]  # approximate tokens per input
    per_request: int  # inputs per request
    concurrency: int  # requests in flight

    def texts(self, round: int = 0) -> list[str]:
        """The inputs, from a seed of the workload's own (and the round's, when repeated): nothing is
        shared across workloads or rounds, so a server with a prefix cache (vLLM) reuses nothing (the
        8k and 12k documents would share 8k tokens; a repeated round would be served from the cache)."""
        return make_texts(self.lengths, seed=zlib.crc32(self.name.encode()) + round)


def _lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


WORKLOADS = {
    "bulk": Workload("bulk: 64 docs x 512 tokens, 16 per request, 4 in flight", (512,) * 64, 16, 4),
    "mixed": Workload("mixed: 256 inputs of 16..1024 tokens", _lengths(256, 16, 1024, 1), 16, 4),
    "queries": Workload("queries: 200 x ~20 tokens, 8 concurrent clients", _lengths(200, 16, 24, 2), 1, 8),
    "query": Workload("one client: 64 queries of ~18 tokens, one at a time", _lengths(64, 14, 22, 3), 1, 1),
    "passages": Workload(
        "passages: 256 chunks of ~150 words, 16 per request, 4 in flight", _lengths(256, 120, 180, 4), 16, 4
    ),
    "long": Workload("one 8,000-token document", (8000,), 1, 1),
    "chunked": Workload("one 12,000-token document, chunked", (12000,), 1, 1),
}


def make_texts(lengths: tuple[int, ...], seed: int = 0) -> list[str]:
    """Texts of roughly the given token counts (about one token per word for BPE and WordPiece)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, n - 1))) for n in lengths]


@dataclass
class Result:
    workload: str
    tokens: int
    seconds: float
    requests: int
    p50_ms: float
    p99_ms: float
    retries: int = 0
    """Requests sent again after a 429/503 (admission control), as the OpenAI SDK and `ember embed --url` do."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class BenchError(Exception):
    """What stops a benchmark, said in one line."""


async def run_workload(url: str, model: str, w: Workload, api_key: str | None = None, round: int = 0) -> Result:
    """Send the workload with `w.concurrency` requests in flight; usage gives the exact tokens. A request turned
    away (429, 503) is sent again after its Retry-After, as clients do; its latency runs from its first send.

    The client is aiohttp with orjson: it shares the CPUs with the server being measured, and costs ~0.25 ms of CPU a
    request against ~1 ms for httpx with the standard json (measured on a 2-vCPU Zen 5, 8 clients of short queries),
    which came out of the server's time in a closed loop."""
    import aiohttp
    import orjson

    texts = w.texts(round)
    batches = [texts[i : i + w.per_request] for i in range(0, len(texts), w.per_request)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)
    latencies: list[float] = []
    tokens = 0
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    retries = 0

    async def post(http: aiohttp.ClientSession, body: bytes) -> tuple[int, bytes, str | None]:
        async with http.post(f"{url}/v1/embeddings", data=body, headers=headers) as r:
            return r.status, await r.read(), r.headers.get("retry-after")

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal tokens, retries
        while not queue.empty():
            body = orjson.dumps({"model": model, "input": queue.get_nowait()})
            start = time.perf_counter()
            status, answer, retry_after = await post(http, body)
            while status in (429, 503):
                retries += 1
                await asyncio.sleep(min(30.0, float(retry_after or 1)))
                status, answer, retry_after = await post(http, body)
            if status >= 400:
                raise BenchError(f"the server answered {status}: {answer[:300].decode(errors='replace')}")
            latencies.append(time.perf_counter() - start)
            tokens += orjson.loads(answer)["usage"]["prompt_tokens"]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(w.concurrency)))
        seconds = time.perf_counter() - start
    qs = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return Result(w.name, tokens, seconds, len(latencies), qs[49] * 1000, qs[98] * 1000, retries)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench", allow_abbrev=False, help="run the benchmark workloads against an OpenAI-compatible server"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (ember or a peer)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--workloads",
        default="bulk,mixed,queries,long",
        help=f"comma list of {', '.join(WORKLOADS)}; those whose inputs exceed the model's max_model_len are skipped "
        "(chunked needs the server's chunked processing on)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        print(
            f"ember bench: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}",
            file=sys.stderr,
        )
        return 2
    try:
        return _run(args, keys)
    except BenchError as e:
        print(f"ember bench: {e}", file=sys.stderr)
        return 2


def _served_model(url: str, api_key: str | None, name: str | None) -> tuple[str, int | None]:
    """The model to send (the server's first unless named) and its max_model_len when the server says it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {e}") from None
    if r.status_code == 401:
        raise BenchError(f"{url} needs an API key (--api-key) or refused the one given")
    try:
        r.raise_for_status()
        cards = r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models did not answer with a model list (HTTP {r.status_code})") from None
    card = next((c for c in cards if c.get("id") == name), None) if name else (cards[0] if cards else None)
    if card is None:
        raise BenchError(f"{url} serves no model named {name!r}" if name else f"{url} serves no model")
    return card["id"], card.get("max_model_len")


def _run(args: argparse.Namespace, keys: list[str]) -> int:
    import aiohttp

    model, max_len = _served_model(args.url, args.api_key, args.model)
    results = []
    for key in keys:
        w = WORKLOADS[key]
        longest = max(w.lengths)
        if max_len is not None and longest > max_len and key != "chunked":
            print(f"skipped {key}: its inputs reach {longest} tokens, over {model}'s max_model_len {max_len}")
            continue
        try:
            result = asyncio.run(run_workload(args.url, model, w, args.api_key))
        except (aiohttp.ClientError, TimeoutError, BenchError) as e:
            raise BenchError(f"{key}: {e}") from None
        results.append(result)
        if not args.json:
            print(
                f"{result.workload:55s} {result.tokens_per_s:9.1f} tok/s  p50 {result.p50_ms:8.1f} ms  "
                f"p99 {result.p99_ms:8.1f} ms"
            )
    if args.json:
        print(json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], indent=2))
    return 0
