"""Train the plan / act / reflect LoRA role adapters for an offline model on CPU, evaluate, save.

Each adapter (rank 8, ``v_proj`` only, the PReCache setting; ``--targets k_proj v_proj`` adds key adapters) is
trained alone on its role's target tokens of the
ReAct episodes of :mod:`hf_kvreuse.workflows.react`, over SQuAD items outside the held-out articles. The evaluation then
scores the base model and each adapter on all three skills on held-out items, with greedy decoding.

    .venv/bin/python scripts/train_role_adapters.py            # SmolLM2: train (~10 min on 2 CPU cores), eval, save
    .venv/bin/python scripts/train_role_adapters.py --eval-only  # re-evaluate the shipped adapters
    .venv/bin/python scripts/train_role_adapters.py --model qwen2.5-0.5b --steps 60 100 100 --eval-diagonal
    .venv/bin/python scripts/train_role_adapters.py --model qwen2.5-0.5b --targets k_proj v_proj ...

The base model's weights stay frozen in their loading dtype (bf16 for Qwen: the fast CPU dtype); peft keeps the
LoRA factors in float32. Adapters go to ``hf_kvreuse.workflows.react.role_adapters_dir(model, targets)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_kvreuse.artifacts import record_files  # noqa: E402
from hf_kvreuse.models.loaders import MODEL_KEYS, MODEL_NAMES, load_by_key  # noqa: E402
from hf_kvreuse.workflows import react  # noqa: E402
from hf_kvreuse.workflows.datasets import SquadItem, squad  # noqa: E402


def role_example(role: str, item: SquadItem, items: list[SquadItem], rng: random.Random, n_passages: int,
                 right: bool) -> react.RoleExample:
    """One example of ``role``; reflect gets the gold answer when ``right`` else another question's answer."""
    if role == "plan":
        return react.plan_example(item)
    passages = react.observation_passages(item, items, n_passages, rng)
    if role == "act":
        return react.act_example(item, passages)
    cand = item.answers[0] if right else react.wrong_candidate(item, items, rng)
    return react.reflect_example(item, passages, cand)


def train_role(pm, tok, role: str, train: list[SquadItem], items: list[SquadItem], steps: int, lr: float,
               seed: int, clip_grad: float = 0.0) -> dict:
    """Train adapter ``role`` alone (batch 1, loss on the target tokens only, AdamW, linear decay to 10%;
    gradient norm clipped to ``clip_grad`` when it is > 0)."""
    pm.set_adapter(role)
    params = [p for n, p in pm.named_parameters() if f".{role}." in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(steps, 1))
    rng = random.Random(f"{seed}-{role}")
    order = rng.sample(train, len(train))
    pm.train()
    losses, tokens, t0 = [], 0, time.perf_counter()
    for step in range(steps):
        item = order[step % len(order)]
        # Mostly one passage (speed); some gold-among-distractor observations so longer ones are not novel.
        n_passages = rng.choices([1, 2], weights=[0.7, 0.3])[0]
        ex = role_example(role, item, items, rng, n_passages, right=step % 2 == 0)
        p_ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        t_ids = tok(ex.target, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + t_ids])
        # Logits only where the next token is a target token: skips the 49k-way head on the prompt.
        logits = pm(input_ids=ids, logits_to_keep=len(t_ids) + 1).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(t_ids))
        loss.backward()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += ids.shape[1]
        if (step + 1) % 25 == 0:
            print(f"  {role} step {step + 1}/{steps} loss(25) {sum(losses[-25:]) / 25:.3f} "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    pm.eval()
    for p in params:
        p.requires_grad_(False)
    curve = [round(sum(losses[i:i + 25]) / len(losses[i:i + 25]), 4) for i in range(0, len(losses), 25)]
    return dict(steps=steps, lr=lr, clip_grad=clip_grad, seconds=round(time.perf_counter() - t0, 1), tokens=tokens,
                loss_first25=curve[0] if curve else None, loss_last25=curve[-1] if curve else None,
                loss_curve_per25=curve)


def evaluate(pm, tok, items: list[SquadItem], heldout: list[SquadItem], n_items: int, n_passages: int,
             seed: int, diagonal: bool = False) -> dict:
    """Skill accuracy (and well-formed-output rate) of the base model and each adapter on held-out items
    (``diagonal``: each adapter on its own skill only, the base model on all three)."""
    rng = random.Random(f"{seed}-eval")
    chosen = rng.sample(heldout, min(n_items, len(heldout)))
    cases = []
    for i, item in enumerate(chosen):
        passages = react.observation_passages(item, items, n_passages, rng)
        right = i % 2 == 0  # balanced reflect labels
        cand = item.answers[0] if right else react.wrong_candidate(item, items, rng)
        cases.append((item, passages, cand, right))
    checks = {
        "plan": (lambda it, ps, c: react.plan_example(it).prompt,
                 lambda g, it, r: react.check_plan(g, it), lambda g: react.parse_retrieve(g) is not None),
        "act": (lambda it, ps, c: react.act_example(it, ps).prompt,
                lambda g, it, r: react.check_act(g, it), lambda g: "]" in g),
        "reflect": (lambda it, ps, c: react.reflect_example(it, ps, c).prompt,
                    lambda g, it, r: react.check_reflect(g, r), lambda g: react.parse_reflect(g) is not None),
    }
    rows = {}
    for variant in ("base",) + react.ROLES:
        t0 = time.perf_counter()
        row = {}
        for skill, (prompt_of, check, valid) in checks.items():
            if diagonal and variant not in ("base", skill):
                continue
            gens = []
            for item, passages, cand, right in cases:
                prompt = prompt_of(item, passages, cand)
                if variant == "base":
                    with pm.disable_adapter():
                        g = react.generate(pm, tok, prompt, react.MAX_NEW_TOKENS[skill])
                else:
                    pm.set_adapter(variant)
                    g = react.generate(pm, tok, prompt, react.MAX_NEW_TOKENS[skill])
                gens.append((g, item, right))
            row[skill] = round(100 * sum(check(g, it, r) for g, it, r in gens) / len(gens), 1)
            row[f"{skill}_valid"] = round(100 * sum(valid(g) for g, _, _ in gens) / len(gens), 1)
            row[f"{skill}_samples"] = [g for g, _, _ in gens[:3]]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows[variant] = row
        print(f"  eval {variant}: " + " ".join(f"{k} {row[k]}%" for k in checks if k in row)
              + f" ({row['seconds']} s)", flush=True)
    return dict(n_items=len(cases), n_passages=n_passages,
                plan_ceiling_named_topic=round(100 * sum(react.names_topic(c[0]) for c in cases) / len(cases), 1),
                rows=rows)


def table(rows: dict) -> str:
    lines = ["| variant | plan % | act % | reflect % |", "|---|---|---|---|"]
    cell = lambda r, k: str(r[k]) if k in r else "-"  # noqa: E731  (diagonal evaluation leaves cells out)
    return "\n".join(lines + [f"| {v} | {cell(r, 'plan')} | {cell(r, 'act')} | {cell(r, 'reflect')} |"
                               for v, r in rows.items()])


def write_readme(save_dir: Path, result: dict) -> None:
    """The adapters' README (replaces the generic model card that ``save_pretrained`` writes there)."""
    tr, ev = result["train"], result["eval"]
    steps = ", ".join(f"{r} {tr[r]['steps']} steps / lr {tr[r]['lr']} / {tr[r]['seconds']} s / loss "
                      f"{tr[r]['loss_first25']} -> {tr[r]['loss_last25']}" for r in react.ROLES)
    retrained = "".join(
        f" The {r} adapter was trained again (`--roles {r}`): its first run (lr {v['lr']}, {v['steps']} steps) had "
        f"loss {v['loss_first25']} -> {v['loss_last25']} (per 25 steps: {v['loss_curve_per25']})."
        for r, v in result.get("retrained", {}).items())
    adapters_dir = (f"react.role_adapters_dir({result['model_key']!r}"
                    + (", ('k_proj', 'v_proj'))" if "k_proj" in result["lora"]["target_modules"] else ")"))
    made_by = f"`{result['command']}`"
    if result.get("previous_command"):
        made_by = f"`{result['previous_command']}`, then {made_by}"
    targets = result["lora"]["target_modules"]
    where = ("**`v_proj` only**, the PReCache setting: K stays adapter-free, V = V_base + 2·(X·A)·B"
             if targets == ["v_proj"] else f"on **{' and '.join(f'`{t}`' for t in targets)}** (the PReCache "
             "variant with key adapters: their key terms are re-rotated by the cache)")
    loader = ("hf_kvreuse.models.load_smollm2()[0]" if result["model_key"] == "smollm2"
              else f"hf_kvreuse.models.load_by_key({result['model_key']!r})[0]")
    plan_valid = ev["rows"]["plan"].get("plan_valid", "-")
    text = f"""# ReAct role adapters for {result['model']}

Three LoRA adapters, `plan/`, `act/`, `reflect/` (rank 8, alpha 16, {where}), for the plain-text ReAct scratchpad of
`hf_kvreuse/workflows/react.py`: plan writes `Thought: ...` + `Action: Retrieve[<article title>]` after the question,
act writes the answer after `Action: Finish[`, reflect writes `Reflect[right]` / `Reflect[wrong]` after the Finish line.

Load: `pm = hf_kvreuse.workflows.react.load_role_adapters({loader}, {adapters_dir})`,
then `pm.set_adapter("act")`.

**Made by** {made_by} (`scripts/train_role_adapters.py`, seed {result['seed']},
{result['torch_threads']} torch threads, CPU, base weights {result['dtype']}, LoRA float32) in {result['train_seconds_total']} s of training in all
(1-min load average at start: {result['load_avg_1min_start']:.1f}; timings are only comparable on an idle machine).

**Data**: SQuAD v1.1 dev items of `hf_kvreuse.workflows.datasets.squad()` (offline). {result['n_train_items']} items
of the articles not in `react.EVAL_TITLES` for training; the held-out articles are {', '.join(react.EVAL_TITLES)}.
One episode per step (batch 1), observation = the gold passage among 0-2 other passages of the same article
(1: 70 %, 2: 30 %); reflect alternates the gold answer and another question's answer from the same article.
Loss on the role's target tokens only, AdamW (no weight decay), learning rate decaying linearly to 10 %.

**Training**: {steps}.{retrained}

**Held-out evaluation** ({ev['n_items']} items, observation = {ev['n_passages']} passages, greedy decoding; rows
are the model variant, columns the skill checks of `react.check_plan/check_act/check_reflect`):

{table(ev['rows'])}

Plan can name an unseen article only when the question names it: that holds for
{ev['plan_ceiling_named_topic']} % of these questions, so plan's skill is capped near that figure (its
`Retrieve[...]` format is right on {plan_valid} %). Full figures and sample outputs:
`{result['out']}`.
"""
    (save_dir / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs=3, default=[100, 180, 220], metavar=("PLAN", "ACT", "REFLECT"))
    ap.add_argument("--lr", type=float, nargs=3, default=[2e-3, 3e-3, 2e-3], metavar=("PLAN", "ACT", "REFLECT"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip-grad", type=float, default=0.0, help="clip the gradient norm (0: off, as for SmolLM2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (use 1 when another job shares the CPU: "
                    "oversubscribed OpenMP threads run 3-10x slower)")
    ap.add_argument("--eval-items", type=int, default=30)
    ap.add_argument("--eval-passages", type=int, default=2)
    ap.add_argument("--model", choices=MODEL_KEYS, default="smollm2")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="base weights' dtype (default: fp32 for SmolLM2, bf16 for Qwen)")
    ap.add_argument("--targets", nargs="+", default=["v_proj"], choices=["k_proj", "v_proj"],
                    help="LoRA target modules (v_proj: PReCache's setting)")
    ap.add_argument("--eval-diagonal", action="store_true",
                    help="evaluate each adapter on its own skill only (the base model on all three)")
    ap.add_argument("--save-dir", type=Path, default=None, help="default: react.role_adapters_dir(model, targets)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/role_adapters[_<model>][_kv].json")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the adapters in --save-dir, no training")
    ap.add_argument("--roles", nargs="+", choices=react.ROLES, default=list(react.ROLES),
                    help="train only these roles; the others are loaded from --save-dir (their record from --out)")
    args = ap.parse_args()
    if args.save_dir is None:
        args.save_dir = react.role_adapters_dir(args.model, args.targets)
    if args.out is None:
        tag = ("" if args.model == "smollm2" else "_" + args.model) + ("_kv" if "k_proj" in args.targets else "")
        args.out = ROOT / "benchmarks" / "results" / f"role_adapters{tag}.json"

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = load_by_key(args.model, args.dtype)
    items = squad()
    train, heldout = react.split_items(items)
    result: dict = dict(command=" ".join(["python"] + sys.argv), model_key=args.model,
                        model=MODEL_NAMES[args.model],
                        dtype=str(model.dtype).replace("torch.", ""), seed=args.seed,
                        save_dir=str(args.save_dir.relative_to(ROOT)) if args.save_dir.is_relative_to(ROOT)
                        else str(args.save_dir),
                        out=str(args.out.relative_to(ROOT)) if args.out.is_relative_to(ROOT) else str(args.out),
                        lora=dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=sorted(args.targets)),
                        n_train_items=len(train), eval_titles=list(react.EVAL_TITLES),
                        torch_threads=torch.get_num_threads(),
                        # Timings are only comparable on an otherwise idle machine; record the load to tell.
                        load_avg_1min_start=os.getloadavg()[0])
    if args.eval_only:
        pm = react.load_role_adapters(model, args.save_dir)
    else:
        from peft import get_peft_model

        if set(args.roles) != set(react.ROLES):
            # retrain some roles: the others are loaded from --save-dir, their training record from --out
            pm = react.load_role_adapters(model, args.save_dir)
            previous = json.loads(args.out.read_text())
            result["train"] = {r: previous["train"][r] for r in react.ROLES if r not in args.roles}
            result["retrained"] = {r: previous["train"][r] for r in args.roles}  # the replaced runs, kept
            result["previous_command"] = previous["command"]
            for role in args.roles:
                pm.delete_adapter(role)
                pm.add_adapter(role, react.role_lora_config(args.targets))
        else:
            pm = get_peft_model(model, react.role_lora_config(args.targets), adapter_name=react.ROLES[0])
            for role in react.ROLES[1:]:
                pm.add_adapter(role, react.role_lora_config(args.targets))
            result["train"] = {}
        t0 = time.perf_counter()
        for role, steps, lr in zip(react.ROLES, args.steps, args.lr):
            if role not in args.roles:
                continue
            print(f"training {role}: {steps} steps, lr {lr}", flush=True)
            result["train"][role] = train_role(pm, tok, role, train, items, steps, lr, args.seed, args.clip_grad)
        result["train"] = {r: result["train"][r] for r in react.ROLES}
        result["train_seconds_total"] = round(sum(result["train"][r]["seconds"] for r in react.ROLES), 1)
        print(f"total training time {result['train_seconds_total']} s", flush=True)
        pm.save_pretrained(args.save_dir)
        for role in react.ROLES:  # the sha256 that load_role_adapters verifies
            record_files(Path(args.save_dir) / role)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # the training record, before the long eval
        print(f"saved to {args.save_dir}")
    t0 = time.perf_counter()
    result["eval"] = evaluate(pm, tok, items, heldout, args.eval_items, args.eval_passages, args.seed,
                              args.eval_diagonal)
    result["eval_seconds"] = round(time.perf_counter() - t0, 1)
    result["load_avg_1min_end"] = os.getloadavg()[0]

    rows = result["eval"]["rows"]
    print(f"\nheld-out skill accuracy, {result['eval']['n_items']} items, greedy "
          f"(plan ceiling: {result['eval']['plan_ceiling_named_topic']}% of questions name the article)")
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not args.eval_only:
        write_readme(args.save_dir, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
