"""ReAct-style QA episodes over SQuAD for the plan / act / reflect role adapters (PReCache / AutoAct setting).

Three agents extend one plain-text scratchpad (no chat template)::

    <INSTRUCTION>
    Question: <question>
    Thought: I need to retrieve passages about <topic>.        <- plan
    Action: Retrieve[<topic>]                                  <- plan
    Observation: <passage>\\n<passage>...
    Thought: The observation contains the answer.
    Action: Finish[<answer>]                                   <- act writes "<answer>]"
    Reflect[right]                                             <- reflect ("right" / "wrong")

``<topic>`` is the SQuAD article title with spaces (``Super Bowl 50``). Each role's prompt is an exact prefix of
the episode, so the agents share the scratchpad text and differ only in the weights that produce their tokens.
Role adapters are LoRA (rank 8, ``v_proj`` only, as in PReCache) on SmolLM2-135M-Instruct; they are made by
``scripts/train_role_adapters.py`` and loaded with :func:`load_role_adapters`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..compat import cache_kwargs
from .datasets import SquadItem, contains_answer, normalize_answer

INSTRUCTION = ("Answer the question with tools. Retrieve[topic] returns passages about the topic, "
               "Finish[answer] gives the final short answer, Reflect[right] or Reflect[wrong] judges the final "
               "answer.\n")
ROLES = ("plan", "act", "reflect")
ACT_THOUGHT = "Thought: The observation contains the answer.\n"
# Held-out articles: every 8th title in sorted order (offset 5), fixed so that benchmarks, tests and the training
# script agree; 128 of the 1000 SQuAD items.
EVAL_TITLES = ("Chloroplast", "Force", "Imperialism", "Normans", "Sky_(United_Kingdom)",
               "Victoria_and_Albert_Museum")
ADAPTERS_ROOT = Path(__file__).parent.parent / "adapters"
ROLE_ADAPTERS_DIR = ADAPTERS_ROOT / "smollm2_roles"
# Generation budgets per role: enough for the longest target (plan: ~30 tokens for the longest title).
MAX_NEW_TOKENS = {"plan": 40, "act": 24, "reflect": 12}


@dataclass(frozen=True)
class RoleExample:
    """One role turn: the scratchpad prefix the agent sees and the text it should write next."""

    prompt: str
    target: str


def topic(item: SquadItem) -> str:
    """The retrieval topic of ``item``: its article title with spaces (``Fresno, California``)."""
    return item.title.replace("_", " ")


def split_items(items: Sequence[SquadItem]) -> tuple[list[SquadItem], list[SquadItem]]:
    """(train, eval) items: eval holds every item whose article is in :data:`EVAL_TITLES`."""
    held = set(EVAL_TITLES)
    return [it for it in items if it.title not in held], [it for it in items if it.title in held]


def observation_passages(item: SquadItem, items: Sequence[SquadItem], n_passages: int = 1,
                         rng: random.Random | None = None) -> list[str]:
    """``item``'s passage among ``n_passages - 1`` other passages of the same article (distractors that share the
    topic), at a random position. For ~1k-token observations use :func:`hf_kvreuse.workflows.datasets.passages_for`."""
    rng = rng or random.Random(0)
    others = sorted({it.passage for it in items if it.title == item.title} - {item.passage})
    passages = rng.sample(others, min(n_passages - 1, len(others)))
    passages.insert(rng.randint(0, len(passages)), item.passage)
    return passages


def format_observation(passages: Sequence[str] | str) -> str:
    """The observation text: one passage per line."""
    return passages if isinstance(passages, str) else "\n".join(p.replace("\n", " ") for p in passages)


def _question(item: SquadItem) -> str:
    return f"{INSTRUCTION}Question: {item.question}\n"


def _plan_turn(item: SquadItem) -> str:
    return f"Thought: I need to retrieve passages about {topic(item)}.\nAction: Retrieve[{topic(item)}]\n"


def _act_prefix(item: SquadItem, passages: Sequence[str] | str) -> str:
    return (f"{_question(item)}{_plan_turn(item)}Observation: {format_observation(passages)}\n"
            f"{ACT_THOUGHT}Action: Finish[")


def plan_example(item: SquadItem) -> RoleExample:
    """The plan turn: after the question, write the thought and ``Action: Retrieve[<topic>]``."""
    return RoleExample(_question(item), _plan_turn(item))


def act_example(item: SquadItem, passages: Sequence[str] | str, answer: str | None = None) -> RoleExample:
    """The act turn: after ``Action: Finish[``, write the answer span and ``]`` (default answer: the first gold)."""
    return RoleExample(_act_prefix(item, passages), f"{item.answers[0] if answer is None else answer}]\n")


def reflect_example(item: SquadItem, passages: Sequence[str] | str, candidate: str) -> RoleExample:
    """The reflect turn: after ``Action: Finish[<candidate>]``, write ``Reflect[right]`` or ``Reflect[wrong]``."""
    verdict = "right" if is_right(candidate, item) else "wrong"
    return RoleExample(f"{_act_prefix(item, passages)}{candidate}]\n", f"Reflect[{verdict}]\n")


def episode(item: SquadItem, passages: Sequence[str] | str, candidate: str | None = None) -> str:
    """The whole scratchpad with ``candidate`` (default: the first gold answer) and its reflect verdict."""
    ex = reflect_example(item, passages, item.answers[0] if candidate is None else candidate)
    return ex.prompt + ex.target


def is_right(candidate: str, item: SquadItem) -> bool:
    """The reflect label: ``candidate`` contains a gold answer (the same lenient rule as the act check)."""
    return contains_answer(candidate, item.answers)


def wrong_candidate(item: SquadItem, items: Sequence[SquadItem], rng: random.Random | None = None) -> str:
    """A plausible wrong answer: the answer to another question about the same article.

    Candidates that contain, or are contained in, a gold answer are skipped so that the label is unambiguous.
    """
    rng = rng or random.Random(0)
    gold = [normalize_answer(a) for a in item.answers]

    def ok(c: str) -> bool:
        n = normalize_answer(c)
        return bool(n) and not is_right(c, item) and not any(n in g for g in gold)

    for pool in ([it for it in items if it.title == item.title], list(items)):
        cands = sorted({it.answers[0] for it in pool if it.question != item.question and ok(it.answers[0])})
        if cands:
            return rng.choice(cands)
    raise ValueError("no wrong candidate found")


# ---------------------------------------------------------------------------------------------------------------
# Parsers and skill checks. They accept either the generated continuation alone or the whole scratchpad text.

def parse_retrieve(text: str) -> str | None:
    """The query of the first ``Retrieve[...]`` action, or None."""
    m = re.search(r"Retrieve\[([^\]\n]*)\]", text)
    return m.group(1).strip() if m else None


def parse_finish(text: str) -> str:
    """The Finish argument: after the last ``Finish[`` if present (else from the start, as the act continuation
    starts inside the bracket), up to ``]`` or the end of the line."""
    i = text.rfind("Finish[")
    if i >= 0:
        text = text[i + len("Finish["):]
    return re.split(r"[\]\n]", text, maxsplit=1)[0].strip()


def parse_reflect(text: str) -> str | None:
    """``"right"`` or ``"wrong"`` from the first ``Reflect[...]``, or None."""
    m = re.search(r"Reflect\[(right|wrong)\]", text)
    return m.group(1) if m else None


def _norm_topic(s: str) -> str:
    return normalize_answer(s.replace("_", " "))


def check_plan(text: str, item: SquadItem) -> bool:
    """The Retrieve query equals the article title (normalised, underscores as spaces)."""
    q = parse_retrieve(text)
    return q is not None and _norm_topic(q) == _norm_topic(item.title)


def check_act(text: str, item: SquadItem) -> bool:
    """The Finish argument contains a gold answer (lenient extractive accuracy); an empty answer never counts."""
    return contains_answer(parse_finish(text), item.answers)


def check_reflect(text: str, right: bool) -> bool:
    """The verdict matches the label; no verdict counts as wrong."""
    return parse_reflect(text) == ("right" if right else "wrong")


def names_topic(item: SquadItem) -> bool:
    """The question itself names the article title; plan can only recover an unseen title from such questions."""
    return f" {_norm_topic(item.title)} " in f" {normalize_answer(item.question)} "


# ---------------------------------------------------------------------------------------------------------------
# Generation and adapters.

@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24, stop: str = "]") -> str:
    """Greedy continuation of ``prompt`` (no special tokens), cut after the first ``stop``.

    Greedy decoding with a KV cache, stopping as soon as ``stop`` appears, keeps evaluation cheap on CPU.
    """
    from transformers import DynamicCache

    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    cache = DynamicCache(config=model.config)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache)).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == tokenizer.eos_token_id:
            break
        out.append(nxt)
        text = tokenizer.decode(out)
        if stop and stop in text:
            return text[:text.index(stop) + len(stop)]
        ids = torch.tensor([[nxt]], device=model.device)
    return tokenizer.decode(out)


def role_lora_config(targets: Sequence[str] = ("v_proj",)):
    """The PReCache role-adapter LoRA: rank 8, alpha 16, on ``v_proj`` only by default (K stays adapter-free);
    ``targets=("k_proj", "v_proj")`` is the variant with key adapters."""
    from ..compat import import_peft

    return import_peft().LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=sorted(targets),
                                    task_type="CAUSAL_LM")


def role_adapters_dir(model: str = "smollm2", targets: Sequence[str] = ("v_proj",)) -> Path:
    """Folder of the shipped role adapters of ``model`` (a key of :data:`hf_kvreuse.models.MODEL_KEYS`) trained on
    ``targets``: ``adapters/<model>_roles`` for ``v_proj``, ``adapters/<model>_roles_kv`` for ``k_proj + v_proj``."""
    targets = tuple(sorted(targets))
    suffix = {("v_proj",): "", ("k_proj", "v_proj"): "_kv"}.get(targets)
    if suffix is None:
        raise ValueError(f"role adapters are trained on v_proj or k_proj + v_proj, not {list(targets)}")
    return ADAPTERS_ROOT / f"{model.replace('-', '_').replace('.', '')}_roles{suffix}"


def load_role_adapters(model, path: str | Path | None = None):
    """Load the ``plan``, ``act`` and ``reflect`` adapters onto ``model`` (mutated in place by peft).

    Parameters
    ----------
    model : the base model the adapters were trained for (SmolLM2-135M-Instruct for the default path,
        ``hf_kvreuse.models.load_smollm2()[0]``).
    path : folder with one ``PeftModel.save_pretrained`` subfolder per role (default :data:`ROLE_ADAPTERS_DIR`;
        :func:`role_adapters_dir` gives the shipped folder of each model).

    Returns
    -------
    peft.PeftModel in eval mode with ``plan`` active; switch with ``set_adapter(role)``, use the base model with
    ``with pm.disable_adapter():``.

    Raises
    ------
    FileNotFoundError
        ``path`` has no adapter of some role.
    ValueError
        The adapters were trained for another base model (peft's ``base_model_name_or_path`` does not say so
        reliably, so the hidden size, layer count and K/V width are compared with the adapter's shapes).
    """
    from ..compat import import_peft

    path = Path(path) if path is not None else ROLE_ADAPTERS_DIR
    for role in ROLES:
        if not (path / role / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no {role!r} adapter in {path} (expected {path / role}/adapter_config.json)")
    from ..artifacts import verify_files

    for role in ROLES:  # sha256 (sha256.json beside peft's files) and finite values
        verify_files(path / role, f"the {role!r} role adapter")
    _check_adapter_shapes(model, path / ROLES[0])
    pm = import_peft().PeftModel.from_pretrained(model, path / ROLES[0], adapter_name=ROLES[0])
    for role in ROLES[1:]:
        pm.load_adapter(path / role, adapter_name=role)
    pm.set_adapter(ROLES[0])
    return pm.eval()


def _check_adapter_shapes(model, folder: Path) -> None:
    """Refuse an adapter whose LoRA shapes do not fit ``model`` (peft would raise a size-mismatch deep inside)."""
    from safetensors import safe_open

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_width = cfg.num_key_value_heads * head_dim
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        layers = {int(k.split(".layers.")[1].split(".")[0]) for k in keys if ".layers." in k}
        shapes = {k: f.get_slice(k).get_shape() for k in keys}
    a = next(v for k, v in shapes.items() if "lora_A" in k)
    b = next(v for k, v in shapes.items() if "lora_B" in k and ("v_proj" in k or "k_proj" in k))
    if a[1] != cfg.hidden_size or b[0] != kv_width or (layers and max(layers) >= cfg.num_hidden_layers):
        raise ValueError(f"the adapters in {folder.parent} were trained for another model (LoRA in {a[1]}, out "
                         f"{b[0]}, {max(layers) + 1 if layers else 0} layers); this {cfg.model_type} has hidden "
                         f"{cfg.hidden_size}, K/V width {kv_width}, {cfg.num_hidden_layers} layers")


def react_stop(tokenizer, prompt_len: int, stop: str = "]"):
    """A ``generate`` stopping criterion: stop once the generated text contains ``stop`` (an action closed).

    Cheaper than ``stop_strings=``, which builds token tables over the whole vocabulary on every call.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = [stop in tokenizer.decode(row[prompt_len:]) for row in input_ids]
            return torch.tensor(done, device=input_ids.device)

    return StoppingCriteriaList([_Stop()])


def agent_turn(pm, tokenizer, cache, agent: str, prompt: str, max_new_tokens: int, first_logits: bool = False):
    """One agent's turn on a shared cache: greedy, stopped after the closing ``]``.

    Returns the generated text and the time to its first token (seconds); with ``first_logits``, also the
    float32 logits of the first generated token (``[vocab]``, CPU), to measure how far caches drift apart.
    """
    from ..timing import TokenTimer

    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    pm.set_adapter(agent)
    timer = TokenTimer()
    timer.start()
    out = pm.generate(input_ids=ids, cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
                      stopping_criteria=react_stop(tokenizer, ids.shape[1]), streamer=timer,
                      return_dict_in_generate=True, output_logits=first_logits)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    if first_logits:
        return text, timer.ttft_s, out.logits[0][0].float().cpu()
    return text, timer.ttft_s
