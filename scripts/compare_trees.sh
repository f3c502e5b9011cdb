#!/usr/bin/env bash
# A/B timing of the Triton backend of two source trees (this one and an older copy, e.g. made by
# `git archive <rev> flash_attn_ck scripts | tar -x -C .ab-old`) in one device call: old, new, old,
# new, so that each version is timed twice (the spread between a version's two runs is the noise).
#   bash scripts/compare_trees.sh OLD_TREE "d:h:h_k:s:causal,..."
set -u
old=$1 shapes=$2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for round in 1 2; do
  for tree in "$old" .; do
    name=$([ "$tree" = . ] && echo new || echo old)
    python3 "$tree/scripts/bench_bwd.py" --peers triton --shapes "$shapes" --out "$OUT/ab-$name-$round" 2>&1 \
      | grep -E "bwd TF/s|Error" | sed "s|^|$name#$round |"
  done
done
