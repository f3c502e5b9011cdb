#!/usr/bin/env bash
# Everything that needs a CUDA GPU, one subcommand per job; run from the repository root on the device
# machine. Logs and result files go to $OUT (default /tmp/out); every subcommand first writes the GPU,
# driver and versions to $OUT/gpu.txt. Each step runs under `timeout $TIMEOUT` (seconds) when TIMEOUT is
# set; otherwise under the subcommand's default, given below.
#
#   bash scripts/device.sh tests [PYTEST ARGS]   GPU tests, two pytest processes side by side (420 s):
#                                                 tests/gpu/test_triton.py -> triton.log, and the ops / torch.compile /
#                                                 CUDA graphs / chunking files of tests/gpu/ -> ops.log; then the
#                                                 host-time breakdown of a small backward. PYTEST ARGS go to both
#                                                 (e.g. -k 256). WARM_FLEX=1: also fill FlexAttention's compile caches
#                                                 for a grid run in the next call (two bench_bwd.py --warm-only shards).
#   bash scripts/device.sh gpu-tests             every test of tests/gpu/ (each needs a CUDA GPU; the tests of other
#                                                 folders run the same on any host and stay on the CPU machine: those
#                                                 that compile for sm_90a run under each Triton through
#                                                 scripts/triton_matrix.sh), riskiest (host path, SDPA, ops, graphs,
#                                                 compile) first, 14 workers, spread over calls: the node ids listed in
#                                                 .devrun/gpu-passed-tritonVERSION.txt are left out (540 s) ->
#                                                 gpu-tests.log, gpu-passed-tritonVERSION.txt (those ids plus this
#                                                 call's passes; to resume on a fresh machine, copy it into .devrun/
#                                                 here and carry .devrun; a warm machine also keeps it in /root). With a
#                                                 carried pytest-timeout (the image's, or a carried wheel: pip download
#                                                 --no-deps pytest-timeout -d .devrun/wheels) a test hung past 300 s
#                                                 fails alone (its worker is replaced) instead of holding the call to
#                                                 its limit
#   bash scripts/device.sh sanitize [ws|ws-named]
#                                                 compute-sanitizer memcheck and racecheck on scripts/sanitize_case.py
#                                                 (ws: the warp-specialised kernels' case, synccheck too, and
#                                                 racecheck on the `handoff` baseline it is read against; ws-named:
#                                                 the backward's with config.WsTile.named_barriers, synccheck too)
#                                                 (the tools side by side, 240 s each) -> sanitizer[-ws]-<tool>.log
#   bash scripts/device.sh memory                the workspace cap measured (scripts/memory_cap.py, 100 s each):
#                                                 triton s16384, reference s4096 causal -> memory-*.json
#   bash scripts/device.sh bench [ARGS]          scripts/bench_bwd.py --out $OUT ARGS (no default limit), e.g.
#                                                 --dims 64,128 --tag=-grid-a; --merge A.json,B.json --tag=-grid-final.
#                                                 WARM=N: first N `--warm-only --shard i/N` processes side by side (each
#                                                 under WARM_S seconds, default 200; SDPA peers left out: nothing of
#                                                 theirs is cached on disk) fill the on-disk compile caches of Triton
#                                                 and FA4 (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1), so the timed run
#                                                 compiles almost nothing -> warm*.log, bench.log. The feature rows
#                                                 and the head-dim grid in one call (not run yet; `bench_bwd.py ... --plan
#                                                 16` lists the rows and estimates the minutes; bench/nvidia-h200.md
#                                                 §How to reproduce):
#                                                 WARM=16 WARM_S=200 bash scripts/device.sh bench --rows features,grid \
#                                                   --quick --peers triton,fa4,sdpa_cudnn --budget-s 300 \
#                                                   --tag=-features-grid
#   bash scripts/device.sh kernels [SHAPES]      GPU time of each backward kernel, TMA tiles on and off
#                                                 (scripts/launch_overhead.py --kernels, 60 s each)
#   bash scripts/device.sh main [ARGS]           the main job, python3 -m flash_attn_ck ARGS (120 s) -> main-job.txt
#   bash scripts/device.sh profile [KERNEL [SHAPE]]
#                                                 Nsight Compute on the second launch of KERNEL (default
#                                                 attn_bwd_ws_kernel; attn_fwd_ws_kernel, attn_bwd_kernel, ...) in
#                                                 scripts/profile_case.py --shape SHAPE (default 128:16:16:8192:0):
#                                                 speed of light, tensor-pipe and shared-memory load, warp stalls
#                                                 (300 s) -> ncu-KERNEL.txt
#   bash scripts/device.sh candidates [EXPERIMENT ...]
#                                                 the experiments of scripts/lab/candidates.sh (fwd-split, fwd, bwd,
#                                                 bwd-named, bwd-det, fwd-dv, bwd-tail; all by default): tiles compiled but not yet run, checked
#                                                 and timed beside the defaults by scripts/lab/fwd_ws_check.py and
#                                                 bwd_ws_check.py -> candidates-EXPERIMENT.log
#   bash scripts/device.sh ab OLD_TREE SHAPES [ARGS]
#                                                 A/B timing of the Triton forward and backward of OLD_TREE (e.g.
#                                                 made by `git archive REV flash_attn_ck scripts | tar -x -C .ab-old`)
#                                                 and this tree: old, new, old, new, so each version is timed twice
#                                                 (the spread between a version's runs is the noise; AB_ROUNDS=1: once). SHAPES is
#                                                 d:h:h_k:s:causal,... or a row set of bench_bwd.py's --rows
#                                                 (features: the softcap, ALiBi, sink and dropout rows). AB_PEER: the
#                                                 bench_bwd.py peers to time, comma-separated (default triton; triton-ws:
#                                                 the warp-specialised kernels forced, bench_bwd.py's VARIANTS). ARGS go
#                                                 to both trees' bench_bwd.py (e.g. --features dropout: an old tree then
#                                                 needs this tree's scripts/ copied over its own)
set -u
cmd=${1:-}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}   # then a carried Triton or peer

limit() {  # default-seconds command...: run under TIMEOUT or the default (0: no limit)
  local secs=${TIMEOUT:-$1}; shift
  if [ "$secs" = 0 ]; then "$@"; else timeout "$secs" "$@"; fi
}

info() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
}

case $cmd in
  tests)
    info
    warm=()
    if [ "${WARM_FLEX:-0}" = 1 ]; then
      for i in 0 1; do
        python3 scripts/bench_bwd.py --warm-only --peers flex --shard "$i/2" > "$OUT/warm$i.log" 2>&1 &
        warm+=($!)
      done
    fi
    limit 420 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_triton.py "$@" > "$OUT/triton.log" 2>&1 &
    triton_pid=$!
    limit 420 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_ops_gpu.py tests/gpu/test_compile_gpu.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_chunking_gpu.py "$@" > "$OUT/ops.log" 2>&1
    echo "ops/compile/graphs/chunking rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/ops.log" | tail -6
    wait "$triton_pid"; echo "test_triton rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/triton.log" | tail -6
    for pid in "${warm[@]}"; do wait "$pid"; done
    [ ${#warm[@]} -gt 0 ] && echo "flex warm-up done: $(cat "$OUT"/warm*.log | grep -c .) log lines"
    python3 scripts/launch_overhead.py --breakdown --shapes 128:16:16:512:1,64:32:32:512:0 2>&1 | grep -v Warn
    ;;
  gpu-tests)
    info
    # the passed list of this machine's earlier calls too (/root survives while it stays warm; a carried .devrun
    # replaces the one there)
    # one passed list per Triton release (a carried newer Triton first on PYTHONPATH keeps its own)
    passed=gpu-passed-triton$(python3 -c "import triton; print(triton.__version__)").txt
    mkdir -p .devrun && touch ".devrun/$passed" "/root/$passed"
    sort -u -o ".devrun/$passed" ".devrun/$passed" "/root/$passed"
    # every test of tests/gpu/, the riskiest files (host path, SDPA, ops, graphs, compile) first
    python3 -m pytest --collect-only -q -p no:cacheprovider tests/gpu 2>/dev/null | grep '::' > .devrun/gpu-collected.txt
    for file in host_path_gpu sdpa_gpu ops_gpu cuda_graphs compile_gpu; do
      grep -F "tests/gpu/test_$file.py::" .devrun/gpu-collected.txt
    done > .devrun/gpu-all.txt
    grep -vxF -f .devrun/gpu-all.txt .devrun/gpu-collected.txt >> .devrun/gpu-all.txt
    # GPU_TESTS_FIRST=A|B|...: the ids A matches go first, then B's, ... (workers take the list in order)
    grep -vxF -f ".devrun/$passed" .devrun/gpu-all.txt > .devrun/gpu-todo.txt
    first=${GPU_TESTS_FIRST:-}
    if [ -n "$first" ]; then    # in the order of the alternatives: "a|b" puts a's ids before b's
      IFS='|' read -ra patterns <<< "$first"
      : > .devrun/gpu-todo.sorted
      for pattern in "${patterns[@]}"; do
        grep -E -- "$pattern" .devrun/gpu-todo.txt | grep -vxF -f .devrun/gpu-todo.sorted >> .devrun/gpu-todo.sorted
      done
      grep -vxF -f .devrun/gpu-todo.sorted .devrun/gpu-todo.txt >> .devrun/gpu-todo.sorted
      mv .devrun/gpu-todo.sorted .devrun/gpu-todo.txt
    fi
    cp .devrun/gpu-all.txt .devrun/gpu-todo.txt "$OUT/"
    echo "collected $(wc -l < .devrun/gpu-all.txt), passed earlier $(wc -l < ".devrun/$passed"), running $(wc -l < .devrun/gpu-todo.txt)"
    [ -s .devrun/gpu-todo.txt ] || { echo "nothing left to run"; exit 0; }
    per_test=()
    if ls .devrun/wheels/pytest_timeout-*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/test-wheels .devrun/wheels/pytest_timeout-*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/test-wheels
    fi
    python3 -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout 300 --timeout-method thread)
    mapfile -t todo < .devrun/gpu-todo.txt    # one node id a line, kept whole: some ids hold spaces
    # At the limit pytest gets SIGINT first, so it still prints the failures' tracebacks and summary (30 s grace).
    timeout -s INT -k 30 "${TIMEOUT:-540}" python3 -m pytest -v -n 14 -p no:cacheprovider -rf "${per_test[@]}" \
      "${todo[@]}" > "$OUT/gpu-tests.log" 2>&1
    echo "pytest rc=$?"
    # whole node ids: some hold spaces ("[...-q not a tensor]"), so cut the status prefix and the trailing blank only
    sed -nE 's/^.*PASSED (tests\/.*[^ ]) *$/\1/p' "$OUT/gpu-tests.log" | sort -u >> ".devrun/$passed"
    grep -E "^FAILED|^ERROR| passed| failed" "$OUT/gpu-tests.log" | tail -12
    sort -u -o ".devrun/$passed" ".devrun/$passed"
    cp ".devrun/$passed" "$OUT/" && cp ".devrun/$passed" /root/
    echo "passed so far $(wc -l < ".devrun/$passed") of $(wc -l < .devrun/gpu-all.txt)"
    ;;
  sanitize)
    info
    # `sanitize ws`: the warp-specialised kernel's case, also under synccheck (its named barriers)
    # The tools run side by side (one process each; most of a run is compiling and instrumenting on the host).
    case=${1:-}; tools="memcheck racecheck"; [[ "$case" == ws* ]] && tools="memcheck racecheck synccheck"
    pids=()
    for tool in $tools; do
      limit 240 compute-sanitizer --tool "$tool" --target-processes all python3 scripts/sanitize_case.py $case \
        > "$OUT/sanitizer${case:+-$case}-$tool.log" 2>&1 &
      pids+=($!)
    done
    if [ "$case" = ws ]; then
      limit 240 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py handoff \
        > "$OUT/sanitizer-handoff-racecheck.log" 2>&1
      echo "racecheck (handoff baseline) rc=$?"
      grep -E "RACECHECK SUMMARY|case done" "$OUT/sanitizer-handoff-racecheck.log" | tail -2
    fi
    for tool in $tools; do
      wait "${pids[0]}"; echo "$tool rc=$?"; pids=("${pids[@]:1}")
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Device not supported|case done" "$OUT/sanitizer${case:+-$case}-$tool.log" \
        | tail -4
    done
    ;;
  memory)
    info
    limit 100 python3 scripts/memory_cap.py --seqlen 16384 --backends triton --json "$OUT/memory-triton.json" 2>&1 \
      | tail -6
    limit 100 python3 scripts/memory_cap.py --seqlen 4096 --causal --backends reference \
      --json "$OUT/memory-reference.json" 2>&1 | tail -6
    ;;
  bench)
    info
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1   # FA4 keeps what it compiles on disk, as Triton does
    warm=()
    for ((i = 0; i < ${WARM:-0}; i++)); do
      limit "${WARM_S:-200}" python3 scripts/bench_bwd.py "$@" --warm-only --shard "$i/$WARM" \
        > "$OUT/warm$i.log" 2>&1 &
      warm+=($!)
    done
    for pid in "${warm[@]}"; do wait "$pid"; done
    [ ${#warm[@]} -gt 0 ] && echo "warm-up: ${#warm[@]} processes done after $SECONDS s"
    limit 0 python3 scripts/bench_bwd.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" \
      | grep -E "bwd TF/s|not importable|Error|not reached"
    echo "bench done after $SECONDS s"
    ;;
  kernels)
    info
    shapes=${1:-128:16:16:512:1,128:16:16:1024:1}
    for tma in on off; do
      limit 60 python3 scripts/launch_overhead.py --kernels --dq-mode pass --tma "$tma" --shapes "$shapes" 2>&1 \
        | grep -E "^d|all kernels" | sed "s/^/tma=$tma /"
    done
    ;;
  main)
    info
    limit 120 python3 -m flash_attn_ck "$@" 2>&1 | tee "$OUT/main-job.txt"
    ;;
  profile)
    info
    kernel=${1:-attn_bwd_ws_kernel} shape=${2:-128:16:16:8192:0}
    limit 300 ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy -k "regex:$kernel" --launch-skip 1 \
      --launch-count 1 python3 scripts/profile_case.py --shape "$shape" > "$OUT/ncu-$kernel.txt" 2>&1
    echo "ncu rc=$?"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Shared|Tensor|Stall|Issue Slot|ERR" \
      "$OUT/ncu-$kernel.txt" | head -40
    ;;
  candidates)
    info
    export OUT TIMEOUT
    export -f limit
    bash scripts/lab/candidates.sh "$@"
    ;;
  ab)
    [ $# -ge 2 ] || { echo "usage: bash scripts/device.sh ab OLD_TREE SHAPES [BENCH_BWD ARGS]" >&2; exit 2; }
    info
    old=$1 shapes=$2; shift 2
    rows=(--shapes "$shapes"); [[ "$shapes" == *:* ]] || rows=(--rows "$shapes")
    peer=${AB_PEER:-triton}
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for tree in "$old" .; do
        name=$([ "$tree" = . ] && echo new || echo old)
        limit 0 python3 "$tree/scripts/bench_bwd.py" --peers "$peer" "${rows[@]}" "$@" --out "$OUT/ab-$name-$round" 2>&1 \
          | grep -E "Error" | sed "s|^|$name#$round |"
        # each row's forward and backward TF/s per peer, from the run's json
        python3 - "$OUT/ab-$name-$round" "$name#$round" "$peer" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for row in json.loads(path.read_text())["results"]:
        for peer in sys.argv[3].split(","):
            ours = row["peers"].get(peer, {})
            print(sys.argv[2], peer, row["d"], row["h"], row["h_k"], row["s"], "causal" if row["causal"] else "-",
                  row["feature"], "fwd", round(ours.get("fwd_tflops", 0)), "bwd", round(ours.get("bwd_tflops", 0)))
PY
      done
    done
    ;;
  *)
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    [ -z "$cmd" ] || [ "$cmd" = help ] || { echo "unknown subcommand: $cmd" >&2; exit 2; }
    ;;
esac
