#!/bin/sh
# infinity (michaelfeil/infinity, `infinity_emb v2`) as benchmarks/interleaved.py --peer-cmd starts it, on the same
# cores as ember. ENGINE: torch (default), the one that keeps a model's own pooling (sentence-transformers' modules:
# Qwen3-Embedding's last token), or optimum (ONNX Runtime on the onnx/*.onnx files the model directory holds; it
# pools by mean or CLS only, right for BERT-style models such as all-MiniLM-L6-v2; it did not start with torch 2.13:
# docs/performance.md). Everything else as it ships: torch.compile(dynamic=True) on, its start-up warm-up on, dtype
# auto (float32 on a CPU), batches of up to 32.
# Its own venv, with the local CPU torch as a constraint:
#
#   python3.11 -m venv .infinity-venv && .infinity-venv/bin/pip install torch==2.13.0
#   .infinity-venv/bin/pip freeze | grep '^torch==' > /tmp/torch-cpu.txt
#   .infinity-venv/bin/pip install -c /tmp/torch-cpu.txt "infinity-emb[server,torch,optimum]==0.0.78" "transformers==4.57.6"
#
#   VENV=.infinity-venv MODEL=models/qwen3-emb-0.6b-random NAME=qwen3-emb-0.6b-random PORT=8100 \
#     sh benchmarks/serve_infinity.sh [infinity_emb v2 args]
VENV=${VENV:-$PWD/.infinity-venv}
MODEL=${MODEL:-models/qwen3-emb-0.6b-random}
NAME=${NAME:-qwen3-emb-0.6b-random}
PORT=${PORT:-8100}
ENGINE=${ENGINE:-torch}
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=1 INFINITY_ANONYMOUS_USAGE_STATS=0
# /v1/embeddings as the OpenAI clients (and ember bench) call it; /health stays at the root
exec "$VENV"/bin/infinity_emb v2 --model-id "$MODEL" --served-model-name "$NAME" --engine "$ENGINE" --device cpu \
  --port "$PORT" --url-prefix /v1 "$@"
