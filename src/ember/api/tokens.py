"""Tokens: vLLM's `POST /tokenize` and `/detokenize`; `/tokenize` in TEI's shape for a body in TEI's form
(`inputs`: each input's tokens as `{id, text, special, start, stop}`, offsets in UTF-8 bytes of the text)."""

from __future__ import annotations

from typing import Any, NoReturn

from fastapi import APIRouter, Request, Response

from ember.api.responses import JSONBytes
from ember.api.routes import check_count, context
from ember.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from ember.engine.engine import AsyncEngine
from ember.errors import InputError, RequestTooLargeError

__all__ = ["START_CHARS_PER_TOKEN", "tei_tokens", "tokens"]

tokens = APIRouter()

START_CHARS_PER_TOKEN = 8
"""/tokenize counts the start of a text longer than this many characters per token of the limit first."""


def _start_of_long(text: str, limit: int) -> str | None:
    """The start of a text of more than START_CHARS_PER_TOKEN x `limit` characters, cut at the last whitespace
    before that length; None for shorter texts (or one with no whitespace there). Tokenisers split words at
    whitespace before anything else, so the start's tokens are the text's first tokens: more than `limit` of them
    and the whole text holds more."""
    end = START_CHARS_PER_TOKEN * limit
    if len(text) <= end:
        return None
    cut = max(text.rfind(c, 0, end) for c in " \n\t")
    return text[:cut] if cut > 0 else None


def _too_many_tokens(count: str, limit: int) -> NoReturn:
    raise RequestTooLargeError(
        f"this prompt holds {count} tokens, more than one request may ({limit}, --max-queued-tokens as the memory plan "
        "allows)",
        "prompt",
    )


@tokens.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Any:
    """vLLM's: the prompt's token ids (and strings); TEI's for `inputs`."""
    engine = context(request).served(body.model).engine
    if body.inputs is not None and body.prompt is None:
        request.state.tei = True
        return await _tei_tokenize(body, request, engine)
    if body.prompt is None:
        raise InputError("`prompt` is required (or TEI's `inputs`)", "prompt")
    prompt = body.prompt
    ids = await _bounded_ids(engine, prompt, body.add_special_tokens)
    tok = engine.tokenizer
    strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids, token_strs=strs)


async def _bounded_ids(engine: AsyncEngine, prompt: str, add_special_tokens: bool) -> list[int]:
    """A text's token ids, refused (413) past the tokens one request may hold, a huge text from its start alone."""
    tok = engine.tokenizer
    limit = engine.config.max_queued_tokens
    start = _start_of_long(prompt, limit)
    if start is not None:  # a text far longer than the limit: its start alone tells, without tokenising the rest
        counted = len(await engine.run_in_tokenizer(tok.encode, start, False))
        if counted > limit:
            _too_many_tokens(f"more than {counted}", limit)
    ids: list[int] = await engine.run_in_tokenizer(tok.encode, prompt, add_special_tokens)
    if len(ids) > limit:  # the same bound as one embedding request, before the token strings and the JSON
        _too_many_tokens(str(len(ids)), limit)
    return ids


async def _tei_tokenize(body: TokenizeRequest, request: Request, engine: AsyncEngine) -> Response:
    texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs or [])
    if not texts or any(not t for t in texts):
        raise InputError("`inputs` cannot be empty", "inputs")
    check_count(request, len(texts), "inputs")
    prompt = engine.preprocessor.prompt(body.prompt_name) if body.prompt_name is not None else ""
    answers = []
    for text in texts:
        full = prompt + text
        await _bounded_ids(engine, full, body.add_special_tokens)
        pieces = await engine.run_in_tokenizer(engine.tokenizer.pieces, full, body.add_special_tokens)
        answers.append(tei_tokens(full, pieces, engine.tokenizer.id_to_token))
    return JSONBytes(answers)


def tei_tokens(text: str, pieces: list[tuple[int, bool, int, int]], name: Any) -> list[dict[str, Any]]:
    """TEI's token entries: a special token by its name, with no offsets; any other by the slice of `text` it
    covers, its offsets in UTF-8 bytes."""
    ascii_only = text.isascii()
    out = []
    for token_id, special, start, end in pieces:
        if special:
            out.append({"id": token_id, "text": name(token_id) or "", "special": True, "start": None, "stop": None})
            continue
        b0 = start if ascii_only else len(text[:start].encode())
        b1 = end if ascii_only else b0 + len(text[start:end].encode())
        out.append({"id": token_id, "text": text[start:end], "special": False, "start": b0, "stop": b1})
    return out


@tokens.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = context(request).served(body.model).engine
    text: str = await engine.run_in_tokenizer(engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
