#!/bin/bash
# LatentRemedy ablations of issue 25 at one equal CPU budget each (README, "Conflicting tasks"). Each line is one
# command writing one JSON under benchmarks/results/; scripts/latent_ablation_table.py makes the README table.
# Data: train_abl = inventory 40, schedule 24, phonebook 12, prices 12 records (seed 0, 176 examples), dev = seed 7
# (python -m hf_kvreuse.latent.data, see README):
D=${D:-/work/i25data}
B=${B:-240}   # CPU seconds of training per ablation (data loading and the dev evaluation excluded)
T="python -m hf_kvreuse.latent.train --data $D/train_abl --dev $D/dev \
--budget-cpu-s $B --lr 5e-3 --threads 1"
R=benchmarks/results
case "$1" in
  scratch)   $T --out $D/runs/scratch --result $R/latent_ablation_scratch.json ;;
  amortised) $T --stage1-examples 24 --stage1-steps 8 --out $D/runs/amortised --result $R/latent_ablation_amortised.json ;;
  pooled)    $T --layers -1 11 19 --read attn --out $D/runs/pooled --result $R/latent_ablation_pooled.json ;;
  n4)        $T --n-latent 4 --out $D/runs/n4 --result $R/latent_ablation_n4.json ;;
  n16)       $T --n-latent 16 --out $D/runs/n16 --result $R/latent_ablation_n16.json ;;
  wide)      $T --hidden 1024 --out $D/runs/wide --result $R/latent_ablation_wide.json ;;
  tail16)    $T --tail-tokens 16 --out $D/runs/tail16 --result $R/latent_ablation_tail16.json ;;
  # the shipped candidates: every training record (inventory 40, schedule 24, phonebook 24, prices 24 records:
  # 224 examples), started before the screen above had finished (the machine's CPU share did not allow waiting)
  final_plain)  python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev --budget-cpu-s ${BF:-1500} --lr 5e-3 \
--save-every 5 --threads 1 --compare shipped --out $D/runs/final_plain --result $R/latent_train_final_plain.json ;;
  final_tail16) python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev --budget-cpu-s ${BF:-1500} --lr 5e-3 \
--save-every 5 --threads 1 --tail-tokens 16 --compare shipped --out $D/runs/final_tail16 --result $R/latent_train_final_tail16.json ;;
  *) echo "usage: $0 scratch|amortised|pooled|n4|n16|wide|tail16|final_plain|final_tail16"; exit 2 ;;
esac
