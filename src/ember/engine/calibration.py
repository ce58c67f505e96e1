"""int8 calibration at load: the text the weights are rounded against (GPTQ, ember.ops.gptq), the float forward
that shows each layer its inputs, and the cache that keeps the result, so it is done once per model.

The default text is `calibration.txt` beside this file: English sentences from ember's own documentation (not the
text the retrieval benchmark measures on), some 2,000 tokens. `--quantization-calibration FILE` gives other text
(one text per line), `none` plain rounding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.errors import ConfigError
from ember.ops.gptq import MAX_INPUTS
from ember.ops.linear import widen_bf16
from ember.ops.quant import Int8Weights
from ember.ops.rotation import BLOCK
from ember.ops.tokenwise import TOKEN_SLICE
from ember.tokenizer import Tokenizer

__all__ = ["Int8Cache", "calibration_forward", "calibration_texts"]

log = logging.getLogger("ember.engine")

VERSION = 1
"""Changes whenever the rounding changes, so older cached weights are not read."""

_BUNDLED = Path(__file__).with_name("calibration.txt")


def calibration_texts(source: str | None) -> list[str] | None:
    """The calibration texts `--quantization-calibration` names: None for plain rounding."""
    if source is not None and source.lower() == "none":
        return None
    path = Path(source) if source is not None else _BUNDLED
    try:
        texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--quantization-calibration {source}: cannot read it ({e})") from None
    if not texts:
        raise ConfigError(f"--quantization-calibration {source}: no text in it (one text per line)")
    return texts


def calibration_forward(
    model: torch.nn.Module, tokenizer: Tokenizer, texts: list[str], max_len: int, widen: bool = False
) -> tuple[Callable[[], None], int]:
    """A function that runs `model` once over the texts, packed into one batch of at most a token slice (so each
    layer meets them all in one call), and the batch's token count. `widen`: a float32 model loaded with its
    checkpoint's bf16 matrices (ember.engine.build, for int8), widened for this forward as it goes."""
    seqs: list[list[int]] = []
    total = 0
    for ids in tokenizer.encode_batch(texts):
        ids = ids[:max_len]
        if total + len(ids) > TOKEN_SLICE:
            break
        seqs.append(ids)
        total += len(ids)
    lens = [len(s) for s in seqs]

    @torch.no_grad()
    def run() -> None:
        input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        # with `widen`, the rest now and each matrix only as its layer is called (then quantised and freed), so
        # the model is never whole in float32
        held = []
        if widen:
            held = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16]
            widen_bf16(model, keep=held)
        hooks = [m.register_forward_pre_hook(_widen_weight) for m in held]
        try:
            model(input_ids, positions, lens, None)
        finally:
            for hook in hooks:
                hook.remove()

    return run, total


def _widen_weight(linear: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    """A forward pre-hook: the layer's bf16 weight to float32, for the float forward that calibrates int8."""
    assert isinstance(linear, torch.nn.Linear)
    if linear.weight.dtype == torch.bfloat16:
        linear.weight = torch.nn.Parameter(linear.weight.detach().float(), requires_grad=False)


class Int8Cache:
    """Calibrated int8 weights on disk, one file per layer, under a key of everything they depend on (the
    checkpoint's files, the compute dtype, the calibration text, the rounding's version). Complete once every
    layer is written; an incomplete or unwritable cache is simply not used."""

    def __init__(self, root: Path, checkpoint: Path, dtype: torch.dtype, texts: list[str]) -> None:
        digest = hashlib.sha256()
        digest.update(json.dumps([VERSION, BLOCK, MAX_INPUTS, str(dtype), texts]).encode())
        for file in sorted(checkpoint.iterdir()) if checkpoint.is_dir() else []:
            if file.is_file():
                stat = file.stat()
                digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        self.dir = root / "int8" / digest.hexdigest()[:32]
        self.complete = (self.dir / "complete").exists()
        self.writable = not self.complete

    def known(self, name: str) -> Int8Weights | None:
        if not self.complete:
            return None
        try:
            tensors = load_file(self.dir / f"{name}.safetensors")
        except Exception as e:  # a file gone or damaged: calibrate again, and rewrite the cache
            log.warning("int8 calibration cache unreadable (%s): plain rounding now, calibrating at the next start", e)
            self.complete = self.writable = False
            with contextlib.suppress(OSError):
                (self.dir / "complete").unlink()
            return None
        return tensors["q"], tensors["scale"]

    def keep(self, name: str, weights: Int8Weights) -> None:
        if not self.writable:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tensors = {"q": weights[0].contiguous(), "scale": weights[1].contiguous()}
            part = self.dir / f"{name}.{os.getpid()}.part"  # whole or absent: another process may read the cache
            save_file(tensors, part)
            os.replace(part, self.dir / f"{name}.safetensors")
        except OSError as e:
            log.warning("int8 calibration not cached (%s): it will run again at the next start", e)
            self.writable = False

    def finish(self) -> None:
        """Mark the cache complete (every layer written)."""
        if self.writable:
            try:
                (self.dir / "complete").touch()
            except OSError as e:
                log.warning("int8 calibration not cached (%s): it will run again at the next start", e)
