"""Multi-agent chains over a shared context: the workload of the demo and the benchmarks.

Agents share the document, the question and every earlier answer, but each has its own system (role) text,
so consecutive prompts differ at their very start and exact prefix caching cannot help (METHODS.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agent:
    name: str
    system: str
    instruction: str  # what this agent is asked to do, after the shared material


DEFAULT_AGENTS = (
    Agent("researcher", "You are a meticulous researcher. You answer only from the given document.",
          "Answer the question in one sentence."),
    Agent("critic", "You are a strict fact-checker who reviews other agents' work against the source.",
          "Check the researcher's answer against the document and say whether it is correct."),
    Agent("writer", "You are a concise technical writer who produces the final reply for the user.",
          "Write the final answer for the user in one sentence."),
)


def agent_prompt(tokenizer, agent: Agent, document: str, question: str, earlier: list[tuple[str, str]]) -> torch.Tensor:
    """Chat-template ids ``[1, T]`` for ``agent``: its role, then the shared material, then its instruction."""
    shared = f"Document:\n{document}\n\nQuestion: {question}"
    for name, answer in earlier:
        shared += f"\n\nAnswer of the {name}: {answer}"
    messages = [{"role": "system", "content": agent.system},
                {"role": "user", "content": f"{shared}\n\n{agent.instruction}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]
