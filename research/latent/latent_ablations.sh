#!/bin/bash
# LatentRemedy ablations of issue 25 at one equal CPU budget each (README, "Conflicting tasks"). Each line is one
# command writing one JSON under benchmarks/results/; research/latent/latent_ablation_table.py makes the README table.
# Data: train_abl = inventory 40, schedule 24, phonebook 12, prices 12 records (seed 0, 176 examples), dev = seed 7
# (python -m hf_kvreuse.latent.data, see README):
D=${D:-/work/i25data}
B=${B:-240}   # CPU seconds of training per ablation (data loading and the dev evaluation excluded)
RUNS=${RUNS:-$D/runs}   # run folders (a folder with a saved state resumes: give a fresh one for a new budget)
SFX=${SFX:-}            # suffix of the result JSONs (e.g. _600 for B=600)
T="python -m hf_kvreuse.latent.train --data $D/train_abl --dev $D/dev \
--budget-cpu-s $B --lr 5e-3 --threads 1"
R=benchmarks/results
case "$1" in
  scratch)   $T --out $RUNS/scratch --result $R/latent_ablation_scratch$SFX.json ;;
  amortised) $T --stage1-examples 24 --stage1-steps 8 --out $RUNS/amortised --result $R/latent_ablation_amortised$SFX.json ;;
  pooled)    $T --layers -1 11 19 --read attn --out $RUNS/pooled --result $R/latent_ablation_pooled$SFX.json ;;
  n4)        $T --n-latent 4 --out $RUNS/n4 --result $R/latent_ablation_n4$SFX.json ;;
  n16)       $T --n-latent 16 --out $RUNS/n16 --result $R/latent_ablation_n16$SFX.json ;;
  wide)      $T --hidden 1024 --out $RUNS/wide --result $R/latent_ablation_wide$SFX.json ;;
  tail16)    $T --tail-tokens 16 --out $RUNS/tail16 --result $R/latent_ablation_tail16$SFX.json ;;
  # the shipped candidates: every training record (inventory 40, schedule 24, phonebook 24, prices 24 records:
  # 224 examples), started before the screen above had finished (the machine's CPU share did not allow waiting)
  final_plain)  python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev --budget-cpu-s ${BF:-1500} --lr 5e-3 \
--save-every 5 --threads 1 --compare shipped --out $D/runs/final_plain --result $R/latent_train_final_plain.json ;;
  final_tail16) python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev --budget-cpu-s ${BF:-1500} --lr 5e-3 \
--save-every 5 --threads 1 --tail-tokens 16 --compare shipped --out $D/runs/final_tail16 --result $R/latent_train_final_tail16.json ;;
  # session of 2026-12-02 (a quiet machine: a whole core per run): more training records (seed 1, 60 per family,
  # 480 examples; train_all = train + train_more, 704 examples) and a larger held-out dev set (seed 8, 34 records
  # per held-out family; dev_big = dev + dev_big_new, 268 examples), then latents + Tail-16 with and without a LoRA at one budget each (all_plain: not run)
  data_more) M="python -m hf_kvreuse.latent.data --model qwen2.5-0.5b --threads 1"
     $M --families retrieval extract code --n 34 --seed 8 --out $D/dev_big_new
     $M --families inventory schedule phonebook prices --n 60 --seed 1 --out $D/train_more
     mkdir -p $D/train_all $D/dev_big
     ln -sf $D/train/*_0-*.json $D/train/*.safetensors $D/train_more/*_1-*.json $D/train_more/*.safetensors $D/train_all/
     ln -sf $D/dev/*_7-*.json $D/dev/*.safetensors $D/dev_big_new/*_8-*.json $D/dev_big_new/*.safetensors $D/dev_big/ ;;
  all_tail16) python -m hf_kvreuse.latent.train --data $D/train_all --dev $D/dev_big --budget-cpu-s ${BF:-2400} \
--lr 5e-3 --save-every 10 --threads 1 --tail-tokens 16 --compare shipped --out $D/runs/all_tail16 \
--result $R/latent_train_all_tail16.json ;;
  all_tail16_lora8) python -m hf_kvreuse.latent.train --data $D/train_all --dev $D/dev_big --budget-cpu-s ${BF:-2400} \
--lr 5e-3 --save-every 10 --threads 1 --tail-tokens 16 --lora-rank 8 --lora-lr 1e-3 --out $D/runs/all_tail16_lora8 \
--result $R/latent_train_all_tail16_lora8.json ;;
  all_plain) python -m hf_kvreuse.latent.train --data $D/train_all --dev $D/dev_big --budget-cpu-s ${BF:-2400} \
--lr 5e-3 --save-every 10 --threads 1 --out $D/runs/all_plain --result $R/latent_train_all_plain.json ;;
  # session of 2026-12-02 (evening): the two best leads of the 600 CPU s screen (16 latents, amortised training) on
  # top of the shipped set-up (Tail-16 + rank-8 LoRA), same data and budget as all_tail16_lora8 (stage 1 on 96
  # examples x 8 steps: the screen's share of the budget), compared with the shipped checkpoint (that run)
  all_n16_amortised) python -m hf_kvreuse.latent.train --data $D/train_all --dev $D/dev_big --budget-cpu-s ${BF:-2400} \
--lr 5e-3 --save-every 10 --threads 1 --tail-tokens 16 --lora-rank 8 --lora-lr 1e-3 --n-latent 16 \
--stage1-examples 96 --stage1-steps 8 --compare shipped --out $D/runs/all_n16_amortised \
--result $R/latent_train_all_n16_amortised.json ;;
  # session of 2026-12-04: the bridge also reads the donor's prefix (--donor), against the same run without it;
  # plain set-up (no Tail-k, no LoRA) and latents + Tail-16 (no LoRA), on the 224 training examples, evaluated on
  # dev_big (268 examples)
  plain_base)  python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev_big --budget-cpu-s ${BF:-1200} \
--lr 5e-3 --save-every 10 --threads 1 --out $RUNS/plain_base --result $R/latent_ablation_plain_base.json ;;
  plain_donor) python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev_big --budget-cpu-s ${BF:-1200} \
--lr 5e-3 --save-every 10 --threads 1 --donor --out $RUNS/plain_donor --result $R/latent_ablation_plain_donor.json ;;
  tail16_base)  python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev_big --budget-cpu-s ${BF:-1200} \
--lr 5e-3 --save-every 10 --threads 1 --tail-tokens 16 --out $RUNS/tail16_base --result $R/latent_ablation_tail16_base.json ;;
  tail16_donor) python -m hf_kvreuse.latent.train --data $D/train --dev $D/dev_big --budget-cpu-s ${BF:-1200} \
--lr 5e-3 --save-every 10 --threads 1 --tail-tokens 16 --donor --out $RUNS/tail16_donor \
--result $R/latent_ablation_tail16_donor.json ;;
  *) echo "usage: $0 scratch|amortised|pooled|n4|n16|wide|tail16|final_plain|final_tail16|data_more|all_tail16|all_tail16_lora8|all_plain|all_n16_amortised|plain_base|plain_donor|tail16_base|tail16_donor"
     exit 2 ;;
esac
