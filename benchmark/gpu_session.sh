#!/usr/bin/env bash
# GPU-machine session (see ../shared/devicekit/README.md): run after the three devicekit parts are installed.
#   bash benchmark/gpu_session.sh kernels   # GPU correctness tests + SGLang baseline + AP kernel benchmark
#   bash benchmark/gpu_session.sh serve     # server smoke test + bench_one_batch stock bf16 vs AP 4-bit
# Writes everything under $OUT (default out/gpu).
set -uo pipefail
stage="${1:-kernels}"
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site . >/tmp/pw_install.log 2>&1 \
  || { cat /tmp/pw_install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 

if [ "$stage" = kernels ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_*.py tests/test_kernel_*.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 benchmark/sglang_moe_baseline.py --out "$OUT/baseline.json" >"$OUT/baseline.log" 2>&1
  tail -3 "$OUT/baseline.log"
  timeout 300 python3 benchmark/kernel_bench.py --baseline-json "$OUT/baseline.json" --out "$OUT/kernel.json" \
    --time-budget-s 240 2>&1 | tail -40 | tee "$OUT/kernel_bench.txt"
fi

if [ "$stage" = serve ]; then
  model=/tmp/qwen15moe-dummy
  python3 benchmark/dummy_model.py --model qwen15moe --out $model >/dev/null
  common=(--model-path $model --load-format dummy --attention-backend triton --sampling-backend pytorch)
  # 1. The server command with --enable-paged-weight answers a request.
  python3 -m sglang.launch_server "${common[@]}" --enable-paged-weight --paged-weight-bits 4 --port 30000 \
    --mem-fraction-static 0.5 --cuda-graph-max-bs 8 >"$OUT/server.log" 2>&1 &
  for i in $(seq 1 150); do curl -sf localhost:30000/health_generate >/dev/null && break; sleep 2; done
  curl -s -H 'Content-Type: application/json' localhost:30000/generate \
    -d '{"text":"hello world","sampling_params":{"max_new_tokens":16,"temperature":0}}' | tee "$OUT/generate.json"; echo
  grep "PagedWeight:" "$OUT/server.log" | tail -1
  pkill -f sglang.launch_server; sleep 5
  # 2. bench_one_batch side by side: stock bf16 experts vs AP 4-bit experts (same dummy model, same run).
  bench=(--batch-size 1 4 16 64 --input-len 2048 --output-len 64 --cuda-graph-max-bs 64 --mem-fraction-static 0.8)
  timeout 200 python3 -m sglang.bench_one_batch "${common[@]}" "${bench[@]}" --result-filename "$OUT/obb_bf16.jsonl" \
    >"$OUT/obb_bf16.log" 2>&1; tail -4 "$OUT/obb_bf16.log"
  timeout 240 python3 benchmark/bench_one_batch.py "${common[@]}" "${bench[@]}" --enable-paged-weight \
    --paged-weight-bits 4 --result-filename "$OUT/obb_ap4.jsonl" >"$OUT/obb_ap4.log" 2>&1; tail -4 "$OUT/obb_ap4.log"
fi
ls -la "$OUT"
