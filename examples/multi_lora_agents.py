"""Three LoRA agents (plan / act / reflect) on one SmolLM2-135M share one cache (PReCache's PreLRShared).

One ReAct episode over a ~1k-token observation, run with every agent keeping its own cache (``nonshared``)
and with one shared base cache plus per-agent low-rank caches (``prelrshared``, ``rebaseshared``). It prints
what each agent wrote and each turn's time to first token.

    .venv/bin/python examples/multi_lora_agents.py
"""

from __future__ import annotations

import torch

from hf_kvreuse import BaseLRCache
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.workflows import react
from hf_kvreuse.workflows.datasets import passages_for, squad


def main() -> None:
    torch.manual_seed(0)
    model, tok = load_smollm2()
    pm = react.load_role_adapters(model)  # the adapters shipped in hf_kvreuse/adapters/smollm2_roles
    items = squad()
    item = react.split_items(items)[1][3]  # a held-out article
    passages = passages_for(items, item, tok, 1024)
    act = react.act_example(item, passages)
    print(f"Question: {item.question}   (gold: {item.answers[0]!r})\n")
    for method in ("nonshared", "prelrshared", "rebaseshared"):
        cache = BaseLRCache(pm, method=method)
        line = []

        def turn(agent: str, prompt: str, max_new: int) -> str:
            text, ttft = react.agent_turn(pm, tok, cache, agent, prompt, max_new)
            line.append(f"{agent}: prefilled {cache.stats.last.prefill_tokens:4d} tok, TTFT {ttft * 1000:6.0f} ms")
            return text

        plan = turn("plan", react.plan_example(item).prompt, react.MAX_NEW_TOKENS["plan"])
        turn("plan", act.prompt[: act.prompt.rindex(react.ACT_THOUGHT)], 8)  # plan reads the observation
        answer = react.parse_finish(turn("act", act.prompt, react.MAX_NEW_TOKENS["act"]))
        verdict = turn("reflect", react.reflect_example(item, passages, answer).prompt, react.MAX_NEW_TOKENS["reflect"])
        print(f"== {method}: plan {plan.strip()!r} | act Finish[{answer}] | reflect {verdict.strip()!r}")
        print("   " + "\n   ".join(line))
        print(f"   K/V held: {cache.kv_bytes() / 2**20:.1f} MiB\n")


if __name__ == "__main__":
    main()
