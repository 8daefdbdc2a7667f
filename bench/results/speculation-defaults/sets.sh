#!/usr/bin/env bash
# kenspec AUTO against OFF at the default flags on each prompt set (held-out chat, other
# languages/code/arithmetic, grounded rewrites, recurring templates) and on a second model
# without a trained draft (Gemma 3 270M's Q4_K_M file, --draft none; make gemma fetches it; a
# base model without a chat template: gemma-chat.jinja gives it Gemma's turns), two fresh
# starts each.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/speculation-defaults
sets=("dev 30" "ood 0" "grounded 0" "templated 0")  # each set's name and prompts skipped
[ -n "${MODEL_ONLY:-}" ] && sets=()  # MODEL_ONLY=1: the second model alone
for set in "${sets[@]}"; do
  read -r name skip <<<"$set"
  .venv/bin/python -m bench.peers --prompts "prompts/$name.txt" --skip "$skip" --limit 10 \
    --streams 0 --starts 2 --out "$out/set-$name" > "$out/set-$name.log" 2>&1
done
.venv/bin/python -m bench.peers --prompts prompts/dev.txt --skip 30 --limit 10 --streams 0 \
  --starts 2 --out "$out/set-gemma-draft-none" \
  -- --model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf --draft none \
  --chat-template "$out/gemma-chat.jinja" \
  > "$out/set-gemma-draft-none.log" 2>&1
