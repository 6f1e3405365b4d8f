"""Multi-agent workflow shapes of the literature, every call through one :class:`~hf_kvreuse.ReuseSession`.

Agents answer one question about one document. Each agent's prompt is its own role text (system), then the
shared material: the document, the question, and the answers of the agents it listens to, quoted as KVCOMM's
graphs quote them (METHODS.md §4.1), then the agent's instruction. So consecutive prompts share most of their
tokens but not their prefix: the case exact prefix caching cannot serve.

Shapes (METHODS.md §4.1, §3.17):

* ``chain``: one round; agent ``i`` sees the answers of agents ``0..i-1``.
* ``fully_connected``: ``rounds`` rounds (KVCOMM's FullConnected); agent ``i`` sees this round's answers of the
  agents before it and every agent's answer of the last round.
* ``debate``: ``rounds`` rounds with no edges inside a round; every agent sees every answer of the last round.
* ``judge``: the agents answer independently, then a judge reads the candidates and picks one by number; its
  choice is compared with the full-prefill judge's (judge consistency, the failure mode of §3.17).

The final answer is the last agent's answer of the last round (for ``judge``: the chosen candidate's).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .agents import DEFAULT_AGENTS, Agent, role_text

SHAPES = ("chain", "fully_connected", "debate", "judge")

JUDGE = Agent("judge", "You are an impartial judge who selects the best answer among several candidates.",
              "Which candidate answers the question correctly according to the document? Reply with the number of "
              "that candidate only.",
              "Read the document and every candidate before you decide. Prefer the candidate whose claim the "
              "document states explicitly, with names, dates and numbers exactly as written. Ignore style and "
              "length. If several candidates are correct, choose the most precise one.")


@dataclass
class Turn:
    """One agent call of a workflow run."""

    round: int
    agent: str
    prompt_tokens: int
    answer: str
    wall_s: float
    stats: dict = field(default_factory=dict)   # SessionStats.as_dict() of the call
    prompt_ids: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class WorkflowRun:
    """A whole workflow over one question."""

    shape: str
    method: str
    turns: list[Turn]
    final: str
    judge_choice: int | None = None   # judge shape: the 1-based candidate number the judge gave (None: none)

    @property
    def e2e_s(self) -> float:
        """Sum of the agents' generate wall times."""
        return sum(t.wall_s for t in self.turns)

    def as_dict(self) -> dict:
        d = asdict(self)
        for t in d["turns"]:
            t.pop("prompt_ids")
        d["e2e_s"] = self.e2e_s
        return d


def workflow_prompt(tokenizer, agent: Agent, document: str, question: str,
                    current: Sequence[tuple[str, str]] = (), last_round: Sequence[tuple[str, str]] = (),
                    candidates: Sequence[str] = (), role_tokens: int | None = None) -> torch.Tensor:
    """Chat-template ids ``[1, T]``: the agent's role, the shared material with quoted answers, its instruction.

    ``current`` and ``last_round`` are ``(agent name, answer)`` pairs of this round and of the last one;
    ``candidates`` are numbered answers for a judge.
    """
    user = f"Document:\n{document}\n\nQuestion: {question}"
    if current:
        user += "\n\nAt the same time, other agents gave these answers to the same question:"
        for name, answer in current:
            user += f"\n\nThe {name} answered:\n{answer}"
    if last_round:
        user += "\n\nIn the last round, the agents gave these answers:"
        for name, answer in last_round:
            user += f"\n\nThe {name} answered:\n{answer}"
    for i, answer in enumerate(candidates, 1):
        user += f"\n\nCandidate {i}:\n{answer}"
    messages = [{"role": "system", "content": role_text(agent, tokenizer, role_tokens)},
                {"role": "user", "content": f"{user}\n\n{agent.instruction}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def parse_choice(text: str, n: int) -> int | None:
    """The first candidate number ``1..n`` in a judge's reply, or None."""
    for m in re.finditer(r"\d+", text):
        k = int(m.group())
        if 1 <= k <= n:
            return k
    return None


def run_workflow(session, tokenizer, document: str, question: str, shape: str = "fully_connected",
                 agents: Sequence[Agent] = DEFAULT_AGENTS, rounds: int = 3, max_new_tokens: int = 32,
                 role_tokens: int | None = None, judge: Agent = JUDGE, sessions: dict | None = None,
                 **generate_kwargs) -> WorkflowRun:
    """Run one workflow over one question; every agent call goes through ``session`` (a ReuseSession).

    Greedy decoding unless ``generate_kwargs`` say otherwise. ``rounds`` is ignored by ``chain`` and
    ``judge`` (one round). An agent with its own ``adapter`` has it activated (``set_adapter``) for its calls;
    one with its own ``model`` goes through a session of that model with the same policy and budget, kept in
    ``sessions`` (pass a dict to keep them across questions).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: choose one of {SHAPES}")
    if not agents:
        raise ValueError("a workflow needs at least one agent")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    generate_kwargs.setdefault("do_sample", False)
    turns: list[Turn] = []
    sessions = {} if sessions is None else sessions

    def session_for(agent: Agent):
        if agent.model is None or agent.model is session.model:
            return session
        key = id(agent.model)
        if key not in sessions:
            from ..session import ReuseSession

            sessions[key] = ReuseSession(agent.model, max_bytes=session.max_bytes, policy=session.policy,
                                         min_span=session.min_span, method_kwargs=session.method_kwargs)
        return sessions[key]

    def call(agent: Agent, r: int, **parts) -> str:
        s = session_for(agent)
        if agent.adapter is not None:
            if not hasattr(s.model, "set_adapter"):
                raise ValueError(f"agent {agent.name!r} names adapter {agent.adapter!r} but the model has no "
                                 "adapters (wrap it with peft)")
            s.model.set_adapter(agent.adapter)
        ids = workflow_prompt(tokenizer, agent, document, question, role_tokens=role_tokens, **parts)
        t0 = time.perf_counter()
        out = s.generate(ids, agent=agent.name, max_new_tokens=max_new_tokens, **generate_kwargs)
        wall = time.perf_counter() - t0
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        turns.append(Turn(r, agent.name, int(ids.shape[1]), text, wall, s.last_stats.as_dict(), ids))
        return text

    n_rounds = rounds if shape in ("fully_connected", "debate") else 1
    last: list[tuple[str, str]] = []
    for r in range(n_rounds):
        now: list[tuple[str, str]] = []
        for agent in agents:
            if shape == "chain":
                answer = call(agent, r, current=now)
            elif shape == "fully_connected":
                answer = call(agent, r, current=now, last_round=last)
            elif shape == "debate":
                answer = call(agent, r, last_round=last)
            else:  # judge: independent candidates
                answer = call(agent, r)
            now.append((agent.name, answer))
        last = now
    if shape != "judge":
        return WorkflowRun(shape, session.policy, turns, final=last[-1][1])
    reply = call(judge, 0, candidates=[a for _, a in last])
    choice = parse_choice(reply, len(last))
    final = last[choice - 1][1] if choice else reply
    return WorkflowRun(shape, session.policy, turns, final=final, judge_choice=choice)
