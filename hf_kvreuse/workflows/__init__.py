"""Workloads: multi-agent workflow shapes through a ReuseSession (:mod:`.graphs`: chain, fully connected,
debate, judge), agents and their prompts (:mod:`.agents`), ReAct episodes for the plan / act / reflect role adapters
(:mod:`.react`), offline evaluation data (:mod:`.datasets`: SQuAD, DROP) and conflicting-task records for
LatentRemedy (:mod:`.conflicting`)."""

from . import react
from .agents import DEFAULT_AGENTS, Agent, agent_prompt, role_text
from .conflicting import (FAMILIES, HELDOUT_FAMILIES, TRAIN_FAMILIES, ConflictRecord, conflict_records, is_correct,
                          prompt_parts)
from .graphs import JUDGE, SHAPES, Turn, WorkflowRun, parse_choice, run_workflow, workflow_prompt
from .datasets import (DropItem, SquadItem, contains_answer, context_for, drop, normalize_answer, passages_for,
                       qa_chat_ids, squad)
from .react import (ROLE_ADAPTERS_DIR, ROLES, agent_turn, episode, load_role_adapters, react_stop, role_adapters_dir,
                    role_lora_config)

__all__ = ["FAMILIES", "HELDOUT_FAMILIES", "TRAIN_FAMILIES", "ConflictRecord", "conflict_records", "is_correct",
           "prompt_parts",
           "Agent", "DEFAULT_AGENTS", "agent_prompt", "role_text",
           "SquadItem", "DropItem", "squad", "drop", "qa_chat_ids", "passages_for", "context_for", "contains_answer",
           "normalize_answer",
           "react", "ROLES", "ROLE_ADAPTERS_DIR", "load_role_adapters", "role_adapters_dir", "role_lora_config", "agent_turn", "episode",
           "react_stop",
           "SHAPES", "JUDGE", "Turn", "WorkflowRun", "run_workflow", "workflow_prompt", "parse_choice"]
