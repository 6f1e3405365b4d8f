"""Multi-agent chains over a shared context: the workload of the demo and the benchmarks.

Agents share the document, the question and every earlier answer, but each has its own system (role) text,
so consecutive prompts differ at their very start and exact prefix caching cannot help (METHODS.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Agent:
    """One agent of a workflow: its name, role (system) text and instruction; optionally its own LoRA adapter
    (the name of an adapter of the session's peft model, made active for its calls) or its own model (same
    tokenizer; its calls go through a session of that model)."""

    name: str
    system: str
    instruction: str  # what this agent is asked to do, after the shared material
    guidelines: str = ""  # longer role text, used when a workload asks for more agent-specific tokens
    adapter: str | None = None
    model: Any = field(default=None, compare=False, repr=False)


DEFAULT_AGENTS = (
    Agent("researcher", "You are a meticulous researcher. You answer only from the given document.",
          "Answer the question in one sentence.",
          "Read every paragraph before you answer. Quote names, dates and numbers exactly as they are written. "
          "Prefer the shortest span of the document that answers the question, and never add facts that the "
          "document does not state. When two passages disagree, trust the one that is more specific. If the "
          "document does not contain the answer, say so plainly instead of guessing. Keep a neutral tone, avoid "
          "opinions, and do not explain your reasoning unless you are asked to. Your answer will be checked by "
          "a fact-checker and rewritten by a technical writer, so be precise rather than elegant."),
    Agent("critic", "You are a strict fact-checker who reviews other agents' work against the source.",
          "Check the researcher's answer against the document and say whether it is correct.",
          "Compare each claim of the answer with the document, one claim at a time. A claim is correct only "
          "if the document states it; a claim that is plausible but absent is unsupported. Pay special "
          "attention to numbers, dates, names of people and places, and to negations. If the answer is "
          "correct, say so in one short sentence. If it is wrong or incomplete, give the correct answer and "
          "the sentence of the document that supports it. Do not rewrite the answer for style, and do not "
          "discuss anything outside the question."),
    Agent("writer", "You are a concise technical writer who produces the final reply for the user.",
          "Write the final answer for the user in one sentence.",
          "Use the researcher's answer and the fact-checker's review; when they disagree, follow the "
          "fact-checker. Write for a busy reader: one clear sentence, plain words, no hedging, no lists, no "
          "greetings and no references to the other agents. Keep every name, date and number exactly as the "
          "document gives it. If the question cannot be answered from the document, say that the document "
          "does not say, in one sentence. Never invent details to make the reply sound complete."),
)


def role_text(agent: Agent, tokenizer, n_tokens: int | None = None) -> str:
    """The agent's system text, extended with its guidelines to about ``n_tokens`` tokens (cut at a word)."""
    if n_tokens is None:
        return agent.system
    words = f"{agent.system} {agent.guidelines}".split()
    text = ""
    for w in words:
        longer = f"{text} {w}".strip()
        if len(tokenizer(longer, add_special_tokens=False)["input_ids"]) > n_tokens:
            break
        text = longer
    return text


def agent_prompt(tokenizer, agent: Agent, document: str, question: str, earlier: list[tuple[str, str]],
                 role_tokens: int | None = None) -> torch.Tensor:
    """Chat-template ids ``[1, T]`` for ``agent``: its role, then the shared material, then its instruction.

    ``role_tokens`` sets the length of the agent-specific role text (see :func:`role_text`).
    """
    shared = f"Document:\n{document}\n\nQuestion: {question}"
    for name, answer in earlier:
        shared += f"\n\nAnswer of the {name}: {answer}"
    messages = [{"role": "system", "content": role_text(agent, tokenizer, role_tokens)},
                {"role": "user", "content": f"{shared}\n\n{agent.instruction}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]
