"""One CPU embedding path, timed in its own process: `python cpu_path.py PATH MODEL_DIR JOB.json` prints one JSON line.

Runs under whichever Python has the path's library (ember's, or a venv with sentence-transformers, its ONNX and
OpenVINO backends and llama-cpp-python): it imports nothing of ember's unless PATH is ember. benchmarks/cpu_paths.py
starts it, round after round, with the paths in turn.

PATH is one of:
- ember, ember-int8: `ember.Embedder` (float32 on CPUs without fast bf16, as `--dtype auto`; int8 weights);
- st: sentence-transformers on torch (float32);
- st-onnx, st-onnx-int8: sentence-transformers' ONNX backend (ONNX Runtime) on the model's ONNX export, and on its
  dynamically quantised int8 export (`export_dynamic_quantized_onnx_model`, the config for this CPU's ISA);
- st-openvino: sentence-transformers' OpenVINO backend on the model's OpenVINO export (float32);
- llama.cpp-f32, llama.cpp-q8: llama-cpp-python on the model converted to GGUF (F32, and Q8_0).
Exports are made once into the repository's models/exports/<model>/ (outside the timing) and read back after.
ember runs under the allocator its server preloads (tcmalloc, when installed); the others under their own.

JOB.json: {"queries": [...], "passages": [...], "check": [...], "batch": 32, "threads": 2, "llama_batch": 512}.
Timed: the load (the path's imports; for all but ember, torch is imported before the clock starts), each query alone
(a list of one text, as a server's single request), and the passages in batches of `batch`. The check texts' vectors
come back for the parent to compare across paths.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Encode = Callable[[list[str]], Any]


EXPORTS = Path(__file__).resolve().parents[2] / "models" / "exports"


def exports(model: Path) -> Path:
    """Where the model's exports go: models/exports/<model directory's name>/ in the repository."""
    return EXPORTS / (model.parent.name if model.name == "model" else model.name)  # the bundled copy: its package


def isa() -> str:
    """The ISA name ONNX Runtime's dynamic quantisation configs use for this CPU."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512_vnni" in flags:
        return "avx512_vnni"
    if " avx512f" in flags:
        return "avx512"
    return "avx2" if " avx2" in flags else "arm64"


def st_model(model: Path, backend: str, file_name: str | None, threads: int) -> Any:
    from sentence_transformers import SentenceTransformer

    kwargs: dict[str, Any] = {}
    if backend == "onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        kwargs = {"provider": "CPUExecutionProvider", "session_options": options}
        if file_name:
            kwargs["file_name"] = file_name
    elif backend == "openvino":
        kwargs = {"ov_config": {"INFERENCE_NUM_THREADS": str(threads)}}
    return SentenceTransformer(str(model), device="cpu", backend=backend, model_kwargs=kwargs)


def export_st(model: Path, kind: str) -> Path:
    """The model with its ONNX (kind onnx, onnx-int8) or OpenVINO export, made once; its directory."""
    out = exports(model) / kind.split("-")[0]
    marker = out / f".done-{kind}"
    if marker.exists():
        return out
    from sentence_transformers import SentenceTransformer

    if not (out / ".done-base").exists():
        st = SentenceTransformer(str(model), device="cpu", backend=kind.split("-")[0])
        st.save_pretrained(str(out))
        (out / ".done-base").touch()
    if kind == "onnx-int8":
        from sentence_transformers import export_dynamic_quantized_onnx_model

        st = SentenceTransformer(str(out), device="cpu", backend="onnx")
        export_dynamic_quantized_onnx_model(st, isa(), str(out))
    marker.touch()
    return out


def export_gguf(model: Path, kind: str) -> Path:
    """The model converted to GGUF by llama.cpp's convert_hf_to_gguf.py (LLAMA_CPP_CONVERT), once."""
    out = exports(model) / f"model-{kind}.gguf"
    if not out.exists():
        script = os.environ.get("LLAMA_CPP_CONVERT")
        if not script:
            raise SystemExit("set LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py")
        out.parent.mkdir(parents=True, exist_ok=True)
        outtype = {"f32": "f32", "q8": "q8_0"}[kind]
        cmd = [sys.executable, script, str(model), "--outtype", outtype, "--outfile", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def llama_pooling(model: Path) -> int:
    """llama.cpp's pooling type for the model's sentence-transformers pooling (1_Pooling/config.json); -1: the
    GGUF's own (set by the converter for the models it knows as embedders)."""
    config = model / "1_Pooling" / "config.json"
    if not config.exists():
        return -1
    modes = json.loads(config.read_text())
    for key, kind in (("pooling_mode_lasttoken", 3), ("pooling_mode_cls_token", 2), ("pooling_mode_mean_tokens", 1)):
        if modes.get(key):
            return kind
    return -1


def load(path: str, model: Path, threads: int, job: dict[str, Any]) -> Encode:
    """The path's model, ready: a function from texts to normalised vectors (one batch)."""
    if path.startswith("ember"):
        from ember import Embedder

        e = Embedder(str(model), quantization="int8" if path == "ember-int8" else None, threads=threads)
        return lambda texts: e.embed(texts, normalize=True).vectors
    if path.startswith("llama.cpp"):
        from llama_cpp import Llama

        gguf = export_gguf(model, path.split("-")[1])
        # one micro-batch of `llama_batch` tokens: llama.cpp attends over a whole micro-batch (masked per sequence),
        # so one of 8,192 tokens ran MiniLM's passages (~200 tokens) 7x slower in F32; 512 holds any MiniLM text
        n = int(job.get("llama_batch", 512))
        llm = Llama(str(gguf), embedding=True, n_threads=threads, n_threads_batch=threads, n_ctx=n, n_batch=n,
                    n_ubatch=n, pooling_type=llama_pooling(model), verbose=False)  # fmt: skip
        return lambda texts: llm.embed(texts, normalize=True)
    if path == "st":
        st = st_model(model, "torch", None, threads)
    else:
        kind = path.removeprefix("st-")
        out = export_st(model, kind)
        # ONNX Runtime's int8 export: signed weights with VNNI, unsigned on AVX2 (model_quint8_avx2.onnx)
        file_name = next(out.glob(f"onnx/model_q*int8_{isa()}.onnx")).relative_to(out) if kind == "onnx-int8" else None
        st = st_model(out, kind.split("-")[0], str(file_name) if file_name else None, threads)
    return lambda texts: st.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True)


def main() -> None:
    path, model, job_file = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if path.startswith("ember"):
        from ember.cli.runtime import maybe_reexec_with_allocator

        maybe_reexec_with_allocator(sys.argv[1:], program=[sys.executable, __file__])
    job = json.loads(Path(job_file).read_text())
    threads = int(job.get("threads", 2))
    if path != "ember" and not path.startswith("ember-"):
        import torch

        torch.set_num_threads(threads)
    if path.startswith(("st-onnx", "st-openvino")):  # the export, outside the timing
        export_st(model, path.removeprefix("st-"))
    elif path.startswith("llama.cpp"):
        export_gguf(model, path.split("-")[1])
    start = time.perf_counter()
    encode = load(path, model, threads, job)
    loaded = time.perf_counter() - start
    for text in job["queries"][:5]:  # warm up: first calls build kernels and caches
        encode([text])
    encode(job["passages"][: job["batch"]])
    latencies = []
    for text in job["queries"][5:]:
        t0 = time.perf_counter()
        encode([text])
        latencies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    batch = job["batch"]
    for i in range(0, len(job["passages"]), batch):
        encode(job["passages"][i : i + batch])
    bulk = time.perf_counter() - t0
    vectors = [[float(v) for v in row] for row in encode(job["check"])]
    out = {"path": path, "load_s": loaded, "query_p50_ms": 1000 * statistics.median(latencies), "bulk_s": bulk}
    print(json.dumps({**out, "check": vectors}), flush=True)


if __name__ == "__main__":
    main()
