#!/usr/bin/env bash
# The quickstart: ONE command from a fresh clone, on a machine with or without a GPU.
#   bash examples/quickstart.sh
# 1. creates .venv and installs requirements.txt and requirements-test.txt into it, so that
#    the README's test command runs in it afterwards (skipped when already installed, and
#    skipped altogether when $PYTHON already has the pinned packages, e.g. in CI's venv),
# 2. builds a real corpus that ships with every Python installation (the standard
#    library's source text) with tools/build_corpus.py,
# 3. trains a SentencePiece tokenizer on it, 4. preprocesses it to .bin/.idx,
# 5. pretrains a small GPT with pretrain_gpt.py (CPU when there is no GPU) with its
#    optimizer states offloaded to a host cache and files under $WORK/offload, printing the
#    iteration breakdown, saving checkpoints, metrics JSONL and an offline wandb run,
# 6. plots the metrics to breakdown.png with tools/plot_breakdown.py,
# 7. samples a continuation of a Python prompt from the trained model (tools/generate.py)
#    into $WORK/sample.txt and exports the model to Hugging Face transformers format in
#    $WORK/hf (tools/convert_checkpoint.py --to hf).
# Running it again reuses the corpus, tokenizer and data and resumes from the latest
# checkpoint; with a larger QUICKSTART_ITERS it trains on to the new count.
# Knobs (environment): QUICKSTART_DIR (default runs/quickstart), QUICKSTART_ITERS (150),
# QUICKSTART_DOCS (1500 documents), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${QUICKSTART_DIR:-runs/quickstart}"
ITERS="${QUICKSTART_ITERS:-150}"
DOCS="${QUICKSTART_DOCS:-1500}"
PY="${PYTHON:-python3}"
# Each step's header carries the time since the start (bash's SECONDS), so a run shows
# where its minutes went.
step() { printf '\n== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# True when python "$1" already has every pinned package of the requirement files "$2"...
# at its pinned version (as when the test suite runs this script inside the venv CI built
# from them), so nothing needs installing. Reads the installed packages' metadata without
# importing them (importing torch and megatron-core takes seconds); a local build tag such
# as torch's +cu130 does not count as a different version. A pin with a python_version marker
# counts only where the marker holds (megatron-core's two pins).
has_requirements() {
  local python="$1"
  shift
  "$python" - "$@" 2>/dev/null <<'PYCHECK'
import importlib.metadata as md
import re
import sys

def installed(name):
    try:
        return md.version(name).split("+")[0]
    except md.PackageNotFoundError:
        return None

def applies(marker):
    # An environment marker such as: python_version < "3.12" (the only kind the files use).
    # A marker this cannot read counts as not installed, so the script installs as usual.
    if not marker:
        return True
    m = re.fullmatch(r'python_version\s*(<=|>=|==|!=|<|>)\s*["\'](\d+(?:\.\d+)*)["\']', marker)
    if m is None:
        raise SystemExit(1)
    have, want = sys.version_info[:2], tuple(int(x) for x in m.group(2).split("."))
    return {"<": have < want, "<=": have <= want, ">": have > want, ">=": have >= want,
            "==": have == want, "!=": have != want}[m.group(1)]

pins = []
for path in sys.argv[1:]:
    for line in open(path):
        spec, _, marker = line.split("#")[0].strip().partition(";")
        if "==" in spec and applies(marker.strip()):
            pins.append(spec.strip().split("=="))
sys.exit(0 if all(installed(p[0]) == p[1] for p in pins) else 1)
PYCHECK
}
ACTIVATE=""
if has_requirements "$PY" requirements.txt; then
  step "environment: $("$PY" -c 'import sys; print(sys.executable)') already has the requirements"
else
  step "environment (.venv)"
  if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
  PY=python
  ACTIVATE=". .venv/bin/activate && "
  # The test requirements (pytest, pytest-xdist: small) go in too, so that the README's test
  # command works in this venv right after the quickstart. A venv that already has both
  # (e.g. made by the README's test command first) installs nothing.
  if ! has_requirements "$PY" requirements.txt requirements-test.txt; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -r requirements.txt -r requirements-test.txt
  fi
fi
mkdir -p "$WORK"

step "corpus: the Python standard library's source text ($DOCS documents)"
[ -s "$WORK/corpus.jsonl" ] || "$PY" tools/build_corpus.py --output "$WORK/corpus.jsonl" \
    --max-docs "$DOCS" --max-chars 20000 --seed 1

step "tokenizer (SentencePiece BPE, 4096 pieces)"
[ -s "$WORK/tokenizer.model" ] || "$PY" tools/train_tokenizer.py --input "$WORK/corpus.jsonl" \
    --output-prefix "$WORK/tokenizer" --vocab-size 4096 --model-type bpe --quiet

step "preprocessing to megatron-core .bin/.idx"
[ -s "$WORK/stdlib_text_document.idx" ] || "$PY" tools/preprocess_data.py \
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
# The optimizer states leave the model's device: 6 subgroups of 1M elements, 3 of them in a
# 36 MB host cache, the rest in files under $WORK/offload (its bandwidth probed at start).
mkdir -p "$WORK/offload"
OFFLOAD=(--offload-optimizer --offload-paths "$WORK/offload" --offload-subgroup-size 1000000
         --offload-host-cache-gb 0.036)
# Run again with a larger QUICKSTART_ITERS, the script resumes and trains on to the new count.
# The cosine schedule's length is --train-iters, so the checkpoint's schedule then differs
# from the flags' and a resume would be refused; --override-opt_param-scheduler (Megatron-LM's
# flag) takes the flags' schedule: from the resumed iteration on, the learning rate follows
# the cosine of the new length, as if the run had been started for it (a small step up from
# --min-lr, instead of staying at --min-lr as --use-checkpoint-opt_param-scheduler would).
# With an unchanged QUICKSTART_ITERS the two schedules are the same and the flag changes
# nothing; on a first run there is no checkpoint to override.
OUTPUT=(--save "$WORK/checkpoints" --load "$WORK/checkpoints" --override-opt_param-scheduler
        --save-interval 50 --log-interval 10 --eval-interval 50 --eval-iters 4 --num-workers 0
        --metrics-path "$WORK/metrics.jsonl" --wandb-project megatron_ext-quickstart
        --wandb-exp-name quickstart --wandb-save-dir "$WORK" --wandb-mode offline)
"$PY" pretrain_gpt.py "${MODEL[@]}" "${TRAIN[@]}" "${OFFLOAD[@]}" "${DATA[@]}" "${OUTPUT[@]}"

step "plot of the iteration breakdown"
"$PY" tools/plot_breakdown.py "$WORK/metrics.jsonl" --output "$WORK/breakdown.png" \
    --title "quickstart: 4-layer GPT on the Python standard library"
# A prompt in the corpus's language (Python source), ending where a token ends: a prompt
# that ends in a space ends on a lone space piece, which the tokenizer almost never produces
# there, and the model continues it with garbage. Greedy decoding of a model this small loops
# on one line; top-k sampling at a lower temperature reads like the corpus, and the seed
# fixes the draw.
step "sampling from the trained model (tools/generate.py, top-k 20, temperature 0.7)"
PROMPT=$'import os\nimport sys\n\n\ndef main():\n'
# generate.py prints the continuation alone; the sample is the prompt and its continuation.
CONTINUATION=$("$PY" tools/generate.py --load "$WORK/checkpoints" --prompt "$PROMPT" \
    --max-new-tokens 64 --top-k 20 --temperature 0.7 --seed 1)
printf '%s%s\n' "$PROMPT" "$CONTINUATION" | tee "$WORK/sample.txt"

step "export to Hugging Face transformers (tools/convert_checkpoint.py --to hf)"
rm -rf "$WORK/hf"
"$PY" tools/convert_checkpoint.py --load "$WORK/checkpoints" --to hf --output "$WORK/hf"
step "done"
echo "checkpoints: $WORK/checkpoints   metrics: $WORK/metrics.jsonl   wandb: $WORK/wandb"
echo "plot: $WORK/breakdown.png"
echo "sample: $WORK/sample.txt   Hugging Face model: $WORK/hf (transformers.AutoModelForCausalLM)"
if has_requirements "$PY" requirements-test.txt; then
  echo "tests: ${ACTIVATE}python -m pytest -q -n 2 --dist loadgroup"
fi
