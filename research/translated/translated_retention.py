"""Retention of TranslatedCache configurations on held-out SQuAD questions, sharing the expensive parts (issue 24).

``prepare``: once per item (SQuAD items ``offset .. offset+n``, the chat QA prompt of benchmarks/translated.py):
the target's full prefill and greedy answer, its K/V (the oracle's truth), the source's prefill (its K/V and
normalised hidden states, the inputs of every map kind) and the source's own greedy answer, kept on disk
(``--work``, safetensors + one JSON). ``run``: every configuration (map, recompute ratio, scorer, exact leading
layers) answers every prepared item from the shared source prefill (``source_cache=`` / ``source_hidden=``:
the K/V are those of a fresh source prefill; only time differs, which benchmarks/translated.py measures);
one JSON per command under benchmarks/results/, checkpointed per item; retention = accuracy / the full
prefill's, paired bootstrap 95% interval; paired differences against the first configuration (Newcombe).

    python research/translated/translated_retention.py prepare --n 100
    python research/translated/translated_retention.py run --n 100 --config shipped:0.3:first-layer --config best:0.3:first-layer \\
        --map shipped=/tmp/tr24/maps/shipped --map best=... --out benchmarks/results/translated_retention_x.json
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _answer(tok, out, n_prompt: int) -> str:
    return tok.decode(out[0, n_prompt:], skip_special_tokens=True).strip().split("\n")[0]


def _git() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()


@torch.no_grad()
def prepare(a) -> None:
    from hf_kvreuse.compat import cache_kwargs
    from hf_kvreuse.kv import kv_of
    from hf_kvreuse.models import load_qwen
    from hf_kvreuse.translation.mapper import run_source
    from hf_kvreuse.workflows.datasets import contains_answer

    torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    src, tok = load_qwen("0.5b", dtype=dtype)
    tgt, _ = load_qwen("1.5b", dtype=dtype)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    refs_path = work / "refs.json"
    refs = json.loads(refs_path.read_text()) if refs_path.exists() else {"dtype": a.dtype, "dataset": a.dataset,
                                                                         "items": {}}
    if refs["dtype"] != a.dtype or refs.get("dataset", "squad") != a.dataset:
        raise SystemExit(f"{work} holds {refs.get('dataset', 'squad')} {refs['dtype']} references, not "
                         f"{a.dataset} {a.dtype}")
    items = dataset_items(a.dataset, tok)
    t0 = time.perf_counter()
    for i in range(a.offset, a.offset + a.n):
        if str(i) in refs["items"]:
            continue
        it = items[i]
        ids_list, suffix = prompt_ids(a.dataset, tok, it.passage, it.question)
        ids = torch.tensor([ids_list])
        n = ids.shape[1] - 1
        tc = DynamicCache(config=tgt.config)
        qs = {}  # the target's queries before RoPE (attention-output cosine of the diagnosis)
        hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a_, out, i=i: qs.__setitem__(i, out[0].half()))
                 for i, layer in enumerate(tgt.model.layers)]
        th = {}  # the target's normalised inputs of layers 0..4 (maps conditioned on an exact target prefix)
        hooks += [tgt.model.layers[i].input_layernorm.register_forward_hook(
            lambda m, a_, out, i=i: th.__setitem__(i, out[0].half())) for i in range(5)]
        try:
            tgt(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **cache_kwargs(tc))
        finally:
            for h in hooks:
                h.remove()
        true_kv = [(k.clone(), v.clone()) for k, v in kv_of(tc)]
        full = _answer(tok, tgt.generate(ids, **cache_kwargs(tc), max_new_tokens=a.max_new_tokens, do_sample=False), ids.shape[1])
        sc = DynamicCache(config=src.config)
        hidden = run_source(src, ids[:, :n], sc, range(src.config.num_hidden_layers + 1))
        src_kv = [(k.clone(), v.clone()) for k, v in kv_of(sc)]
        source = _answer(tok, src.generate(ids, **cache_kwargs(sc), max_new_tokens=a.max_new_tokens, do_sample=False), ids.shape[1])
        tensors = {"ids": ids[0], "tgt_k": torch.stack([k[0] for k, _ in true_kv]),
                   "tgt_v": torch.stack([v[0] for _, v in true_kv]), "src_k": torch.stack([k[0] for k, _ in src_kv]),
                   "src_v": torch.stack([v[0] for _, v in src_kv]),
                   "src_h": torch.stack([hidden[s] for s in sorted(hidden)]).half(),
                   "tgt_q": torch.stack([qs[j] for j in range(len(qs))]),
                   "tgt_h": torch.stack([th[j] for j in range(5)])}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(work / f"i{i}.safetensors"))
        refs["items"][str(i)] = {"tokens": ids.shape[1], "suffix": suffix, "gold": list(it.answers), "full": full,
                                 "full_ok": contains_answer(full, it.answers), "source": source,
                                 "source_ok": contains_answer(source, it.answers)}
        refs_path.write_text(json.dumps(refs, indent=1))
        print(f"item {i}: {ids.shape[1]} tok, full {full!r} ({refs['items'][str(i)]['full_ok']}), source {source!r} "
              f"({refs['items'][str(i)]['source_ok']}), {time.perf_counter() - t0:.0f} s", flush=True)


DATASETS = ("squad", "coqa", "drop", "squad-qfirst")


def dataset_items(name: str, tok=None) -> list:
    """The evaluation items of ``name``: SQuAD (and its question-first layout), CoQA first turns (story + first
    question), DROP without the passages the default map calibrates on (the first 64 distinct ones)."""
    from hf_kvreuse.workflows.datasets import coqa_first_turns, drop, squad

    if name in ("squad", "squad-qfirst"):
        return squad()
    if name == "coqa":
        return coqa_first_turns()
    if name == "drop":
        items, calib = drop(), set()
        for it in items:
            if len(calib) == 64:
                break
            calib.add(it.passage)
        return [it for it in items if it.passage not in calib]
    raise SystemExit(f"--dataset {name!r}: choose one of {DATASETS}")


def prompt_ids(name: str, tok, passage: str, question: str) -> tuple[list[int], int]:
    """Token ids and the marked suffix length. Passage-then-question layouts: the question and the template's
    closing tokens (``qa_chat_ids``). ``squad-qfirst``: the question before the passage; the suffix is only the
    template's closing tokens (no question is marked: the question-words scorer has nothing to read)."""
    from hf_kvreuse.workflows.datasets import QA_INSTRUCTION, qa_chat_ids

    if name != "squad-qfirst":
        return qa_chat_ids(tok, passage, question)
    content = f"{QA_INSTRUCTION}\n\nQuestion: {question}\n\nPassage: {passage}"
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    last = max(i for i, t in enumerate(ids) if t == end)
    return ids, len(ids) - last


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.float().argsort().argsort().float(), b.float().argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def parse_config(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (3, 4, 5) or (len(parts) == 5 and parts[4] != "nofuse"):
        raise SystemExit(f"--config {text!r}: MAP:RATIO:SCORER[:PREFIX_LAYERS[:nofuse]]")
    return {"key": text, "map": parts[0], "ratio": float(parts[1]), "scorer": parts[2],
            "prefix": int(parts[3]) if len(parts) >= 4 else 0, "fuse": len(parts) < 5}


def scorer_of(name: str, tok=None, gold=()):
    """A selector name, or ``first-layer@C``: CacheBlend's deviation checked at target layer ``C`` (layers ``0..C``
    run for every row and stay exact; plain ``first-layer`` checks layer 1); ``question-attention@S`` /
    ``question-words@S``: the question-aware scorers with share ``S`` of the free budget (default: the class's,
    0.5 for attention, 1.0 for words; ``question-words@SrR``: reach ``R`` tokens on either side of a mention);
    ``question-attention-plain@S``: without the contrast; ``answer-span@S`` (a diagnosis, not a method: it reads the
    gold answers): the context rows that mention a word of a gold answer, 4 tokens before and 8 after each."""
    if name.startswith(("question-attention", "question-words", "answer-span")):
        from hf_kvreuse.translation.question import QuestionAttentionScorer, QuestionWordScorer

        kind, _, share = name.partition("@")
        share, _, reach = share.partition("r")  # question-words@1.0r16: before = after = 16 tokens
        kw = {"share": float(share)} if share else {}  # default: the class's own
        if reach:
            kw.update(before=int(reach), after=int(reach))
        if kind.startswith("question-attention"):
            return QuestionAttentionScorer(contrast=kind != "question-attention-plain", **kw)
        if kind == "question-words":
            return QuestionWordScorer(tok, **kw)
        return AnswerSpan(tok, gold, share=float(share) if share else 1.0)
    if name.startswith("source-attention"):  # source-attention[@S][/L0,L1,..][w W][p P][~BASE]
        import re

        from hf_kvreuse.translation.scorers import RandomScorer
        from hf_kvreuse.translation.source_attention import SourceAttentionScorer

        m = re.fullmatch(r"source-attention(?:@([\d.]+))?(?:/([\d,]+))?(?:w(\d+))?(?:p(\d+))?(?:~(random))?", name)
        if m is None:
            raise SystemExit(f"scorer {name!r}: source-attention[@SHARE][/L0,L1,..][wWINDOW][pPOOL][~random]")
        kw = {}
        if m.group(5):  # ~random: a base that runs no target layer (the default base, first-layer deviation, runs
            kw["base"] = RandomScorer(0)  # two); with share 1.0 the base only orders what attention leaves tied
        if m.group(1):
            kw["share"] = float(m.group(1))
        if m.group(2):
            kw["layers"] = [int(x) for x in m.group(2).split(",")]
        if m.group(3):
            kw["window"] = int(m.group(3))
        if m.group(4):
            kw["pool"] = int(m.group(4))
        return SourceAttentionScorer(**kw)
    if name.startswith("first-layer@"):
        from hf_kvreuse.translation.scorers import FirstLayerDeviationScorer

        return FirstLayerDeviationScorer(check_layer=int(name.split("@", 1)[1]))
    return name


def _answer_span_class():
    from hf_kvreuse.translation.question import QuestionWordScorer

    class AnswerSpan(QuestionWordScorer):
        """The answer-span oracle: QuestionWordScorer's selection with the gold answers' words as the question's."""

        name = "answer-span"

        def __init__(self, tok, gold, share):
            super().__init__(tok, share=share, min_chars=1)
            self.gold = " ".join(gold)

        def priority(self, cache, kv, n, forced):
            from hf_kvreuse.focus import _WORD, mention_rows, token_texts

            ids = cache.input_ids[0].tolist()
            texts = token_texts(self.tokenizer, ids)[: max(0, n - cache.suffix_tokens)]
            wanted = {w.lower() for w in _WORD.findall(self.gold)}
            order = mention_rows(texts, wanted, budget=len(texts), window=self.after, before=self.before, ordered=True)
            pri = torch.zeros(n)
            if order.numel():
                pri[order] = torch.linspace(1.0, 0.5, order.numel())
            return pri

    return AnswerSpan


def AnswerSpan(tok, gold, share):  # noqa: N802 - builds the class on first use (imports the library lazily)
    return _answer_span_class()(tok, gold, share)


@torch.no_grad()
def run(a, argv) -> None:
    from translated import bootstrap_ratio

    from hf_kvreuse import OracleScorer, TranslatedCache, enable
    from hf_kvreuse.cli import paired_difference, wilson
    from hf_kvreuse.kv import kv_of, load_kv
    from hf_kvreuse.models import load_qwen
    from hf_kvreuse.timing import TokenTimer
    from hf_kvreuse.translation.mapper import KVMapper
    from hf_kvreuse.workflows.datasets import contains_answer

    torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    work = Path(a.work)
    refs = json.loads((work / "refs.json").read_text())
    if refs["dtype"] != a.dtype:
        raise SystemExit(f"{work} holds {refs['dtype']} references, not {a.dtype}")
    src, tok = load_qwen("0.5b", dtype=dtype)
    tgt, _ = load_qwen("1.5b", dtype=dtype)
    enable(tgt)
    maps = {}
    for spec in a.map:
        name, path = spec.split("=", 1)
        maps[name] = KVMapper.load(path, src, tgt)
    configs = [parse_config(c) for c in a.config]
    for c in configs:
        if c["map"] not in maps:
            raise SystemExit(f"config {c['key']}: no --map {c['map']}=PATH")
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.exists() else {"items": {}}
    res.update({"command": "python research/translated/translated_retention.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "git_commit": _git(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), "dtype": a.dtype,
                "maps": {k: {"repr": repr(m), "info": m.info} for k, m in maps.items()}, "configs": configs})
    if a.timing and str(a.offset) in refs["items"]:  # warm-up: the first timed calls would pay one-off costs
        d = load_file(str(work / f"i{a.offset}.safetensors"))
        ids = d["ids"][None]
        tgt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        c = configs[0]
        TranslatedCache(tgt, src, maps[c["map"]], ids, recompute_ratio=c["ratio"], prefix_layers=c["prefix"],
                        selector=scorer_of(c["scorer"], tok, refs["items"][str(a.offset)]["gold"])
                        if c["scorer"] != "oracle" else "random")
        tgt.generate(ids, cache=TranslatedCache(tgt, src, maps[c["map"]], ids, recompute_ratio=c["ratio"]),
                     max_new_tokens=1, do_sample=False)
    t0 = time.perf_counter()
    done = 0
    for i in range(a.offset, a.offset + a.n):
        ref = refs["items"].get(str(i))
        if ref is None:
            print(f"item {i} not prepared: stopping", flush=True)
            break
        rec = res["items"].setdefault(str(i), {"runs": {}})
        todo = [c for c in configs if c["key"] not in rec["runs"]]
        if not todo:
            continue
        d = load_file(str(work / f"i{i}.safetensors"))
        ids = d["ids"][None]
        n = ids.shape[1] - 1
        true_kv = [(d["tgt_k"][t][None].to(dtype), d["tgt_v"][t][None].to(dtype)) for t in range(d["tgt_k"].shape[0])]
        src_kv = [(d["src_k"][s][None].to(dtype), d["src_v"][s][None].to(dtype)) for s in range(d["src_k"].shape[0])]
        hidden = {s: d["src_h"][s].float() for s in range(d["src_h"].shape[0])}
        if a.timing and "t_full_ttft" not in rec:  # the target's first token from a full prefill; the source prefill
            from hf_kvreuse.translation.mapper import run_source
            from hf_kvreuse.timing import TokenTimer

            timer = TokenTimer().start()
            tgt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, streamer=timer)
            t2 = time.perf_counter()
            # (hidden states captured, as the cache's own source prefill does)
            run_source(src, ids[:, :n], DynamicCache(config=src.config), range(src.config.num_hidden_layers + 1))
            rec["t_full_ttft"], rec["t_src"] = timer.ttft_s, time.perf_counter() - t2
        oracle_err = {}
        for c in todo:
            mapper = maps[c["map"]]
            sc = load_kv(DynamicCache(config=src.config), [(k.clone(), v.clone()) for k, v in src_kv])
            sel = OracleScorer(true_kv) if c["scorer"] == "oracle" else scorer_of(c["scorer"], tok, ref["gold"])
            timer = TokenTimer().start() if a.timing else None  # the cache's construction (its checks) counts
            t1 = time.perf_counter()
            cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=c["ratio"], selector=sel,
                                    suffix_tokens=ref["suffix"], source_cache=sc, source_hidden=hidden,
                                    prefix_layers=c["prefix"], fuse_first_step=c.get("fuse", True))
            gen = tgt.generate(ids, cache=cache, max_new_tokens=a.max_new_tokens, do_sample=False, streamer=timer)
            ans = _answer(tok, gen, ids.shape[1])
            run_rec = {"answer": ans, "ok": contains_answer(ans, ref["gold"]), "agree": ans == ref["full"],
                       "recomputed": cache.stats.recomputed_tokens, "exact_layers": cache.stats.exact_layers,
                       "s": time.perf_counter() - t1, "assemble_s": cache.stats.assemble_s,
                       "selector": cache.stats.selector, "selector_note": cache.stats.selector_note,
                       "fused_first_step": cache.stats.fused_first_step}
            if timer is not None:  # the first token the caller receives (the source prefill was given: added later)
                run_rec["ttft_s"] = timer.ttft_s
            # the assembled cache against the target's own K/V: recomputed rows (they read mapped K/V of the
            # others) and mapped rows, per layer (sinks, rows 0-3, left out: outliers, always recomputed)
            if hasattr(cache.scorer, "chosen"):  # question-first scorers: how many rows their own rule chose
                run_rec["chosen"] = int(cache.scorer.chosen.numel())
                run_rec["fallback"] = run_rec["chosen"] == 0
            rec_rows = torch.zeros(n, dtype=torch.bool)
            rec_rows[cache.selected_rows] = True
            rec_rows[:4] = False
            rest = ~rec_rows
            rest[:4] = False
            errs = []
            for (k, v), (tk, tv) in zip(kv_of(cache), true_kv):
                row = []
                for part in (rec_rows, rest):
                    for a_, b_ in ((k, tk), (v, tv)):
                        if part.any():
                            x_, y_ = a_[0, :, :n][:, part].float(), b_[0][:, part].float()
                            row.append(float(((x_ - y_) ** 2).sum() / (y_ * y_).sum()))
                        else:
                            row.append(None)
                errs.append(row)
            run_rec["rel_err"] = errs  # per layer: [recomputed K, recomputed V, mapped K, mapped V]
            scores = getattr(cache, "last_scores", None)
            if scores is not None and c["scorer"] != "oracle":
                if c["map"] not in oracle_err:  # the true error of this map's translation on this item
                    o = OracleScorer(true_kv)
                    o.reset(n, ids.device)
                    o_kv = mapper.translate(src_kv, torch.arange(n), cache._src_shifter, cache._shifter, dtype,
                                            hidden=hidden)
                    oracle_err[c["map"]] = o.scores(None, o_kv)
                err = oracle_err[c["map"]]
                k30 = max(1, int(0.3 * n))
                run_rec["spearman"] = spearman(scores.cpu(), err)
                run_rec["top30_overlap"] = len(set(torch.topk(err, k30).indices.tolist()) &
                                               set(torch.topk(scores.float().cpu(), k30).indices.tolist())) / k30
            rec["runs"][c["key"]] = run_rec
        done += 1
        out.write_text(json.dumps(res, indent=1))
        print(f"item {i} ({(time.perf_counter() - t0) / done:.0f} s/item): full {int(ref['full_ok'])} src "
              f"{int(ref['source_ok'])} " + " ".join(f"{k}:{int(v['ok'])}{'=' if v['agree'] else '!'}"
                                                    for k, v in rec["runs"].items()), flush=True)
    summarize_into(res, refs, configs, out)


def summarize_into(res: dict, refs: dict, configs: list[dict], out: Path) -> None:
    """Summary over the items every configuration answered (paired: the same items for all)."""
    from translated import bootstrap_ratio

    from hf_kvreuse.cli import paired_difference, wilson

    keys = [c["key"] for c in configs]
    items = [i for i, r in res["items"].items() if all(k in r["runs"] for k in keys)]
    N = len(items)
    if not N:
        return
    full = [int(refs["items"][i]["full_ok"]) for i in items]
    srcok = [int(refs["items"][i]["source_ok"]) for i in items]
    summ = {"dataset": refs.get("dataset", "squad"), "n": N, "items": items, "full_accuracy": sum(full) / N,
            "full_ci": wilson(sum(full), N),
            "source_alone": {"accuracy": sum(srcok) / N, "retention": sum(srcok) / max(1, sum(full)),
                             "retention_ci": bootstrap_ratio(srcok, full),
                             "agreement": sum(refs["items"][i]["source"] == refs["items"][i]["full"] for i in items) / N},
            "rows": []}
    first = [int(res["items"][i]["runs"][keys[0]]["ok"]) for i in items]
    for c in configs:
        ok = [int(res["items"][i]["runs"][c["key"]]["ok"]) for i in items]
        agree = sum(res["items"][i]["runs"][c["key"]]["agree"] for i in items)
        row = dict(c, accuracy=sum(ok) / N, accuracy_ci=wilson(sum(ok), N), retention=sum(ok) / max(1, sum(full)),
                   retention_ci=bootstrap_ratio(ok, full), agreement=agree / N, agreement_ci=wilson(agree, N),
                   vs_source_alone=paired_difference(ok, srcok), vs_first=paired_difference(ok, first),
                   recomputed_share=sum(res["items"][i]["runs"][c["key"]]["recomputed"] /
                                        (refs["items"][i]["tokens"] - 1) for i in items) / N)
        if all("t_full_ttft" in res["items"][i] and "ttft_s" in res["items"][i]["runs"][c["key"]] for i in items):
            # the first token: source prefill + the cache's first token vs plain generate's first token
            full_s = sum(res["items"][i]["t_full_ttft"] for i in items)
            ours = sum(res["items"][i]["t_src"] + res["items"][i]["runs"][c["key"]]["ttft_s"] for i in items)
            row["speedup"] = full_s / ours
            row["speedup_measure"] = "first token"
        elif all("t_full" in res["items"][i] for i in items):  # older runs: source prefill + assembly vs prefill
            full_s = sum(res["items"][i]["t_full"] for i in items)
            ours = sum(res["items"][i]["t_src"] + res["items"][i]["runs"][c["key"]]["assemble_s"] for i in items)
            row["speedup"] = full_s / ours
            row["speedup_measure"] = "prefill of the covered rows vs source prefill + assembly"
        fb = [res["items"][i]["runs"][c["key"]].get("fallback") for i in items]
        if all(x is not None for x in fb):
            row["fallback_rate"] = sum(fb) / N
        row["scorer_name"] = c["scorer"]
        sp = [res["items"][i]["runs"][c["key"]].get("spearman") for i in items]
        if all(x is not None for x in sp):
            row["spearman_with_oracle"] = sum(sp) / N
            row["top30_overlap"] = sum(res["items"][i]["runs"][c["key"]]["top30_overlap"] for i in items) / N
        summ["rows"].append(row)
    res["summary"] = summ
    out.write_text(json.dumps(res, indent=1))
    print(f"n={N}: full {summ['full_accuracy']:.2f}, source alone retention {summ['source_alone']['retention']:.2f}")
    for r in summ["rows"]:
        print(f"{r['key']}: acc {r['accuracy']:.2f} retention {r['retention']:.2f} {r['retention_ci']} agree "
              f"{r['agreement']:.2f} vs source {r['vs_source_alone']} vs first {r['vs_first']}", flush=True)


def rescore(a, argv) -> None:
    """Score a finished run again against the dataset's gold answers as the library loads them now (the prepared
    references and every run's ``ok``), then summarise it in place. Used once: DROP's answers were read as empty
    by an earlier ``workflows.datasets.drop`` (every answer scored wrong)."""
    from hf_kvreuse.workflows.datasets import contains_answer

    refs_path = Path(a.work) / "refs.json"
    refs = json.loads(refs_path.read_text())
    items = dataset_items(refs.get("dataset", "squad"))
    for i, r in refs["items"].items():
        gold = list(items[int(i)].answers)
        r.update(gold=gold, full_ok=contains_answer(r["full"], gold), source_ok=contains_answer(r["source"], gold))
    refs_path.write_text(json.dumps(refs, indent=1))
    for f in a.inputs:
        res = json.loads(Path(f).read_text())
        for i, rec in res["items"].items():
            for run in rec["runs"].values():
                run["ok"] = contains_answer(run["answer"], refs["items"][i]["gold"])
        res["rescored"] = {"command": "python research/translated/translated_retention.py " +
                           " ".join(sys.argv[1:] if argv is None else argv), "git_commit": _git(),
                           "date": time.strftime("%Y-%m-%d %H:%M")}
        summarize_into(res, refs, res["configs"], Path(f))


def summarize(a, argv) -> None:
    """Merge the item runs of several ``run`` JSONs (same prepared items) into one JSON with its summary."""
    refs = json.loads((Path(a.work) / "refs.json").read_text())
    res = {"command": "python research/translated/translated_retention.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "git_commit": _git(), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": refs["dtype"], "inputs": a.inputs,
           "maps": {}, "configs": [], "items": {}}
    for f in a.inputs:
        part = json.loads(Path(f).read_text())
        res.setdefault("runs", {})[f] = {k: part.get(k) for k in ("command", "git_commit", "date", "args")}
        res["maps"].update(part.get("maps", {}))
        for c in part.get("configs", []):
            if c["key"] not in [x["key"] for x in res["configs"]]:
                res["configs"].append(c)
        for i, r in part["items"].items():
            res["items"].setdefault(i, {"runs": {}})["runs"].update(r["runs"])
    order = a.config or [c["key"] for c in res["configs"]]
    configs = [next(c for c in res["configs"] if c["key"] == k) for k in order]
    res["configs"] = configs
    summarize_into(res, refs, configs, Path(a.out))


def exact_layers(c: dict) -> int:
    """Leading target layers every row runs through under configuration ``c``: its ``prefix_layers``, or more when
    the scorer runs them (``first-layer``: layers 0-1, or one layer past a longer prefix; ``first-layer@C``: layers
    0..C), at ratios strictly in (0, 1)."""
    e = c["prefix"]
    if 0 < c["ratio"] < 1 and c["scorer"].startswith(("first-layer", "question-", "answer-span",
                                                       "source-attention", "auto")) and "~" not in c["scorer"]:
        at_c = c["scorer"].startswith("first-layer@")  # the question scorers' "@" is their share
        e = max(e, (int(c["scorer"].split("@", 1)[1]) if at_c else max(1, e)) + 1)  # the layer after the prefix
    return e


def table(path: str) -> str:
    """README rows of a summarised retention JSON."""
    d = json.loads(Path(path).read_text())
    s = d["summary"]
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    ci = lambda c: f"[{100 * c[0]:.0f}, {100 * c[1]:.0f}]"  # noqa: E731
    pd = lambda t: f"{100 * t[0]:+.0f} [{100 * t[1]:+.0f}, {100 * t[2]:+.0f}]"  # noqa: E731
    lines = [f"n = {s['n']} {s.get('dataset', 'squad')} questions ({d['dtype']}); "
             f"target full prefill {pct(s['full_accuracy'])} "
             f"{ci(s['full_ci'])}; source alone retention {pct(s['source_alone']['retention'])} "
             f"{ci(s['source_alone']['retention_ci'])}", "",
             "| map | ratio | scorer | exact leading layers | recomputed | retention [95% CI] | agreement | vs source alone (pts) "
             f"| accuracy vs {s['rows'][0]['key']} (pts, paired) | Spearman / top-30% with oracle | TTFT speedup "
             "| question-words fallback |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for j, r in enumerate(s["rows"]):
        sp = (f"{r['spearman_with_oracle']:.2f} / {pct(r['top30_overlap'])}" if "spearman_with_oracle" in r else "-")
        first = pd(r["vs_first"]) if j and "vs_first" in r else "-"
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        fallback = pct(r["fallback_rate"]) if "fallback_rate" in r else "-"
        scorer = r["scorer"] + (" (not fused)" if r.get("fuse") is False else "")
        lines.append(f"| {r['map']} | {r['ratio']} | {scorer} | {exact_layers(r)} | {pct(r['recomputed_share'])} | "
                     f"{pct(r['retention'])} {ci(r['retention_ci'])} | {pct(r['agreement'])} | "
                     f"{pd(r['vs_source_alone'])} | {first} | {sp} | {speed} | {fallback} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["prepare", "run", "summarize", "rescore", "table"])
    p.add_argument("--inputs", nargs="*", default=[], help="summarize: run JSONs to merge; table: the JSON")
    p.add_argument("--dataset", choices=DATASETS, default="squad",
                   help="prepare: the items and the prompt layout (stored with the references)")
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="/tmp/tr24/squad")
    p.add_argument("--map", action="append", default=[], help="NAME=PATH of a saved map")
    p.add_argument("--config", action="append", default=[],
                   help="MAP:RATIO:SCORER[:EXACT_LAYERS[:nofuse]] (nofuse: the recompute before generate's first step; scorer: rank, random, oracle, first-layer, first-layer@C (deviation "
                        "at layer C, layers 0..C exact), ...); summarize: "
                        "the row order (default: as found)")
    p.add_argument("--no-timing", dest="timing", action="store_false",
                   help="run: skip timing the full prefill and the source prefill per item (no speedup column)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.command == "prepare":
        prepare(a)
    elif a.command == "run":
        run(a, argv)
    elif a.command == "summarize":
        summarize(a, argv)
    elif a.command == "rescore":
        rescore(a, argv)
    else:
        print(table(a.inputs[0]))


if __name__ == "__main__":
    main()
