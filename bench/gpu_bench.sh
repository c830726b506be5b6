#!/usr/bin/env bash
# The GPU benchmarks (docs/BENCHMARKS.md, "GPU") on a CUDA machine that has torch but no package registry.
#
# Here: `make gpu-kit` puts the pinned pure-Python and abi3 wheels, and the default model's tokenizer, in
# .gpu-kit/ (about 25 MB). There, from a copy of this repository with .gpu-kit beside it:
#
#   bash bench/gpu_bench.sh PART [OUT]
#
#   bash bench/gpu_bench.sh run OUT NAME BENCH-ARGS...   (one run of `python -m bench`, kept as NAME)
#
# PART: defaults | baseline | attention | profile | first | trace | check | steps | sampler | overlap | mixed | memory | w256 |
#       nano | budget | backend | host | all
# Each part fits a 10-minute call; logs and JSON go to OUT (default: gpu-results). Every run of a part is
# made even when an earlier one fails; the script then exits 1 and names the failed runs (failed.txt).
# RUN_TIMEOUT=S stops any one run after S seconds (recorded as failed), so a short lease still gets the
# runs after a hung one.
set -uo pipefail
part=${1:-check}
out=${2:-${OUT:-gpu-results}}
kit=${GPU_KIT:-.gpu-kit}
site=${GPU_KIT_SITE:-/tmp/gpu-kit-site}
py=${PYTHON:-python3}
mkdir -p "$out"
failed=()

# The unpacked kit is kept between calls on a warm machine, and unpacked afresh when the kit's wheels change.
wheels=$(cd "$kit/wheels" && ls *.whl)
if [ "$(cat "$site/.installed" 2>/dev/null)" != "$wheels" ]; then
    rm -rf "$site"
    # A wheel is a zip of what goes on the path: unpacking it needs no pip.
    for wheel in "$kit"/wheels/*.whl; do
        "$py" -m zipfile -e "$wheel" "$site" || { echo "cannot unpack $wheel" >&2; exit 1; }
    done
    echo "$wheels" > "$site/.installed"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'EOF' | tee "$out/versions.txt" || exit 1
import platform, torch, transformers, tokenizers
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "none"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "triton", triton_version)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

bench() {   # bench NAME ARGS...: one run, its log and JSON kept; a crash is recorded, not hidden by the pipe
    local name=$1; shift
    echo "== $name: python -m bench $*" | tee -a "$out/commands.txt"
    if ! timeout "${RUN_TIMEOUT:-0}" "$py" -m bench --model "$kit/model" "$@" --json "$out/$name.json" 2>&1 \
            | { grep -v 'req/s\]' || true; } | tee "$out/$name.log"; then
        echo "!! $name failed" | tee -a "$out/failed.txt"
        failed+=("$name")
    fi
}

case $part in
run)            # one run: NAME and its arguments follow OUT
    [ $# -ge 3 ] || { echo "usage: bash bench/gpu_bench.sh run OUT NAME ARGS..." >&2; exit 2; }
    name=$3; shift 3
    bench "$name" "$@" ;;
esac
case $part in
attention|all)  # decode attention alone: the installed torch's flex decoding lines, then Triton (splits, key tiles,
                # block sizes 16 and 64) against FlexAttention at 16, 64 and 256 rows, in us and GB/s
    echo "== attention: python -m bench.decode_attention" | tee -a "$out/commands.txt"
    if ! timeout "${RUN_TIMEOUT:-0}" "$py" -m bench.decode_attention --json "$out/attention.json" \
            ${ATTENTION_ARGS:-} > "$out/attention.log" 2>&1; then
        echo "!! attention failed" | tee -a "$out/failed.txt"
        failed+=("attention")
    fi
    grep -A12 "^best per" "$out/attention.log" || tail -20 "$out/attention.log" ;;
esac
case $part in
defaults|all)   # greedy equality in float32 through the compiled Triton decode graphs, then nano's shape with the
                # defaults (Triton attention, compiled decode layers)
    bench check-default --random-weights smollm2-135m --dtype float32 --limit "${CHECK_LIMIT:-16}" \
        --skip static,transformers_cb,engine_best
    bench nano-default --workload nano --random-weights qwen3-0.6b --slots 256 \
        --skip static,reference,transformers_cb,engine_best ;;
esac
case $part in
baseline|all)   # nano's shape with the previous defaults (FlexAttention, uncompiled), the ratio's baseline
    ATTENTION_BACKEND=flex bench nano-flex --workload nano --random-weights qwen3-0.6b --slots 256 --decode flex \
        --compile off --skip static,reference,transformers_cb,engine_best ;;
esac
case $part in
profile|all)    # where a decode step's time goes with the defaults (kernels a layer, gaps, wall over kernel time),
                # overlapped steps re-measured, and workload-256 against transformers CB with CUDA graphs
    bench steps-default --workload nano --random-weights qwen3-0.6b --step-profile 16,64,256
    bench nano-overlap --workload nano --random-weights qwen3-0.6b --slots 256 --overlap on \
        --skip static,reference,transformers_cb,engine_best
    bench w256-default --workload workload-256 --random-weights smollm2-135m --slots 64 --skip reference,static ;;
esac
case $part in
first)       # a first look that fits one short lease (about 7 minutes on an H200), most telling first: greedy
             # equivalence through the graphs, nano's shape (engine alone, as by default), where a decode step's
             # time goes, the engine with overlapped steps, and workload-256 against transformers CB
    bench check-flex --random-weights smollm2-135m --dtype float32 --limit 16 --decode flex \
        --skip static,transformers_cb,engine_best
    bench nano-engine --workload nano --random-weights qwen3-0.6b --slots 256 \
        --skip static,reference,transformers_cb,engine_best
    bench steps-flex --workload nano --random-weights qwen3-0.6b --step-profile 16,64,256 --decode flex
    bench nano-engine-overlap --workload nano --random-weights qwen3-0.6b --slots 256 --overlap on \
        --skip static,reference,transformers_cb,engine_best
    bench w256 --workload workload-256 --random-weights smollm2-135m --slots 64 --skip reference,static ;;
esac
case $part in
trace|all)   # every step of nano's shape timed by kind (decode-only or mixed), with the first mixed steps profiled
             # (host and device time by operator), for each attention backend of eager steps
    for b in flex gather; do
        name="trace-$b"
        echo "== $name: ATTENTION_BACKEND=$b python -m bench.step_trace" | tee -a "$out/commands.txt"
        if ! ATTENTION_BACKEND=$b timeout "${RUN_TIMEOUT:-0}" "$py" -m bench.step_trace --model "$kit/model" \
                --random-weights qwen3-0.6b --max-seconds 90 --json "$out/$name.json" > "$out/$name.log" 2>&1; then
            echo "!! $name failed" | tee -a "$out/failed.txt"
            failed+=("$name")
        fi
        grep -A5 "^kind" "$out/$name.log"
    done ;;
esac
case $part in
check|all)   # greedy equivalence in float32 through the captured graphs, both decode attentions, steps not
             # overlapped (the default) and overlapped; eager steps read the pool in place (flex, CUDA's default)
    for d in flex gather; do
        bench "check-$d" --random-weights smollm2-135m --dtype float32 --limit 16 --decode "$d" \
            --skip static,transformers_cb,engine_best
    done
    bench check-overlap --random-weights smollm2-135m --dtype float32 --limit 16 --decode flex --overlap on \
        --skip static,transformers_cb,engine_best ;;
esac
case $part in
steps|all)   # decode steps at 16 / 64 / 256 of 256 slots: wall against GPU kernel time per step, the bucket and
             # the compiled decode row count each runs, table ids written per step, host-to-device copies by
             # source (pinned or pageable) and the top kernels
    for d in flex gather eager; do
        bench "steps-$d" --workload nano --random-weights qwen3-0.6b --step-profile 16,64,256 --decode "$d"
    done ;;
esac
case $part in
sampler|all) # greedy, every knob sampled and the chat's sampling (top-p without top-k, DRY): the device path (a
             # full sort for top-p without top-k) against a search among the 256 best first, which reads a count on
             # the host mid-step; random weights' flat logits send every top-p row past the 256, its worst case
    for n in 0 256; do
        bench "sampler-$n" --workload nano --random-weights qwen3-0.6b --step-profile 16,64,256 --sampler-candidates "$n"
    done
    # the sampler alone over a model's kind of logits (a nucleus of 7-10 tokens): search against device path
    for vocab in 151936 49152; do
        echo "== sampler-alone-$vocab: python -m bench.sampler --logits peaked --vocab $vocab" \
            | tee -a "$out/commands.txt"
        if ! timeout "${RUN_TIMEOUT:-0}" "$py" -m bench.sampler --model "$kit/model" --logits peaked --vocab "$vocab" \
                --rows 16,64,256 --engine-slots 0 --rebuild-rows 0 --device cuda \
                --json "$out/sampler-alone-$vocab.json" > "$out/sampler-alone-$vocab.log" 2>&1; then
            echo "!! sampler-alone-$vocab failed" | tee -a "$out/failed.txt"
            failed+=("sampler-alone-$vocab")
        fi
        tail -20 "$out/sampler-alone-$vocab.log"
    done ;;
esac
case $part in
overlap|all) # each step's tokens read back while the next step runs, against at once (the default)
    for o in off on; do
        bench "overlap-$o" --workload nano --random-weights qwen3-0.6b --slots 256 --overlap "$o" \
            --skip static,reference,transformers_cb,engine_best
    done
    for o in off on; do
        bench "overlap-steps-$o" --workload nano --random-weights qwen3-0.6b --step-profile 64,256 --overlap "$o"
    done ;;
esac
case $part in
mixed|all)   # a 20,000-token prompt prefilled beside 256 decodes: step wall, kernel time and peak memory, with
             # the gather backend (cached context read in place) and flex
    for b in gather flex; do
        ATTENTION_BACKEND=$b bench "mixed-$b" --workload nano --random-weights qwen3-0.6b --slots 256 \
            --mixed-profile 20000
    done ;;
esac
case $part in
memory|all)  # the KV pool sized as the worker sizes it (0.9 of the GPU less the reserve for a step), then full
             # batches of greedy and top-k/top-p steps (the sampler's full sort) and the nano run: no OOM
    bench memory-steps --workload nano --random-weights qwen3-0.6b --step-profile 256 --pool auto
    bench memory-nano --workload nano --random-weights qwen3-0.6b --slots 256 --pool auto \
        --skip static,reference,transformers_cb,engine_best ;;
esac
case $part in
w256|all)    # target: the engine >= 3x transformers CB (CUDA graphs) at 64 equal slots
    bench w256 --workload workload-256 --random-weights smollm2-135m --slots 64 --skip reference,static ;;
esac
case $part in
nano|all)    # target: >= 15,000 tok/s on nano-vllm's shape with Qwen3-0.6B
    bench nano --workload nano --random-weights qwen3-0.6b --slots 256 --skip static,reference ;;
esac
case $part in
budget|all)  # tokens per step on nano's shape (half of it): the CUDA default, 8192, against smaller steps
    for b in 512 2048 8192; do
        bench "budget-$b" --workload nano --requests 128 --random-weights qwen3-0.6b --slots 256 --budget "$b" \
            --skip static,reference,transformers_cb,engine_best
    done ;;
esac
case $part in
backend|all) # eager (prefill and mixed) steps: one FlexAttention call for every chunk, against SDPA per chunk
    for b in flex gather; do
        ATTENTION_BACKEND=$b bench "backend-$b" --workload workload-256 --random-weights smollm2-135m --slots 64 \
            --skip reference,static,transformers_cb
    done ;;
esac
case $part in
host|all)    # the host's share of a decode step by part (schedule, runner, draw, append) on a one-layer model, at 16,
             # 64 and 256 rows, greedy and the chat's sampling (top-p, DRY) with two stop strings like its lead's;
             # HOST_DEVICE=cpu runs it here, to check the part before a GPU is lent
    for rows in 16 64 256; do
        for kind in greedy chat; do
            name="host-$rows-$kind"
            args=(--rows "$rows")
            [ "$kind" = chat ] && args+=(--temperature 0.7 --top-p 0.9 --dry-multiplier 0.8 --stop '<tool' --stop ORDER-END)
            echo "== $name: python -m bench.host_time ${args[*]}" | tee -a "$out/commands.txt"
            if ! timeout "${RUN_TIMEOUT:-0}" "$py" -m bench.host_time --model "$kit/model" --device "${HOST_DEVICE:-cuda}" "${args[@]}" \
                    --json "$out/$name.json" > "$out/$name.log" 2>&1; then
                echo "!! $name failed" | tee -a "$out/failed.txt"
                failed+=("$name")
            fi
            tail -8 "$out/$name.log"
        done
    done ;;
esac
case $part in
run|attention|defaults|baseline|profile|first|trace|check|steps|sampler|overlap|mixed|memory|w256|nano|budget|backend|host|all) ;;
*) echo "unknown part '$part'" >&2; exit 2 ;;
esac

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
