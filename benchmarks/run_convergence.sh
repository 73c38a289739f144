#!/usr/bin/env bash
# qmoe converge on a GPU, sized for one device call of at most 10 minutes.
#
#   bash benchmarks/run_convergence.sh [PRESET] [OUT_DIR]
#
# PRESET: small (default) or dsv3-like. Writes convergence.json (small) or
# convergence_<preset>.json, and the three-panel plot of the same name (.png), into OUT_DIR;
# without OUT_DIR, the JSON goes to benchmarks/results/ and the plot to docs/ (where the
# repository keeps them: benchmarks/results/ holds JSON only). On the device machine pass $OUT.
# Environment: RECIPES (default: bf16 and the five recipes), SEEDS (bf16 seeds,
# default 2), BUDGET (seconds before the job stops cleanly, default 540), ABLATIONS=1 adds the
# NVFP4 / delayed-scaling ablation runs, PRECISION (auto|bf16|fp32, default: the preset's).
#
# Every run is written to the JSON as soon as it finishes. If BUDGET runs out first, the job
# stops at a step boundary, writes what it has and exits 0; put that JSON at
# benchmarks/results/<same name> in the working tree and run again with RESUME=1: finished
# runs are kept, the others start again (checkpoints live on the device machine, in
# $CKPT_DIR, and survive only while it stays warm). Alternatively split the runs over calls
# with RECIPES (bf16 must be in each) and join the files with
#   qmoe converge --merge a.json b.json --out benchmarks/results/convergence.json --plot ...
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:-small}
OUT_DIR=${2:-benchmarks/results}
PLOT_DIR=${2:-docs}
NAME=convergence$([ "$PRESET" = small ] || echo "_$PRESET")
RECIPES=${RECIPES:-bf16 delayed current block mxfp8 nvfp4}
CKPT_DIR=${CKPT_DIR:-/tmp/qmoe_converge_ckpt/$NAME}
mkdir -p "$OUT_DIR" "$PLOT_DIR"
args=(converge --preset "$PRESET" --recipes $RECIPES --seeds "${SEEDS:-2}" --out "$OUT_DIR/$NAME.json"
      --plot "$PLOT_DIR/$NAME.png" --checkpoint-dir "$CKPT_DIR" --time-budget "${BUDGET:-540}" --no-progress)
[ -n "${PRECISION:-}" ] && args+=(--precision "$PRECISION")
[ "${ABLATIONS:-0}" = 1 ] && args+=(--ablations)
if [ "${RESUME:-0}" = 1 ]; then
    if [ -f "benchmarks/results/$NAME.json" ] && [ "benchmarks/results/$NAME.json" != "$OUT_DIR/$NAME.json" ]; then
        cp "benchmarks/results/$NAME.json" "$OUT_DIR/$NAME.json"
    fi
    args+=(--resume)
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m qmoe.cli "${args[@]}"
