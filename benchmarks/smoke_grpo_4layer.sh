#!/usr/bin/env bash
# The 4-layer slice at full width on one GPU: a few GRPO steps with LoRA in bf16.
#
#   bash benchmarks/smoke_grpo_4layer.sh            # OUT=reports/smoke_grpo_4layer by default
#
# With CKPT pointing at a real 4-layer slice (`glmkit ckpt slice`), its own tokenizer and DAPO data
# are used (set PROMPT_DATA). Without one, a seeded random checkpoint is synthesised on the GPU, and the
# shipped tiny tokenizer and synthetic arithmetic stand in: random weights answer nothing, so every
# reward is 0 and the group advantages vanish; a small entropy bonus (ENTROPY_COEF) keeps the adapter
# gradients, the updates and the adapter sync real. RUNS lists backend:flags, one run each; by default
# torch without routing replay (it logs train/routing_mismatch_frac) and fla with --enable-r3, the
# recipe's setting. Metrics land in $OUT/metrics_<backend><flags>.jsonl.
set -euo pipefail
OUT=${OUT:-reports/smoke_grpo_4layer}
CKPT=${CKPT:-/tmp/glm53-flash-4layer-synth}
NUM_ROLLOUT=${NUM_ROLLOUT:-4}
RUNS=${RUNS:-"torch: fla:--enable-r3"}
GLMKIT=${GLMKIT:-"python3 -m glmkit"}
mkdir -p "$OUT"

data_args=()
if [ ! -f "$CKPT/config.json" ]; then
  start=$(date +%s)
  $GLMKIT ckpt synth --variant GLM-5.3-Flash-4layer --dtype bfloat16 --device cuda --out "$CKPT"
  echo "synth: $(( $(date +%s) - start )) s"
fi
if [ ! -f "$CKPT/tokenizer.json" ]; then
  data_args=(--tokenizer glmkit/assets/tiny_tokenizer --prompt-data glmkit/assets/arith/train.jsonl
             --entropy-coef "${ENTROPY_COEF:-1e-3}")
elif [ -n "${PROMPT_DATA:-}" ]; then
  data_args=(--prompt-data "$PROMPT_DATA")
fi

for run in $RUNS; do
  backend=${run%%:*}
  extra=${run#*:}
  tag=$backend${extra//[^a-z0-9]/_}
  start=$(date +%s)
  # $extra is this script's own RUNS list (flags), split on purpose
  # shellcheck disable=SC2086
  $GLMKIT lora train --model-name GLM-5.3-Flash-4layer --checkpoint "$CKPT" "${data_args[@]}" \
    --device cuda --dtype bfloat16 --kda-backend "$backend" $extra \
    --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 8 \
    --rollout-max-response-len 32 --lora-rank 8 --metrics-out "$OUT/metrics_$tag.jsonl" --overwrite
  echo "run $backend ${extra:-}: $(( $(date +%s) - start )) s including load and first compiles"
done
