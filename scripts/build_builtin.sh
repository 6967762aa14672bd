#!/usr/bin/env bash
# Rebuild the built-in model from scratch: train on Tiny Shakespeare with the project's own
# trainer, ship the weights (float16, ~5.5 MB) inside the package, and measure them.
# Usage: bash scripts/build_builtin.sh [RUN_DIR]   (RUN_DIR must not exist yet)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/shakespeare-byte}
time gpt2mha train --data data/tinyshakespeare.txt --out "$out" --preset shakespeare \
    --iters 2400 --batch-size 16 --lr 1.5e-3 --warmup 100 --eval-interval 200 --seed 1337
python - "$out" <<'PY'
import os, shutil, sys, torch
from gpt2mha import GPT2
dst = os.path.join("src", "gpt2mha", "models", "shakespeare-byte")
GPT2.from_pretrained(sys.argv[1]).save_pretrained(dst, overwrite=True, dtype=torch.float16)
shutil.copy(os.path.join(sys.argv[1], "training_log.json"), dst)
os.chmod(os.path.join(dst, "training_log.json"), 0o644)
PY
gpt2mha perplexity data/tinyshakespeare.txt --split val --stride 128
