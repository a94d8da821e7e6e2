#!/usr/bin/env bash
# The H200 measurement plan in parts that each fit one 10-minute device call; each layout runs in its
# own process (a process's device memory is not handed back to the next), results land in $OUT.
# Decode legs time 32-step decode calls (two after a warm-up call: 64 steps), as the baseline figures did:
# each call has a fixed host cost of a few ms at 52 layers, which 16-step calls spread over fewer steps.
#
#   bash benchmarks/h200.sh nvfp4     # NANO_NVFP4: gate, decode batches 1,32 (profiled), prefill 1x2048 and 8x512
#   bash benchmarks/h200.sh nvfp4-more  # NANO_NVFP4: gate, decode batches 8,64
#   bash benchmarks/h200.sh dense     # bf16: gate, decode batches 1,32, prefill of one 2,048-token prompt
#   bash benchmarks/h200.sh prefill-targets  # prefill of one 2,048-token prompt, NANO_NVFP4 then bf16, each gated
#                                     # in its own process (the prefill targets alone, in one call)
#   bash benchmarks/h200.sh fp8       # NANO_FP8 and MIXED: gate, decode batches 1,32
#   bash benchmarks/h200.sh routing [LAYOUT]  # batch-32 decode, ungated, greedy then sampled (temperature 1),
#                                     # each in its own process with the routed-experts count (default: dense)
#   bash benchmarks/h200.sh overhead  # NANO_NVFP4 batch 1: a decode call's fixed cost, CUDA graphs on and off
#   bash benchmarks/h200.sh kernels   # MoE experts op alone, 1 and 32 tokens, each format, tilings swept
#   bash benchmarks/h200.sh kernel-tests  # kernel tests of tests/test_kernels.py on the GPU (Mosaic, PTX decode,
#                                     # bf16 operands, several weight tiles a CTA, rows read without a padded copy,
#                                     # NVFP4 and FP8 through warp-level mma, lane-level lowering, partial sums of
#                                     # the real rows only, plain activation loads, relu^2 in the experts' kernel)
#   bash benchmarks/h200.sh xla-flags [FLAGS...]  # NANO_NVFP4 batch-1 decode, ungated, as it is and under each set of
#                                     # XLA flags (default: PDL, more fusion, the loop in the CUDA graph)
#   bash benchmarks/h200.sh compile [TILING]  # NANO_NVFP4: compile time of prefill and decode, batches 1 and 32, as
#                                     # it is and with XLA's autotuning off (every kernel under TILING if given)
#   bash benchmarks/h200.sh compile-compare  # compile times of an older tree extracted to _old (as for `compare`)
#                                     # and of this one, alternating: batch 1 twice, then batch 32
#   bash benchmarks/h200.sh load      # cold start of a Nano-size NVFP4 checkpoint (writes ~19 GB under /tmp)
#   bash benchmarks/h200.sh compare   # NANO_NVFP4 decode batches 1,32, ungated: an older tree extracted to _old
#                                     # (`git archive REV nemoh pallas_kernels benchmarks | tar -x -C _old`), then
#                                     # this tree
#   bash benchmarks/h200.sh compare-prefill  # the same for prefill 1x2048 and 8x512, profiled, ungated
#   bash benchmarks/h200.sh ssd       # the chunked SSD scan alone, 1x2048 and 8x512: this tree's and (when
#                                     # present) _old's in one process, each against the recurrence
#   bash benchmarks/h200.sh variants [TILINGS] [LAYOUT]  # decode batches 1,32 (default NANO_NVFP4): the
#                                     # default tiling against others (default: $CANDIDATE_TILINGS) in one
#                                     # process, calls interleaved, every variant gated (benchmarks/ab.py)
#   bash benchmarks/h200.sh prefill-variants [TILINGS] [LAYOUT]  # the same for prefill 1x2048 and 8x512
#                                     # (default: $CANDIDATE_PREFILL_TILINGS; NANO_NVFP4)
#   bash benchmarks/h200.sh xla-variants [SETS] [SAMPLING]  # NANO_NVFP4 decode batches 1,32: XLA options compiled
#                                     # into the decode program against the engine's own, in one process
#                                     # (default: $CANDIDATE_XLA, none now: name SETS); greedy,
#                                     # or drawn with SAMPLING ("temperature=0.8,top_p=0.9")
#   bash benchmarks/h200.sh prefill-xla-variants [SETS]  # the same for prefill 1x2048 and 8x512 (NANO_NVFP4;
#                                     # default: $CANDIDATE_PREFILL_XLA, none now: name SETS)
#   bash benchmarks/h200.sh sampler   # the sampler alone at vocab 131,072, batches 1, 8, 32: its cut checked against
#                                     # the float64 rule's, then sample() per setting and the cut against a sort (sampler.py)
#   bash benchmarks/h200.sh lever [TILING]  # a candidate in one call: the decode blocks' kernel tests (mma
#                                     # and its load options, real rows), then the GEMV fit of each
#                                     # quantised format under it, then `variants` with rounds 4 (default:
#                                     # $CANDIDATE_TILINGS)
#   bash benchmarks/h200.sh kernel-variants [TILINGS]  # the weight kernels under the default tiling and those
#                                     # (kernels.py)
#   bash benchmarks/h200.sh prefill-experts [TILINGS]  # bf16 MoE experts of a 2,048-token chunk alone, default
#                                     # tiling against TILINGS (default: $CANDIDATE_PREFILL_TILINGS)
#   bash benchmarks/h200.sh trace [TILING]  # NANO_NVFP4 at Nano widths, layers MEME: one decode step's launches in
#                                     # order, batches 1 and 32, op by op and as CUDA graphs (benchmarks/step_trace.py),
#                                     # and the GEMV's fixed cost
#   bash benchmarks/h200.sh prefill-trace [LAYOUT]  # one prefill call of a 2,048-token prompt at Nano widths, layers
#                                     # MEM*E, launch by launch with the idle gaps summed and the largest named, op by
#                                     # op and as CUDA graphs (benchmarks/step_trace.py --prefill; default: dense)
#   bash benchmarks/h200.sh tree-id   # the source digest every part prints first
#   bash benchmarks/h200.sh counters [CASES] [TILING]  # hardware counters (Nsight Compute) of the weight kernels
#                                     # (benchmarks/counters.py; default "gemv:nvfp4 moe1:nvfp4 moe32:nvfp4 moe32:fp8"):
#                                     # occupancy and its limit, DRAM throughput, stall reasons, one report a case
#   bash benchmarks/h200.sh idle      # thunk sequences (where the CUDA graphs split) and profile of a
#                                     # 13-layer batch-1 decode, this tree and one extracted to _old
#
# The token gate needs transformers and torch: NEMOH_ORACLE_PYTHON, .venv-oracle, or (the GPU image)
# the interpreter running the benchmark.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
# JAX's allocator stops at .75 of the card by default, preallocating or not: on an 80 GB card that left a
# bf16 Nano (63 GB) 0.5 GB for its requests (run 15)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.95}
OUT=${OUT:-.}
# The code a run measured: a digest of the sources (a copied checkout's .git can lag its files), printed
# first by every part; `bash benchmarks/h200.sh tree-id` prints it for the checkout at hand.
tree_id() { find nemoh pallas_kernels benchmarks -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12; }
[ "${1:-}" = tree-id ] && { tree_id; exit 0; }
echo "tree $(tree_id) ($(git rev-parse --short HEAD 2>/dev/null) $(git status --short 2>/dev/null | wc -l) changed)"
quiet() { grep -v -i "warning\|bfc_allocator\|fragmentation\|allocation summary\|\*\*\*\*"; }
# a leg's whole output goes to $OUT/legs.log as well (the tail printed here may cut a long table)
leg() { local limit=$1; shift; mkdir -p "$OUT"
        timeout "$limit" python3 "$@" --out "$OUT" 2>&1 | quiet | tee -a "$OUT/legs.log" | tail -60; }
# whether an older tree to compare against is extracted to _old (see the top of this file); says so if not
have_old() { [ -d _old/nemoh ] || { echo "== no baseline: _old/nemoh is missing (see the top of this file)"; return 1; }; }
# the kernel tests that a GPU runs differently from the interpreter (Mosaic, PTX, mma, TMA fills)
# (a second argument: another -k selection)
kernel_tests() { PALLAS_KERNELS_IMPL=pallas timeout "$1" python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
                   -k "${2:-tiny or test_linear or single_token or bf16_operands or several_weight_tiles or unpadded or mma or lane or store_real_rows or fused_relu2}" \
                   2>&1 \
                   | tail -3; }
# kernel variants not yet the default, each timed against it by `variants`, `prefill-variants`, `kernel-variants`
CANDIDATE_TILINGS=""  # none pending: name TILINGS. Measured and adopted: plain activation loads under mma
                      # (`stagger_x_loads=false`, decode x0.992 at batch 1, run 25). Measured and not adopted:
                      # the warpgroup-level lowering (`lane_lowering=false`: the GEMV's SASS loop is the same,
                      # decode x0.989 and x1.016 in two A/Bs, run 23); 4 or 16 decode CTAs an SM (the GEMV
                      # slower than at 8, run 22)
CANDIDATE_PREFILL_TILINGS="weight_tiles=2"  # two tiles a CTA: x0.977 and x0.968 of three on the H200 (run 24),
                      # three beat two on the H100 (run 12); 128-row expert blocks were x1.1 slower (run 24).
                      # Adopted: the experts' relu^2 in the up projection's kernel (x0.971, run 25)
# XLA options not the engine's, timed against its own by `xla-variants` (';' between sets). None is pending:
# XLA's Triton GEMMs off became the engine's in both programs (run 14); earlier candidates measured and not
# adopted are in docs/BENCHMARKS.md (the cond in the CUDA graph: runs 10 and 26)
CANDIDATE_XLA=""
# none pending: name SETS. Measured and not adopted: XLA's dot merger off (xla_gpu_dot_merger_threshold_mb=0,
# x0.987 at 1x2048 and x0.995 at 8x512 with rounds on both sides of 1, run 26)
CANDIDATE_PREFILL_XLA=""

case "${1:-}" in
  nvfp4) leg 560 benchmarks/decode.py --layouts NANO_NVFP4 --batches 1,32 --profile-batches 1,32 \
           --steps 32 --repeats 2 --prefill-shapes 1x2048,8x512 ;;
  prefill-targets) for layout in NANO_NVFP4 dense; do
                     leg 290 benchmarks/prefill.py --layouts $layout --shapes 1x2048
                   done ;;
  nvfp4-more) leg 560 benchmarks/decode.py --layouts NANO_NVFP4 --batches 8,64 --profile-batches "" --steps 32 --repeats 2 ;;
  dense) leg 560 benchmarks/decode.py --layouts dense --batches 1,32 --profile-batches "" --steps 32 --repeats 2 \
           --prefill-shapes 1x2048 ;;
  fp8) for layout in NANO_FP8 MIXED; do
         leg 280 benchmarks/decode.py --layouts "$layout" --batches 1,32 --profile-batches "" --steps 32 --repeats 2
       done ;;
  routing) # whether a batch's rows route alike (random weights) under greedy and under sampled tokens
    for sampling in "" temperature=1.0; do
      leg 280 benchmarks/decode.py --layouts "${2:-dense}" --batches 32 --profile-batches "" --steps 32 --repeats 2 \
        --no-gate ${sampling:+--sampling $sampling}
    done ;;
  overhead) # a decode call's fixed cost against its cost per step, with XLA's command buffers (CUDA graphs) and without
    for flags in "" "--xla_gpu_enable_command_buffer="; do
      echo "== XLA_FLAGS=$flags"
      (export XLA_FLAGS="$flags"; leg 280 benchmarks/decode.py --layouts NANO_NVFP4 --batches 1 --profile-batches "" \
         --steps 32 --repeats 2 --call-overhead)
    done ;;
  kernels) leg 560 benchmarks/kernels.py --sweep --only moe1,moe32 ;;
  kernel-tests) kernel_tests 300 ;;
  xla-flags) # batch-1 decode, ungated (layer check only), one process each: as it is, then under each set of XLA
             # flags given after the part's name (default: the sets below: programmatic dependent launch, fusion
             # passes that fuse more, the decode loop itself recorded into the CUDA graph). Four timed calls, each
             # printed: a loop recorded whole runs op by op on its first run after any program loads (XLA
             # re-records its graphs then), which a median of two would hide
    shift
    [ $# -gt 0 ] || set -- --xla_gpu_enable_pdl=true "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" \
      --xla_gpu_experimental_enable_fusion_block_level_rewriter=true \
      --xla_gpu_experimental_enable_same_shape_multi_output_fusion=true --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
    for flags in "" "$@"; do
      echo "== XLA_FLAGS=${flags}"
      (export XLA_FLAGS="$flags"; OUT="$OUT/xla-flags$(echo "$flags" | md5sum | cut -c1-6)" leg 130 benchmarks/decode.py \
         --layouts NANO_NVFP4 --batches 1 --profile-batches "" --steps 32 --repeats 4 --no-gate 2>&1 | grep "^\[\|rror")
    done ;;
  compare) # same card, same protocol: the baseline tree, then this one
    if have_old; then
      (cd _old && echo "== _old tree $(tree_id)" && \
        OUT="$OUT/old" leg 280 benchmarks/decode.py --layouts NANO_NVFP4 --batches 1,32 --profile-batches "" \
          --steps 32 --repeats 2 --no-gate --call-overhead)
    fi
    echo "== this tree"
    (OUT="$OUT/new" leg 280 benchmarks/decode.py --layouts NANO_NVFP4 --batches 1,32 --profile-batches "" --steps 32 \
       --repeats 2 --no-gate --call-overhead) ;;
  compare-prefill) # the same for prefill of one 2,048-token prompt and 8 of 512 (benchmarks/prefill.py), profiled
    for tree in _old .; do
      [ "$tree" = . ] || have_old || continue
      (cd "$tree" && echo "== $tree tree $(tree_id)" && OUT="$OUT/prefill-$(basename "$(pwd)")" leg 280 \
         benchmarks/prefill.py --layouts NANO_NVFP4 --shapes 1x2048,8x512 --profile --no-gate)
    done ;;
  ssd) leg 200 benchmarks/ssd.py $([ -d _old/nemoh ] && echo --against _old) ;;
  variants) # kernel tilings against the default in one process, timed calls interleaved (benchmarks/ab.py), each
             # variant gated; the tilings after the part's name (default: $CANDIDATE_TILINGS)
    leg 560 benchmarks/ab.py --layout "${3:-NANO_NVFP4}" --batches 1,32 --rounds 6 \
      --tilings "${2:-$CANDIDATE_TILINGS}" ;;
  prefill-variants) # the same for prefill: one prompt of 2,048 tokens and 8 of 512
    leg 560 benchmarks/ab.py --layout "${3:-NANO_NVFP4}" --batches "" --prefill-shapes 1x2048,8x512 \
      --tilings "${2:-$CANDIDATE_PREFILL_TILINGS}" --rounds 6 ;;
  xla-variants) leg 560 benchmarks/ab.py --layout NANO_NVFP4 --batches 1,32 --rounds 6 \
                  --xla-options "${2:-$CANDIDATE_XLA}" --sampling "${3:-}" ;;
  prefill-xla-variants) leg 560 benchmarks/ab.py --layout NANO_NVFP4 --batches "" --prefill-shapes 1x2048,8x512 \
                          --rounds 6 --xla-options "${2:-$CANDIDATE_PREFILL_XLA}" ;;
  sampler) leg 200 benchmarks/sampler.py --batches 1,8,32 ;;
  lever) kernel_tests 120 "mma or store_real_rows"  # the decode blocks' paths (a whole call: ab.py ~380 s)
         leg 120 benchmarks/kernels.py --only scaling --formats nvfp4,fp8 --tilings "${2:-$CANDIDATE_TILINGS}" \
           | grep "scaling .*: kernel us"
         leg 400 benchmarks/ab.py --layout NANO_NVFP4 --batches 1,32 --rounds 4 --tilings "${2:-$CANDIDATE_TILINGS}" ;;
  kernel-variants) # the kernels alone under the default tiling and the candidates of `variants`: GEMV fit, MoE
                   # at 1 and 32 tokens
    leg 400 benchmarks/kernels.py --only scaling,moe1,moe32 --formats nvfp4,fp8,bf16 \
      --tilings "${2:-$CANDIDATE_TILINGS}" ;;
  prefill-experts) leg 300 benchmarks/kernels.py --only moe2048 --formats bf16 --tilings "${2:-$CANDIDATE_PREFILL_TILINGS}" ;;
  prefill-trace) for graphs in "" --graphs; do
                   leg 250 benchmarks/step_trace.py --layout "${2:-dense}" --pattern "MEM*E" --prefill 1x2048 $graphs
                 done ;;
  trace) for b in 1 32; do for graphs in "" --graphs; do
           leg 170 benchmarks/step_trace.py --batch $b ${2:+--tiling "$2"} $graphs
         done; done
         leg 150 benchmarks/kernels.py --only scaling --formats nvfp4,fp8,bf16 ;;
  compile) # batch 1 (no XLA GEMMs in the step), then batch 32 (XLA's GEMMs: the router), each as it is and with
           # XLA's autotuning off
    for batch in 1 32; do leg 280 benchmarks/compile.py --variants default,autotune0 --batch $batch ${2:+--tiling "$2"}; done ;;
  compile-compare) # compile times of the baseline tree (_old) and this one, alternating, twice at batch 1, then at 32
    have_old || exit 1
    for batch in 1 1 32; do for tree in _old .; do
      name=$([ $tree = . ] && echo new || echo old)-b$batch-$(date +%s)
      (cd $tree && echo "== $tree tree $(tree_id), batch $batch" && \
        NEMOH_COMPILATION_CACHE=0 OUT="$OUT/$name" leg 180 benchmarks/compile.py --variants default --batch $batch)
    done; done ;;
  load) leg 560 benchmarks/load.py --dir /tmp/nano-nvfp4 ;;
  counters) # ncu replays each profiled launch once a metric pass, two warm launches a case (the moe cases: up, down);
            # clocks left alone (--clock-control none), as the timed legs run them
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "== no ncu on this machine"; exit 1; }
    mkdir -p "$OUT"
    for case in ${2:-gemv:nvfp4 moe1:nvfp4 moe32:nvfp4 moe32:fp8}; do
      report="$OUT/counters-${case/:/-}.txt"
      timeout 120 "$ncu" --clock-control none -k 'regex:wgemm' --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
        python3 benchmarks/counters.py ${case/:/ } ${3:+--tiling "$3"} > "$report" 2>&1
      echo "== $case (rc $?, $report)"
      grep -E "Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy" "$report"
      grep -E "Block Limit (Reg|Shared)|Warp Cycles Per Issued|Issue Slots Busy|Grid Size" "$report" | head -12
    done ;;
  idle) # where the decode step's CUDA graphs split: XLA's thunk sequences of the 13-layer batch-1 decode
        # program, this tree and (when present) an older one extracted to _old, e.g. a8f5353 with
        # `git archive a8f5353 | tar -x -C _old` (copy this benchmarks/profile.py over its own)
        for tree in . _old; do
          [ -d "$tree/nemoh" ] || continue
          name=$(basename "$(cd "$tree" && pwd)"); dump=/tmp/nemoh-thunks-$name; rm -rf "$dump"; echo "== $tree"
          (cd "$tree" && env PYTHONPATH=. NEMOH_COMPILATION_CACHE=0 \
             XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_decode.*" \
             timeout 200 python3 benchmarks/decode.py --layouts NANO_NVFP4 --pattern "MEMEM*EMEMEM*" --batches 1 \
               --profile-batches 1 --steps 32 --repeats 2 --no-gate --out "$OUT/idle-$name" 2>&1 \
             | quiet | grep "batch 1:\|sum of kernels\|idle between")
          (cd "$dump" && tar czf "$OUT/thunks-$name.tgz" $(ls | grep "_decode.*\(thunk_sequence\|after_optimizations.txt\)"))
        done ;;
  *) echo "usage: bash benchmarks/h200.sh PART (see the top of this file)" >&2; exit 2 ;;
esac
