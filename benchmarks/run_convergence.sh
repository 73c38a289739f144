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
# NVFP4 / delayed-scaling ablation runs, PRECISION (auto|bf16|fp32, default: the preset's),
# STEPS (default: the preset's), JOBS (default 1): how many `qmoe converge --only` jobs share the GPU at once, each taking every
# JOBS-th run; their files are merged into one. The small presets leave the GPU mostly idle (each
# step is bound by the host), so JOBS up to the CPU cores runs them side by side at nearly solo
# speed; the results record concurrent_jobs beside tokens/s. ONLY="label ..." (with JOBS > 1)
# trains just those runs, e.g. the ones an earlier job left unfinished; merge the files after.
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
# what every job of this config is given; the single job adds its results file and plot
common=(converge --preset "$PRESET" --recipes $RECIPES --seeds "${SEEDS:-2}" --checkpoint-dir "$CKPT_DIR"
        --time-budget "${BUDGET:-540}" --no-progress)
[ -n "${PRECISION:-}" ] && common+=(--precision "$PRECISION")
[ -n "${STEPS:-}" ] && common+=(--steps "$STEPS")
[ "${ABLATIONS:-0}" = 1 ] && common+=(--ablations)
args=("${common[@]}" --out "$OUT_DIR/$NAME.json" --plot "$PLOT_DIR/$NAME.png")
if [ "${RESUME:-0}" = 1 ]; then
    if [ -f "benchmarks/results/$NAME.json" ] && [ "benchmarks/results/$NAME.json" != "$OUT_DIR/$NAME.json" ]; then
        cp "benchmarks/results/$NAME.json" "$OUT_DIR/$NAME.json"
    fi
    args+=(--resume)
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
JOBS=${JOBS:-1}
if [ "$JOBS" -le 1 ]; then
    python3 -m qmoe.cli "${args[@]}"
    exit 0
fi
# the run labels of this config, dealt round-robin to JOBS jobs
labels=$(python3 - "$PRESET" "${ABLATIONS:-0}" "${SEEDS:-2}" $RECIPES <<'PY'
import sys
from qmoe.converge.config import preset, with_overrides
name, ablations, seeds, recipes = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
cfg = with_overrides(preset(name), recipes=recipes, seeds=seeds, ablations=ablations)
print(" ".join(s.label for s in cfg.runs()))
PY
)
read -ra all <<< "${ONLY:-$labels}"
parts=() pids=()
mkdir -p "$OUT_DIR/$NAME.parts"
for ((j = 0; j < JOBS && j < ${#all[@]}; j++)); do
    mine=()
    for ((i = j; i < ${#all[@]}; i += JOBS)); do mine+=("${all[i]}"); done
    part="$OUT_DIR/$NAME.parts/job$j.json"
    parts+=("$part")
    python3 -m qmoe.cli "${common[@]}" --out "$part" --only "${mine[@]}" \
        --concurrent-jobs "$(( JOBS < ${#all[@]} ? JOBS : ${#all[@]} ))" > "$part.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
for part in "${parts[@]}"; do tail -n 3 "$part.log"; done
python3 -m qmoe.cli converge --merge "${parts[@]}" --out "$OUT_DIR/$NAME.json" --plot "$PLOT_DIR/$NAME.png"
exit $status
