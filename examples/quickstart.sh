#!/usr/bin/env bash
# The quickstart: ONE command from a fresh clone, on a machine with or without a GPU.
#   bash examples/quickstart.sh
# 1. creates .venv and installs requirements.txt (skipped when already installed),
# 2. builds a real corpus that ships with every Python installation (the standard
#    library's source text) with tools/build_corpus.py,
# 3. trains a SentencePiece tokenizer on it, 4. preprocesses it to .bin/.idx,
# 5. pretrains a small GPT with pretrain_gpt.py (CPU when there is no GPU), printing the
#    iteration breakdown, saving checkpoints, metrics JSONL and an offline wandb run.
# Knobs (environment): QUICKSTART_DIR (default runs/quickstart), QUICKSTART_ITERS (150),
# QUICKSTART_DOCS (1500 documents), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${QUICKSTART_DIR:-runs/quickstart}"
ITERS="${QUICKSTART_ITERS:-150}"
DOCS="${QUICKSTART_DOCS:-1500}"
PY="${PYTHON:-python3}"
step() { printf '\n== %s\n' "$*"; }

step "environment (.venv)"
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.requirements-$(sha1sum requirements.txt | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements.txt
  touch "$stamp"
fi
mkdir -p "$WORK"

step "corpus: the Python standard library's source text ($DOCS documents)"
[ -s "$WORK/corpus.jsonl" ] || python tools/build_corpus.py --output "$WORK/corpus.jsonl" \
    --max-docs "$DOCS" --max-chars 20000 --seed 1

step "tokenizer (SentencePiece BPE, 4096 pieces)"
[ -s "$WORK/tokenizer.model" ] || python tools/train_tokenizer.py --input "$WORK/corpus.jsonl" \
    --output-prefix "$WORK/tokenizer" --vocab-size 4096 --model-type bpe --quiet

step "preprocessing to megatron-core .bin/.idx"
[ -s "$WORK/stdlib_text_document.idx" ] || python tools/preprocess_data.py \
    --input "$WORK/corpus.jsonl" --output-prefix "$WORK/stdlib" \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$WORK/tokenizer.model" \
    --append-eod --workers 2

step "pretraining ($ITERS iterations)"
MODEL=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
       --max-position-embeddings 256 --normalization RMSNorm --swiglu
       --position-embedding-type rope --disable-bias-linear
       --untie-embeddings-and-output-weights)
TRAIN=(--micro-batch-size 8 --global-batch-size 16 --train-iters "$ITERS" --lr 2e-3
       --min-lr 2e-4 --lr-warmup-iters 15 --lr-decay-style cosine --weight-decay 0.1
       --clip-grad 1.0 --use-distributed-optimizer --hidden-dropout 0 --attention-dropout 0)
DATA=(--data-path "$WORK/stdlib_text_document" --split 98,2,0
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$WORK/tokenizer.model")
OUTPUT=(--save "$WORK/checkpoints" --load "$WORK/checkpoints" --save-interval 50
        --log-interval 10 --eval-interval 50 --eval-iters 4
        --metrics-path "$WORK/metrics.jsonl" --wandb-project megatron_ext-quickstart
        --wandb-exp-name quickstart --wandb-save-dir "$WORK" --wandb-mode offline)
python pretrain_gpt.py "${MODEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${OUTPUT[@]}"

if [ -f tools/plot_breakdown.py ]; then
  step "plot of the iteration breakdown"
  python tools/plot_breakdown.py "$WORK/metrics.jsonl" --output "$WORK/breakdown.png"
fi
step "done"
echo "checkpoints: $WORK/checkpoints   metrics: $WORK/metrics.jsonl   wandb: $WORK/wandb"
