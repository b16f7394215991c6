#!/usr/bin/env bash
# GPU-machine session (see ../shared/devicekit/README.md): run after the three devicekit parts are installed.
#   bash benchmark/gpu_session.sh tests     # GPU correctness tests only (runtime, kernels, TP sync on one GPU)
#   bash benchmark/gpu_session.sh kernels   # GPU correctness tests + SGLang baseline + AP kernel benchmark
#   bash benchmark/gpu_session.sh prefill   # MoE kernel tests + prefill sizes (M 256, 2048) side by side with SGLang's
#                                           # kernels: dense GEMMs on SGLang's kernel vs ours after dequantization
#   bash benchmark/gpu_session.sh lut       # the prefill dequantization alone (benchmark/dequant_sweep.py; no devicekit)
#   bash benchmark/gpu_session.sh dequant   # kernel GPU tests + the prefill dequantization alone, CUDA vs Triton (no devicekit)
#   bash benchmark/gpu_session.sh ubcq      # GPU kernel tests (every table kind) + ubcq vs bcq: MoE at 4 bits, M 1..2048,
#                                           # and the prefill dequantization alone (no devicekit)
#   bash benchmark/gpu_session.sh mma       # CUDA tensor-core kernel (ubcq): GPU tests, then MoE timings beside the LUT
#                                           # kernel and the tiles (MMA_PARTS="tests sweep bench", KB_MS, KB_CASES; no devicekit)
#   bash benchmark/gpu_session.sh decode    # fold kernel GPU tests, then SGLang's bf16 / FP8 block128 / Marlin W4A16 /
#                                           # W8A16 MoE (sglang_moe_anchors.py, copied into .carry/bench and carried) and
#                                           # benchmark/decode_bench.py beside them, M 1..64 (issue #18's headline keys)
#   bash benchmark/gpu_session.sh fold      # fold kernel: the whole test_kernel_fold.py, then fold_sweep.py's named variants
#                                           # (FOLD_CANDIDATES, default the shared-activation rule and the one before it) on every decode shape,
#                                           # M 1..64 (FOLD_MODELS, KB_MS, FOLD_CASE; no devicekit)
#   bash benchmark/gpu_session.sh grouped   # prefill: grouped-kernel GPU tests, SGLang's bf16 / FP8 block128 MoE at
#                                           # M 256..8192 (sglang_moe_anchors.py, carried in .carry/bench) and
#                                           # benchmark/prefill_bench.py beside them (GROUPED_PARTS="tests anchors bench",
#                                           # PB_MODELS, PB_MS, PB_CASES; tests and bench need no devicekit); the parts
#                                           # "sweep" (grouped_sweep.py: SW_MODELS, SW_MS, SW_CONFIGS) and "diag"
#                                           # (grouped_diag.py: DIAG_MODELS, DIAG_M, DIAG_CONFIG, DIAGS) run first,
#                                           # then "ncu" (grouped_ncu.py: NCU_MODEL, NCU_M, NCU_CONFIGS of sweep tags,
#                                           # default the served 256 x 128 config and the session-32 one, with the
#                                           # warps' stall reasons); GROUPED_TESTS_K narrows "tests" (pytest -k)
#   bash benchmark/gpu_session.sh lutk      # CUDA LUT kernel: GPU tests + linear and MoE decode timings (no devicekit)
#   bash benchmark/gpu_session.sh linear    # dense AP linear tests + benchmark/linear_bench.py (no devicekit needed)
#   bash benchmark/gpu_session.sh serve     # server smoke test + bench_one_batch stock bf16 vs AP 4-bit experts vs
#                                           # AP 4-bit scope all (SERVE_SYSTEMS="smoke bf16 ap4 ap4_all scope_check")
#   bash benchmark/gpu_session.sh pressure  # KV-pressure bursts: PagedWeight (+poison) vs stock bf16, same budget
#   bash benchmark/gpu_session.sh tp2       # two GPUs: stock --tp 2 vs PagedWeight --tp 2 (burst, held plan,
#                                           # reload) vs a server started at the held plan; TP2_SYSTEMS picks
#                                           # servers, results append to /tmp/tp2/tp2.json across calls
#   bash benchmark/gpu_session.sh tp_overhead # two TP processes on one GPU (benchmark/tp_overhead_bench.py, issue #20): the
#                                           # PagedWeight step and its TP agreement per rank, steady and offload/reload,
#                                           # beside the shard's MoE decode step at batch 1 and 16 (TPO_MODELS, TPO_ITERS;
#                                           # needs SGLang from the devicekit; nothing of it has run on a GPU yet)
#   bash benchmark/gpu_session.sh models    # issue #23's families at real shapes with dummy weights (benchmark/dummy_model.py;
#                                           # MODELS_RUN="deepseek_v2_lite:27 glm45_air:12 gemma4_26b_a4b:12", name:layers): bench_one_batch
#                                           # stock bf16 (RMSNorm weights at 1 as PagedWeight sets them, so both route
#                                           # alike) vs PagedWeight 4-bit experts (OBB_BATCHES, OBB_INPUT, OBB_OUTPUT,
#                                           # OBB_STOCK=0 / OBB_AP=0 skip a side); MODELS_PRESSURE="glm45_air:12" adds
#                                           # a KV-pressure burst per model, PagedWeight alone, server logs kept
#   bash benchmark/gpu_session.sh e2e       # issues #18 / #19 end to end: per model (E2E_MODELS="qwen15moe mixtral:16 qwen3moe",
#                                           # name[:layers], one or two per call: ~6 min a model) bench_one_batch --batch-size
#                                           # 1 4 16 64 --input-len 2048 --output-len 64, every size warmed up first, for stock
#                                           # bf16, stock --quantization fp8 (unit RMSNorm as PagedWeight sets them), PagedWeight
#                                           # 4-bit experts and 4-bit scope all (E2E_SYSTEMS), then benchmark/summarize_e2e.py
#                                           # into $OUT/e2e_decode.json (docs/results/e2e_decode.json's headline keys)
#   bash benchmark/gpu_session.sh e2e_profile # where an end-to-end prefill's time goes: per model (E2EP_MODELS="qwen3moe",
#                                           # name[:layers]) one bench_one_batch prefill (E2EP_BATCH, default 1, input 2048)
#                                           # under the torch profiler per system (E2EP_SYSTEMS="bf16 ap4", as e2e), then
#                                           # benchmark/trace_kernels.py: GPU kernel time by category and kernel, each
#                                           # system against the first, per layer ($OUT/e2e_profile_<model>.json)
#   bash benchmark/gpu_session.sh longbench # MoEfied SmolLM2 rebuilt from /tmp/sc (carried pieces), LongBench-format
#                                           # work at one budget: stock bf16 vs uniform AP vs PagedWeight
# Writes everything under $OUT (default out/gpu).
set -uo pipefail
stage="${1:-kernels}"
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-deps --no-index --no-build-isolation --target /tmp/site . >/tmp/pw_install.log 2>&1 \
  || { cat /tmp/pw_install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 

if [ "$stage" = tests ]; then
  # GPU correctness only: runtime (VMM arena, pager, copy stream), kernels, and two TP processes on one GPU.
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_tp_sync.py tests/test_runtime_*.py \
    tests/test_kernel_*.py tests/test_elastic_kv_streams.py tests/test_elastic_kv_mla_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi

if [ "$stage" = kernels ]; then
  # KERNEL_TESTS=0 skips the tests (when the dequant stage ran them on this commit); KB_MS sets the M values
  if [ "${KERNEL_TESTS:-1}" != 0 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_*.py tests/test_kernel_*.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  fi
  ms="${KB_MS:-1,4,16,64,256,2048}"
  timeout 200 python3 benchmark/sglang_moe_baseline.py --ms "$ms" --out "$OUT/baseline.json" >"$OUT/baseline.log" 2>&1
  tail -3 "$OUT/baseline.log"
  timeout "${KB_TIMEOUT:-330}" python3 benchmark/kernel_bench.py --baseline-json "$OUT/baseline.json" --ms "$ms" \
    --kinds "${KB_KINDS:-ubcq,bcq,kmeans}" --cases "${KB_CASES:-u3,u4,u6,u8,mix4}" --out "$OUT/kernel.json" \
    --time-budget-s "${KB_BUDGET:-270}" 2>&1 | tail -40 \
    | tee "$OUT/kernel_bench.txt"
fi

if [ "$stage" = decode ]; then
  # ANCHORS (default .carry/bench/sglang_moe_anchors.py: cp ../shared/bench/*.py .carry/bench/ and carry .carry)
  timeout "${FOLD_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_fold.py 2>&1 | tail -15 \
    | tee "$OUT/gpu_tests_fold.txt"
  timeout 330 python3 "${ANCHORS:-.carry/bench/sglang_moe_anchors.py}" --out "$OUT/anchors.json" --ms "${KB_MS:-1,4,16,64}" \
    --reps 40 2>&1 | tail -100
  timeout 420 python3 benchmark/decode_bench.py --anchors-json "$OUT/anchors.json" --out "$OUT/decode.json" \
    --ms "${KB_MS:-1,4,16,64}" --reps 30 --time-budget-s 360 2>&1 | tail -120
fi

if [ "$stage" = fold ]; then
  # the test file in four processes at once (NVRTC compiles dominate; the GPU work is small), then the sweep alone
  if [ "${FOLD_TESTS:-1}" != 0 ]; then
    i=0
    for sel in "linear" "moe_matches" "graph_replay or skips or group_sizes" "not linear and not moe_matches and not graph_replay and not skips and not group_sizes"; do
      timeout "${FOLD_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_fold.py -k "$sel" \
        --durations=5 >"$OUT/gpu_tests_fold_$i.txt" 2>&1 &
      i=$((i + 1))
    done
    wait
    for f in "$OUT"/gpu_tests_fold_*.txt; do echo "== $f"; tail -12 "$f"; done
  fi
  timeout "${FOLD_SWEEP_TIMEOUT:-280}" python3 benchmark/fold_sweep.py --out "$OUT/fold_sweep.json" \
    --models "${FOLD_MODELS:-qwen15moe,qwen3moe,mixtral,mixtral_tp2,qwen3moe_tp2}" --ms "${KB_MS:-1,4,16,64}" \
    --case "${FOLD_CASE:-u4}" --reps 30 --no-profile \
    --candidates "${FOLD_CANDIDATES:-sa,nosa_wk2}" 2>&1 | grep -v "^W1" | tail -150
fi

if [ "$stage" = grouped ]; then
  parts=" ${GROUPED_PARTS:-tests anchors bench} "
  ms="${PB_MS:-256,512,2048,8192}"
  if [[ "$parts" == *" sweep "* ]]; then  # configs side by side, each output checked against dequantize-then-GEMM
    timeout "${SW_TIMEOUT:-240}" python3 benchmark/grouped_sweep.py --out "$OUT/grouped_sweep.json" \
      --models "${SW_MODELS:-qwen3moe,mixtral}" --ms "${SW_MS:-2048,512}" \
      --configs "${SW_CONFIGS:-2.4.r256.rv.ow.lag2.wg4.cs2,2.4.r256.rv.ow.lag2.wg4,2.4.r256.rv.ow.lag2,1.3,1.3.wg2,1.4.ow.lag2.wg2.cs2}" --reps 10 \
      --time-budget-s "${SW_BUDGET:-200}" 2>&1 | grep -v "^W1" | cut -c1-240
  fi
  if [[ "$parts" == *" diag "* ]]; then  # where the kernel's time goes: a stage left out per DIAG value
    timeout "${DIAG_TIMEOUT:-150}" python3 benchmark/grouped_diag.py --out "$OUT/grouped_diag.json" \
      --models "${DIAG_MODELS:-qwen3moe}" --m "${DIAG_M:-2048}" --config "${DIAG_CONFIG:-2.4.r256.rv.ow.lag2.wg4.cs2}" \
      --diags "${DIAGS:-0,1,2,3,8,4}" 2>&1 | grep "^{" | cut -c1-200
  fi
  if [[ "$parts" == *" ncu "* ]]; then  # ncu of w13 and w2 per sweep tag, with the warps' stall reasons
    for c in ${NCU_CONFIGS:-2.4.r256.rv.ow.lag2.wg4.cs2 2.4.r256.rv.ow.lag2}; do
      timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none --kernel-name ap_grouped_gemm --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmark/grouped_ncu.py --model "${NCU_MODEL:-qwen3moe}" --m "${NCU_M:-2048}" --config "$c" \
        >"$OUT/ncu_grouped_$c.txt" 2>&1
      grep -E "Duration|Compute \(SM\) Throughput|No Eligible|Warp Cycles Per Issued|stalled" "$OUT/ncu_grouped_$c.txt" \
        | awk '!/stalled/ || $NF + 0 >= 0.05' | head -40
    done
  fi
  if [[ "$parts" == *" tests "* ]]; then
    # GROUPED_TESTS_K: a pytest -k expression (the two files in full take over 260 s on an H100)
    timeout "${GROUPED_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_grouped.py \
      tests/test_kernel_moe.py ${GROUPED_TESTS_K:+-k "$GROUPED_TESTS_K"} 2>&1 | tail -15 | tee "$OUT/gpu_tests_grouped.txt"
  fi
  if [[ "$parts" == *" anchors "* ]]; then
    timeout 330 python3 "${ANCHORS:-.carry/bench/sglang_moe_anchors.py}" --out "$OUT/anchors_prefill.json" --ms "$ms" \
      --formats bf16,fp8_block128 --reps 20 2>&1 | tail -60
  fi
  if [[ "$parts" == *" bench "* ]]; then
    anchors=(); [ -f "$OUT/anchors_prefill.json" ] && anchors=(--anchors-json "$OUT/anchors_prefill.json")
    # SGLang bf16's own transient memory per call beside ours (needs the devicekit and .carry/bench)
    stock_dir=$(dirname "${ANCHORS:-.carry/bench/sglang_moe_anchors.py}")
    [ -f "$stock_dir/sglang_moe_baseline.py" ] && python3 -c "import sglang" 2>/dev/null \
      && anchors+=(--stock-memory-dir "$stock_dir")
    timeout "${PB_TIMEOUT:-420}" python3 benchmark/prefill_bench.py "${anchors[@]}" --out "$OUT/prefill.json" --ms "$ms" \
      --models "${PB_MODELS:-qwen15moe,mixtral,qwen3moe,qwen15moe_tp2,mixtral_tp2,qwen3moe_tp2}" \
      --cases "${PB_CASES:-u4,u8,mix4}" --compare "${PB_COMPARE:-tiles}" --time-budget-s "${PB_BUDGET:-360}" 2>&1 | tail -120
  fi
fi

if [ "$stage" = mma ]; then
  parts=" ${MMA_PARTS:-tests bench} "
  if [[ "$parts" == *" tests "* ]]; then
    timeout "${MMA_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -x tests/test_kernel_mma.py 2>&1 | tail -15 \
      | tee "$OUT/gpu_tests_mma.txt"
  fi
  if [[ "$parts" == *" sweep "* ]]; then
    timeout 200 python3 benchmark/mma_sweep.py --ms "${SWEEP_MS:-1,4,16,64}" --out "$OUT/mma_sweep.json" 2>&1 | tail -80
  fi
  if [[ "$parts" == *" bench "* ]]; then
    timeout "${KB_TIMEOUT:-330}" python3 benchmark/kernel_bench.py --ms "${KB_MS:-1,4,16,64,256,512}" \
      --cases "${KB_CASES:-u4,mix4}" --kinds ubcq --out "$OUT/kernel_mma.json" --time-budget-s "${KB_BUDGET:-270}" \
      2>&1 | tail -60 | tee "$OUT/kernel_mma.txt"
  fi
fi

if [ "$stage" = dequant ]; then
  # no devicekit needed: GPU correctness of the kernels (the CUDA prefill dequantization, the MoE and linear paths
  # that use it, the LUT kernel), then the dequantization alone (CUDA vs Triton) against the copy rate
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_dequant_cuda.py tests/test_kernel_moe.py \
    tests/test_kernel_linear.py tests/test_kernel_lut.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_dequant.txt"
  timeout 150 python3 benchmark/dequant_sweep.py --out "$OUT/dequant_sweep.json" --budget-s 90 2>&1 | tail -3
fi

if [ "$stage" = ubcq ]; then
  # UBCQ_PARTS="tests bench" (split over two calls when the 10-minute limit is near)
  parts=" ${UBCQ_PARTS:-tests bench} "
  [[ $parts == *" tests "* ]] && timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_dequant_cuda.py \
    tests/test_kernel_moe.py tests/test_kernel_linear.py tests/test_kernel_lut.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_ubcq.txt"
  [[ $parts == *" bench "* ]] || exit 0
  timeout 200 python3 benchmark/kernel_bench.py --ms "${KB_MS:-1,4,16,64,256,2048}" --cases u4 --kinds bcq,ubcq \
    --out "$OUT/kernel_ubcq.json" --time-budget-s "${KB_BUDGET:-150}" 2>&1 | tail -40 | tee "$OUT/kernel_ubcq.txt"
  timeout 100 python3 benchmark/dequant_sweep.py --kinds bcq,ubcq --out "$OUT/dequant_ubcq.json" --budget-s 40 2>&1 | tail -2
fi

if [ "$stage" = prefill ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
  timeout 150 python3 benchmark/sglang_moe_baseline.py --ms 256,512,2048 --out "$OUT/baseline_prefill.json" \
    >"$OUT/baseline_prefill.log" 2>&1; tail -3 "$OUT/baseline_prefill.log"
  timeout 200 python3 benchmark/kernel_bench.py --baseline-json "$OUT/baseline_prefill.json" --ms 256,512,2048 \
    --cases u4,mix4 --kinds bcq,kmeans --out "$OUT/kernel_prefill.json" --time-budget-s 150 2>&1 | tail -30 \
    | tee "$OUT/kernel_prefill.txt"
fi

if [ "$stage" = lut ]; then
  timeout 200 python3 benchmark/dequant_sweep.py --out "$OUT/dequant_sweep.json" --budget-s 150 2>&1 | tail -2
fi

if [ "$stage" = lutk ]; then
  # the CUDA LUT kernel (no devicekit needed): GPU correctness of it and of the Triton kernels it sits beside,
  # then dense GEMVs (LUT vs tiles vs cuBLAS bf16) and the MoE at decode sizes (default dispatch vs the other kernel)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_lut.py tests/test_kernel_moe.py \
    tests/test_kernel_linear.py 2>&1 | tail -12 | tee "$OUT/gpu_tests_lut.txt"
  timeout 150 python3 benchmark/linear_bench.py --ms 1,4,8,16 --out "$OUT/linear_bench_lut.json" 2>&1 | tail -40
  timeout 200 python3 benchmark/kernel_bench.py --ms 1,4,16,64 --cases u4,mix4 --kinds bcq --check-m 4 \
    --out "$OUT/kernel_lut.json" --time-budget-s 150 2>&1 | tail -40
fi

if [ "$stage" = linear ]; then
  # dense AP linears (--paged-weight-scope all): GPU correctness, then tile vs dequantize+GEMM vs cuBLAS bf16
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_linear.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_linear.txt"
  timeout 240 python3 benchmark/linear_bench.py --out "$OUT/linear_bench.json" 2>&1 | tail -40
fi

if [ "$stage" = serve ]; then
  # SERVE_SYSTEMS picks the parts (split them over calls when the 10-minute limit is near).
  systems=" ${SERVE_SYSTEMS:-smoke bf16 ap4 ap4_all} "
  model=/tmp/qwen15moe-dummy
  python3 benchmark/dummy_model.py --model qwen15moe --out $model >/dev/null
  common=(--model-path $model --load-format dummy --attention-backend triton --sampling-backend pytorch)
  if [[ $systems == *" smoke "* ]]; then
    # 1. The server command with --enable-paged-weight answers a request.
    python3 -m sglang.launch_server "${common[@]}" --enable-paged-weight --paged-weight-bits 4 --port 30000 \
      --mem-fraction-static 0.5 --cuda-graph-max-bs 8 >"$OUT/server.log" 2>&1 &
    for i in $(seq 1 150); do curl -sf localhost:30000/health_generate >/dev/null && break; sleep 2; done
    curl -s -H 'Content-Type: application/json' localhost:30000/generate \
      -d '{"text":"hello world","sampling_params":{"max_new_tokens":16,"temperature":0}}' | tee "$OUT/generate.json"; echo
    grep "PagedWeight:" "$OUT/server.log" | tail -1
    pkill -f "sglang[.]launch_server"; sleep 5
  fi
  # 2. bench_one_batch side by side on the same dummy model: stock bf16; AP 4-bit experts; AP 4-bit experts and
  #    dense linears (--paged-weight-scope all: attention projections and the shared expert).
  bench=(--batch-size 1 4 16 64 --input-len 2048 --output-len 64 --cuda-graph-max-bs 64 --mem-fraction-static 0.8)
  if [[ $systems == *" bf16 "* ]]; then
    timeout 200 python3 -m sglang.bench_one_batch "${common[@]}" "${bench[@]}" --result-filename "$OUT/obb_bf16.jsonl" \
      >"$OUT/obb_bf16.log" 2>&1; tail -4 "$OUT/obb_bf16.log"
  fi
  if [[ $systems == *" ap4 "* ]]; then
    timeout 240 python3 benchmark/bench_one_batch.py "${common[@]}" "${bench[@]}" --enable-paged-weight \
      --paged-weight-bits 4 --result-filename "$OUT/obb_ap4.jsonl" >"$OUT/obb_ap4.log" 2>&1; tail -4 "$OUT/obb_ap4.log"
  fi
  if [[ $systems == *" ap4_all "* ]]; then
    timeout 240 python3 benchmark/bench_one_batch.py "${common[@]}" "${bench[@]}" --enable-paged-weight \
      --paged-weight-bits 4 --paged-weight-scope all --result-filename "$OUT/obb_ap4_all.jsonl" >"$OUT/obb_ap4_all.log" 2>&1
    grep "PagedWeight:" "$OUT/obb_ap4_all.log" | tail -2; tail -4 "$OUT/obb_ap4_all.log"
  fi
  if [[ $systems == *" scope_check "* ]]; then
    # --paged-weight-scope all on the GPU against the dequantized-model oracle (tests/test_e2e_scope_all.py)
    PW_PROBE_DEVICE=cuda timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_e2e_scope_all.py \
      -k dequantized 2>&1 | grep -v "^\[20" | tail -6 | tee "$OUT/scope_check.txt"
  fi
fi
if [ "$stage" = models ]; then
  for spec in ${MODELS_RUN:-deepseek_v2_lite:27 glm45_air:12}; do
    name=${spec%%:*}; layers=${spec##*:}; model=/tmp/$name-dummy
    python3 benchmark/dummy_model.py --model "$name" --num-layers "$layers" --out $model >/dev/null
    common=(--model-path $model --load-format dummy --attention-backend triton --sampling-backend pytorch)
    read -r -a batches <<<"${OBB_BATCHES:-1 16}"
    bench=(--batch-size "${batches[@]}" --input-len "${OBB_INPUT:-1024}" --output-len "${OBB_OUTPUT:-32}"
           --cuda-graph-max-bs 64 --mem-fraction-static 0.85)
    # stock SGLang with the RMSNorm weights at 1, as PagedWeight sets them on a dummy model: the same routing spread
    if [ "${OBB_STOCK:-1}" != 0 ]; then
      timeout "${OBB_TIMEOUT:-170}" python3 benchmark/bench_one_batch.py --dummy-unit-norms "${common[@]}" "${bench[@]}" \
        --result-filename "$OUT/obb_${name}_bf16.jsonl" >"$OUT/obb_${name}_bf16.log" 2>&1
      echo "== $name bf16 rc=$?"; grep -E "unit-norms|Decode\.|Prefill|Error|error" "$OUT/obb_${name}_bf16.log" | tail -6
    fi
    [ "${OBB_AP:-1}" != 0 ] || continue
    timeout "${OBB_TIMEOUT:-170}" python3 benchmark/bench_one_batch.py "${common[@]}" "${bench[@]}" --enable-paged-weight \
      --paged-weight-bits 4 --result-filename "$OUT/obb_${name}_ap4.jsonl" >"$OUT/obb_${name}_ap4.log" 2>&1
    echo "== $name ap4 rc=$?"; grep -E "PagedWeight:|Decode|Prefill|Error|error" "$OUT/obb_${name}_ap4.log" | tail -8
  done
  # MODELS_PRESSURE="glm45_air:12": a KV-pressure burst per model, PagedWeight alone (pressure_bench.py), server logs
  # kept (a crash names its kernel there)
  for spec in ${MODELS_PRESSURE:-}; do
    name=${spec%%:*}; layers=${spec##*:}; model=/tmp/$name-dummy
    python3 benchmark/dummy_model.py --model "$name" --num-layers "$layers" --out $model >/dev/null
    timeout "${MODELS_PRESSURE_TIMEOUT:-300}" python3 benchmark/pressure_bench.py --model-path $model --load-format dummy \
      --mem-fraction-static "${PRESSURE_MEM_FRACTION:-0.25}" --input-len "${PRESSURE_INPUT_LEN:-1024}" \
      --output-len "${PRESSURE_OUTPUT_LEN:-256}" --paged-weight-min-bits 3 --systems pagedweight --start-timeout-s 200 \
      --extra-server-args "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 128" \
      --out "$OUT/pressure_$name.json" >"$OUT/pressure_$name.log" 2>&1
    echo "== $name pressure rc=$?"; grep -v "^\[20" "$OUT/pressure_$name.log" | tail -12
    pkill -f "sglang[.]launch_server"; sleep 3
    grep -h -B2 -A12 -E "Traceback|CUDA error|illegal" "$OUT"/logs/*.log 2>/dev/null | tail -60
    tar czf "$OUT/pressure_${name}_logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  done
fi
# e2e systems: bench_one_batch's flags for one of them, in the array `extra`
system_flags() {
  case $1 in
    bf16) extra=(--dummy-unit-norms) ;;
    fp8) extra=(--dummy-unit-norms --quantization fp8) ;;
    ap4) extra=(--enable-paged-weight --paged-weight-bits 4) ;;
    ap4_all) extra=(--enable-paged-weight --paged-weight-bits 4 --paged-weight-scope all) ;;
    *) echo "unknown E2E system $1 (bf16 fp8 ap4 ap4_all)"; exit 2 ;;
  esac
}

if [ "$stage" = e2e ]; then
  # results gather in E2E_DIR (kept on a warm machine across calls: one model per call, its four systems together)
  e2e_dir=${E2E_DIR:-/tmp/e2e}; mkdir -p "$e2e_dir"
  for spec in ${E2E_MODELS:-qwen15moe}; do
    name=${spec%%:*}; layers=${spec#*:}; [ "$layers" = "$spec" ] && layers=""
    tag=$name${layers:+_${layers}l}; model=/tmp/$tag-dummy
    python3 benchmark/dummy_model.py --model "$name" ${layers:+--num-layers "$layers"} --out $model >/dev/null
    common=(--model-path $model --load-format dummy --attention-backend triton --sampling-backend pytorch)
    read -r -a batches <<<"${E2E_BATCHES:-1 4 16 64}"
    # batch 64 prefills 131k tokens in one forward (its logits alone ~14 GiB): 0.8 of an 80 GB H100 left too little
    # for that in session 28 (Mixtral, 16 layers, every system), so cards under 100 GB keep more outside the pools
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    mem_default=0.8; [ "${gpu_mib:-0}" -lt 100000 ] && mem_default=0.65
    # ... except Qwen3-30B-A3B, whose 61 GB of bf16 weights need more than 0.73 of an 80 GB card (session 33): batch
    # 64 does not fit there beside them, so pass E2E_BATCHES="1 4 16" for it on an H100
    [ "$name" = qwen3moe ] && [ "${gpu_mib:-0}" -lt 100000 ] && mem_default=0.85
    bench=(--batch-size "${batches[@]}" --input-len 2048 --output-len 64 --cuda-graph-max-bs 64
           --mem-fraction-static "${E2E_MEM_FRACTION:-$mem_default}" --warmup-every-batch)
    for sys in ${E2E_SYSTEMS:-bf16 fp8 ap4 ap4_all}; do
      system_flags "$sys"
      timeout "${E2E_TIMEOUT:-240}" python3 benchmark/bench_one_batch.py "${common[@]}" "${bench[@]}" "${extra[@]}" \
        --result-filename "$e2e_dir/e2e_${tag}_${sys}.jsonl" >"$e2e_dir/e2e_${tag}_${sys}.log" 2>&1
      echo "== $tag $sys rc=$?"; grep -E "^Decode\.  median|^Prefill\. latency|Error" "$e2e_dir/e2e_${tag}_${sys}.log" | tail -8
    done
  done
  cp "$e2e_dir"/e2e_* "$OUT"/
  python3 benchmark/summarize_e2e.py --dir "$e2e_dir" --merge docs/results/e2e_decode.json --out "$OUT/e2e_decode.json" \
    --meta "{\"commit\": \"$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\", \"models\": \"${E2E_MODELS:-qwen15moe}\"}"
fi
if [ "$stage" = e2e_profile ]; then
  for spec in ${E2EP_MODELS:-qwen3moe}; do
    name=${spec%%:*}; layers=${spec#*:}; [ "$layers" = "$spec" ] && layers=""
    tag=$name${layers:+_${layers}l}; model=/tmp/$tag-dummy; prof=/tmp/e2e_profile/$tag; mkdir -p "$prof"
    python3 benchmark/dummy_model.py --model "$name" ${layers:+--num-layers "$layers"} --out $model >/dev/null
    nl=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); print(c.get('text_config', c)['num_hidden_layers'])" $model)
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    mem=0.8; [ "${gpu_mib:-0}" -lt 100000 ] && mem=0.85
    batch=${E2EP_BATCH:-1}; traces=()
    for sys in ${E2EP_SYSTEMS:-bf16 ap4}; do
      system_flags "$sys"
      SGLANG_TORCH_PROFILER_DIR=$prof timeout "${E2EP_TIMEOUT:-240}" python3 benchmark/bench_one_batch.py \
        --model-path $model --load-format dummy --attention-backend triton --sampling-backend pytorch \
        --batch-size "$batch" --input-len 2048 --output-len 4 --cuda-graph-max-bs 64 --mem-fraction-static "$mem" \
        --profile --profile-stage prefill --profile-prefix "$sys" "${extra[@]}" >"$prof/$sys.log" 2>&1
      echo "== $tag $sys rc=$?"; grep -E "^Prefill\. latency|Error" "$prof/$sys.log" | tail -4
      trace="$prof/${sys}_batch${batch}_input2048_output4_prefill.trace.json.gz"
      [ -f "$trace" ] && traces+=(--trace "$sys=$trace")
    done
    [ ${#traces[@]} -gt 0 ] && python3 benchmark/trace_kernels.py "${traces[@]}" --layers "$nl" \
      --out "$OUT/e2e_profile_${tag}_b${batch}.json" | head -60
  done
fi
if [ "$stage" = pressure ]; then
  model=/tmp/qwen15moe-dummy
  python3 benchmark/dummy_model.py --model qwen15moe --out $model >/dev/null
  # f = 0.33 leaves stock bf16 ~100k KV tokens on a 141 GB H200 (weights 28.6 GB); PagedWeight at 8 bits gets
  # ~50k more from the smaller experts and can reach ~40k beyond that by lowering bits to 3.
  # Long outputs (PRESSURE_INPUT_LEN=512 PRESSURE_OUTPUT_LEN=2048) make stock SGLang over-admit and retract:
  # it reserves 0.7 x max_new_tokens per request at admission.
  timeout "${PRESSURE_TIMEOUT:-480}" python3 benchmark/pressure_bench.py --model-path $model --load-format dummy \
    --mem-fraction-static "${PRESSURE_MEM_FRACTION:-0.33}" --input-len "${PRESSURE_INPUT_LEN:-2048}" \
    --output-len "${PRESSURE_OUTPUT_LEN:-384}" --paged-weight-min-bits "${PRESSURE_MIN_BITS:-3}" \
    --systems "${PRESSURE_SYSTEMS:-pagedweight_poison,static_bf16,pagedweight}" \
    ${PRESSURE_NUM_REQUESTS:+--num-requests $PRESSURE_NUM_REQUESTS} \
    --extra-server-args "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 128" \
    --out "$OUT/pressure.json" 2>&1 | tee "$OUT/pressure.log" | grep -v "^\[20" | tail -40
  pkill -f "sglang[.]launch_server"; sleep 3
  tar czf "$OUT/pressure_logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
if [ "$stage" = tp2 ]; then
  # NVLink multicast stays off (the device README): these are set on the machine; keep them for our servers too.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  model=/tmp/qwen15moe-dummy; work=/tmp/tp2; mkdir -p $work
  python3 benchmark/dummy_model.py --model qwen15moe --out $model >/dev/null
  timeout "${TP2_TIMEOUT:-560}" python3 benchmark/tp2_bench.py --model-path $model --load-format dummy --tp 2 \
    --mem-fraction-static "${TP2_MEM_FRACTION:-0.2}" --systems "${TP2_SYSTEMS:-stock,pagedweight,pagedweight_bits_map}" \
    --append --extra-server-args "--attention-backend triton --sampling-backend pytorch --cuda-graph-bs-decode 1 2 4 8 16 32 64 --disable-prefill-cuda-graph" \
    --out $work/tp2.json 2>&1 | tee -a "$work/tp2.log" | grep -v "^\[20" | tail -40
  pkill -f "sglang[.]launch_server"; sleep 3
  cp $work/tp2.json $work/tp2.md $work/tp2_held_plan.json "$OUT/" 2>/dev/null
  tar czf "$OUT/tp2_logs.tgz" -C $work logs tp2.log
fi
if [ "$stage" = tp_overhead ]; then
  # SGLang's launcher cannot start two TP ranks on one GPU; the harness spawns them itself (gloo, both on cuda:0).
  # qwen15moe writes tp_overhead.json (issue #20's headline), any other model tp_overhead_<model>.json; PW_COMMIT names
  # the commit in the results (the device copy of the work tree has no .git).
  for m in ${TPO_MODELS:-qwen15moe}; do
    f="$OUT/tp_overhead.json"; [ "$m" = qwen15moe ] || f="$OUT/tp_overhead_$m.json"
    timeout "${TPO_TIMEOUT:-420}" python3 benchmark/tp_overhead_bench.py --model "$m" --iters "${TPO_ITERS:-2000}" \
      --out "$f" 2>&1 | grep -v "^\[rank[01]\]:W" | tail -60
  done
fi
if [ "$stage" = longbench ]; then
  # The carried pieces were copied to /tmp/sc by each call (benchmark/device_build_smollm2_moe.py prepare).
  python3 benchmark/device_build_smollm2_moe.py build --carry /tmp/sc --out /tmp/smollm2 2>&1 | tee "$OUT/build.log" \
    | grep -v "block/s\|it/s" | tail -20
  ap=/tmp/smollm2/ap; moe=/tmp/smollm2/moe
  # The calibration computed on the build machine (its AP shard matched when the checks above say ok).
  cp /tmp/sc/calibration/*.json $ap/pagedweight/calibration.json && echo "calibration installed"
  python3 -m pagedweight.longbench make-fixtures --out /tmp/lb --samples "${LB_SAMPLES:-16}" --paragraphs 60 \
    --passkey-filler 300 >/dev/null && rm -f /tmp/lb/passage_retrieval_en_e.jsonl
  timeout "${LB_TIMEOUT:-420}" python3 benchmark/longbench_pressure.py --ap-model $ap --bf16-model $moe \
    --data-dir /tmp/lb --bf16-kv-tokens "${LB_KV_TOKENS:-12000}" --uniform-bits 3 --pw-bits 8 --pw-min-bits 3 \
    --systems "${LB_SYSTEMS:-pagedweight,static_bf16,uniform_ap}" \
    --concurrency 16 --max-prompt-tokens 7500 \
    --extra-server-args "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 32" \
    --out "$OUT/longbench.json" 2>&1 | tee "$OUT/longbench.log" | grep -v "^\[20" | tail -30
  pkill -f "sglang[.]launch_server"; sleep 3
  tar czf "$OUT/longbench_logs.tgz" -C "$OUT" logs longbench_runs && rm -rf "$OUT/logs" "$OUT/longbench_runs"
fi
ls -la "$OUT"
