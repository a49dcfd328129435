#!/usr/bin/env bash
# On a host with two CUDA GPUs: tensor parallel 2 against one GPU, one stage a call (each fits in
# ten minutes), its reports and logs written under OUT_DIR.
#   bash scripts/ops/gpu_tp2.sh tests OUT_DIR    every gpu-marked test: one GPU's and TP 2's (sharded Triton and graph paths, PEFT parity)
#   bash scripts/ops/gpu_tp2.sh servers OUT_DIR  scripts/ops/tp_smoke.py at TP 2: the demo model and a Llama-3-8B-shaped dummy
#   bash scripts/ops/gpu_tp2.sh decode OUT_DIR   bench_decode.py: TP 2 against TP 1 in one run, one step at a time and with
#                                            --async-scheduling, then TP 2 with NCCL alone, and TP 2 with each
#                                            all-reduce its own kernel (none fused into the norm)
#   bash scripts/ops/gpu_tp2.sh profile OUT_DIR  the same rows' per-kernel tables at TP 1 and TP 2 (PDL off), and
#                                            bench_all_reduce.py: one-shot against NCCL from 16 KiB to 16 MiB
#   bash scripts/ops/gpu_tp2.sh serving OUT_DIR  bench_adapter_churn.py (64 adapters in 64 slots, Poisson) at TP 1 and TP 2
set -uo pipefail
stage=${1:?usage: gpu_tp2.sh tests|servers|decode|profile|serving OUT_DIR}
out=${2:?usage: gpu_tp2.sh tests|servers|decode|profile|serving OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
decode="python3 -m scripts.decode.bench_decode --tensor-parallel-size 2 --batch-sizes 1,32 --adapters 0,32 --steps 30 --warmup 5"
case "$stage" in
  tests)
    python3 -m pytest -q -m gpu tests --ignore=tests/tokenizer_proc/test_fuzz.py 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
  servers)
    python3 -m scripts.ops.tp_smoke --tensor-parallel-size 2 --out "$out/tp2_demo.json"
    python3 -m scripts.ops.tp_smoke --tensor-parallel-size 2 --llama3-8b-dummy --out "$out/tp2_8b_dummy.json" ;;
  decode)
    $decode --compare-tp1 --out "$out/tp2_decode.json"
    $decode --compare-tp1 --async-scheduling --out "$out/tp2_decode_async.json"
    $decode --disable-custom-all-reduce --out "$out/tp2_decode_nccl.json"
    LEDGERSERVE_FUSED_ALL_REDUCE_NORM=0 $decode --out "$out/tp2_decode_unfused.json" ;;
  profile)
    $decode --compare-tp1 --profile-steps 10 --out "$out/tp2_decode_profile.json"
    python3 -m scripts.decode.bench_all_reduce --tensor-parallel-size 2 --out "$out/tp2_all_reduce.json" ;;
  serving)
    for n in 1 2; do
      python3 -m scripts.adapters.bench_adapter_churn --groups 1 --arrivals poisson --tensor-parallel-size $n \
        --out "$out/tp2_serving_tp$n.json" --plot "$out/tp2_serving_tp$n.png" 2>&1 | tail -4
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
