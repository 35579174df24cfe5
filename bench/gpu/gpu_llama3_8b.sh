#!/usr/bin/env bash
# Megatron-LM's own Llama-3-8B example (examples/llama/train_llama3_8b_h100_fp8.sh at
# core_v0.16.1, the copy in tests/data/megatron_lm_examples) run as its text on one H200,
# with one mode flag added and nothing else new:
#   MODE=zenflow   --zenflow (its defaults; every size auto)
#   MODE=offload   --offload-optimizer (every size auto)
# What is changed in the script's text, and why:
#   DTYPE="fp8" -> "bf16"        the fp8 flags left out (Transformer Engine is not here);
#                                the script's own bf16 branch
#   GPUS_PER_NODE=8 -> 1         one GPU
#   --train-samples N -> 128 x ITERS (ITERS iterations of the global batch of 128)
#   the --save/--load/--save-interval lines  dropped: the end-of-run save of 8B weights
#                                 and states would not fit the machine's 64 GB disk
# A stand-in `torchrun` on the script's PATH runs torch.distributed.run with the same
# arguments plus the mode flag and --metrics-path $OUT/llama-$MODE.jsonl.
# Usage (repository root, on the GPU machine; carry .whl):
#   OUT=/dir MODE=zenflow ITERS=3 bash bench/gpu/gpu_llama3_8b.sh
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
MODE="${MODE:-zenflow}"
ITERS="${ITERS:-3}"
case "$MODE" in
  zenflow) FLAG="--zenflow" ;;
  offload) FLAG="--offload-optimizer" ;;
  *) echo "MODE must be zenflow or offload"; exit 2 ;;
esac
SRC=tests/data/megatron_lm_examples/core_v0.16.1/examples/llama/train_llama3_8b_h100_fp8.sh
WORK="$(mktemp -d)"
sed -e 's/^DTYPE="fp8"$/DTYPE="bf16"/' -e 's/^GPUS_PER_NODE=8$/GPUS_PER_NODE=1/' \
    -e "s/--train-samples 1953125000/--train-samples $((128 * ITERS))/" \
    -e '/--save "\$CHECKPOINT_PATH"/d' -e '/--load "\$CHECKPOINT_PATH"/d' \
    -e '/--save-interval 1000$/d' "$SRC" > "$WORK/run.sh"
diff "$SRC" "$WORK/run.sh" > "$OUT/llama-$MODE.diff"
[ "$(grep -c '^[<>]' "$OUT/llama-$MODE.diff")" = 9 ] || { echo "the substitutions did not all apply"; cat "$OUT/llama-$MODE.diff"; exit 2; }
mkdir -p "$WORK/bin"
cat > "$WORK/bin/torchrun" <<SHIM
#!/usr/bin/env bash
exec python3 -m torch.distributed.run "\$@" $FLAG --metrics-path "$OUT/llama-$MODE.jsonl"
SHIM
chmod +x "$WORK/bin/torchrun"
( while true; do { date -u +%H:%M:%S; free -g | sed -n 2p
    nvidia-smi --query-gpu=memory.used --format=csv,noheader; } >> "$OUT/memory-$MODE.txt"
    sleep 15; done ) &
MONITOR=$!
PATH="$WORK/bin:$PATH" timeout "${LIMIT:-560}" bash "$WORK/run.sh" "$WORK/ckpt" "$WORK/tb" \
    2>&1 | grep -v "UserWarning\|warnings.warn\|return func" | tee "$OUT/llama-$MODE.txt" | tail -25
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/llama-$MODE.txt"
kill $MONITOR
python3 - "$OUT/llama-$MODE.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    if "time/iteration_s" not in r:
        continue
    fb = sum(r.get(k, 0.0) for k in ("time/forward_s", "time/backward_s"))
    step = r["time/iteration_s"]
    print("iteration", r.get("iteration"), "loss", r.get("train/lm_loss", r.get("lm loss")),
          "step s", round(step, 2), "fwd+bwd s", round(fb, 2),
          "ratio", round(step / fb, 3) if fb else None,
          {k: r[k] for k in r if k.startswith(("zenflow/", "memory/host", "memory/gpu_max"))})
PY
