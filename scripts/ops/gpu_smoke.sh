#!/usr/bin/env bash
# On a CUDA machine: the gpu-marked tests, then the demo server on CUDA (bf16) answering
# a completion from the base and from each demo adapter, and one chat request. Usage: bash scripts/ops/gpu_smoke.sh
set -uo pipefail
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.get_device_name(0))'
python3 -m pytest -q -m gpu tests/kernels tests/worker_proc tests/engine 2>&1 | tail -5
log_dir=$(mktemp -d)
python3 -m ledgerserve serve --port 8765 --event-log-dir "$log_dir" > "$log_dir/server.out" 2>&1 &
pid=$!
for _ in $(seq 1 120); do curl -sf localhost:8765/health >/dev/null && break; sleep 1; done
for model in demo-model pirate poet; do
  curl -s localhost:8765/v1/completions -H 'content-type: application/json' \
    -d '{"model": "'$model'", "prompt": "The morning", "max_tokens": 16, "temperature": 0}'; echo
done
curl -s localhost:8765/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'; echo
kill -TERM $pid; wait $pid; echo "server exit $?"
grep -E "ready|KV blocks|ERROR" "$log_dir/server.out"
python3 -m ledgerserve replay --verify "$log_dir"
