"""ReAct episode format, parsers and skill checks; the shipped role adapters beat the base model on their skill."""

import json
import random

import pytest

from hf_kvreuse.workflows import react
from hf_kvreuse.workflows.datasets import SquadItem, squad

P1 = "Super Bowl 50 was played in 2016. The Denver Broncos beat the Carolina Panthers 24-10."
P2 = "The game was held at Levi's Stadium in Santa Clara."
ITEMS = [
    SquadItem("Super_Bowl_50", P1, "Which team won Super Bowl 50?", ("Denver Broncos", "Broncos")),
    SquadItem("Super_Bowl_50", P2, "Where was the game held?", ("Levi's Stadium",)),
    SquadItem("Fresno,_California", "Fresno lies in the San Joaquin Valley.", "Where is Fresno?",
              ("San Joaquin Valley",)),
]


def test_role_prompts_are_prefixes_of_one_episode():
    item = ITEMS[0]
    passages = react.observation_passages(item, ITEMS, 2, random.Random(0))
    full = react.episode(item, passages)
    plan, act = react.plan_example(item), react.act_example(item, passages)
    refl = react.reflect_example(item, passages, item.answers[0])
    for ex in (plan, act, refl):
        assert full.startswith(ex.prompt + ex.target)
    assert full == refl.prompt + refl.target
    assert full.startswith(react.INSTRUCTION + "Question: Which team won Super Bowl 50?\n")
    assert plan.target == ("Thought: I need to retrieve passages about Super Bowl 50.\n"
                           "Action: Retrieve[Super Bowl 50]\n")
    assert act.prompt.endswith(f"Observation: {P1}\n{P2}\n" + react.ACT_THOUGHT + "Action: Finish[") or \
        act.prompt.endswith(f"Observation: {P2}\n{P1}\n" + react.ACT_THOUGHT + "Action: Finish[")
    assert act.target == "Denver Broncos]\n" and refl.target == "Reflect[right]\n"
    assert full.endswith("Action: Finish[Denver Broncos]\nReflect[right]\n")


def test_observation_passages_and_string_observation():
    item = ITEMS[0]
    ps = react.observation_passages(item, ITEMS, 3, random.Random(1))
    assert sorted(ps) == sorted([P1, P2])  # only one same-article distractor exists
    assert react.observation_passages(item, ITEMS) == [P1]
    assert "Observation: long text\n" in react.act_example(item, "long text").prompt


def test_wrong_candidate_and_reflect_labels():
    item = ITEMS[0]
    cand = react.wrong_candidate(item, ITEMS, random.Random(0))
    assert cand == "Levi's Stadium" and not react.is_right(cand, item)
    assert react.reflect_example(item, [P1], cand).target == "Reflect[wrong]\n"
    assert react.reflect_example(item, [P1], "the Denver Broncos").target == "Reflect[right]\n"


def test_parsers():
    assert react.parse_retrieve("Thought: x\nAction: Retrieve[ Super Bowl 50 ]\nObs") == "Super Bowl 50"
    assert react.parse_retrieve("Action: Search[x]") is None
    assert react.parse_finish("Denver Broncos]\nReflect[right]") == "Denver Broncos"
    assert react.parse_finish("Action: Finish[24-10]\n") == "24-10"
    assert react.parse_finish("no bracket\nmore") == "no bracket"
    assert react.parse_reflect("Reflect[wrong]\n") == "wrong"
    assert react.parse_reflect("Reflect[maybe]") is None


def test_checks():
    item, fresno = ITEMS[0], ITEMS[2]
    assert react.check_plan(react.plan_example(item).target, item)
    assert react.check_plan("Action: Retrieve[super_bowl_50]", item)
    assert react.check_plan("Action: Retrieve[Fresno California]", fresno)
    assert not react.check_plan("Action: Retrieve[Super Bowl]", item)
    assert not react.check_plan("Thought: Super Bowl 50", item)
    assert react.check_act("the Broncos]", item) and not react.check_act("Carolina]", item)
    assert not react.check_act("]", item)
    assert react.check_reflect("Reflect[right]", True) and not react.check_reflect("Reflect[right]", False)
    assert not react.check_reflect("right", True)
    assert react.names_topic(item) and not react.names_topic(ITEMS[1])


def test_split_holds_out_whole_articles():
    items = squad()
    train, held = react.split_items(items)
    assert len(train) + len(held) == len(items) and len(held) >= 30
    assert {it.title for it in held} == set(react.EVAL_TITLES)
    assert not {it.title for it in train} & set(react.EVAL_TITLES)


# (model key, hidden size, K/V width, layers) of the models with shipped role adapters
SHIPPED = [("smollm2", 576, 192, 30), ("qwen2.5-0.5b", 896, 128, 24)]


@pytest.mark.parametrize("key,hidden,kv_width,layers", SHIPPED)
def test_shipped_adapter_configs(key, hidden, kv_width, layers):
    """Each model's shipped adapters: rank 8 on v_proj only (PReCache), every layer, shapes of that model."""
    from safetensors import safe_open

    folder = react.role_adapters_dir(key)
    assert (folder / "README.md").is_file()
    for role in react.ROLES:
        d = folder / role
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["r"] == 8 and cfg["target_modules"] == ["v_proj"], cfg  # PReCache: no LoRA on k_proj
        with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        assert len(shapes) == 2 * layers
        assert all(v == [8, hidden] for k, v in shapes.items() if "lora_A" in k)
        assert all(v == [kv_width, 8] for k, v in shapes.items() if "lora_B" in k)


@pytest.mark.parametrize("key", [k for k, *_ in SHIPPED])
def test_adapters_of_another_model_are_refused(key):
    """Loading a model's adapters onto another model raises a ValueError naming both shapes, before peft.

    Planted bug that fails it: ``load_role_adapters`` skips ``_check_adapter_shapes`` (peft then raises a
    RuntimeError about a size mismatch deep inside ``load_state_dict``)."""
    from hf_kvreuse.models import tiny_model

    with pytest.raises(ValueError, match="trained for another model"):
        react.load_role_adapters(tiny_model("qwen2"), react.role_adapters_dir(key))
    with pytest.raises(FileNotFoundError, match="adapter"):
        react.load_role_adapters(tiny_model("qwen2"), react.ADAPTERS_ROOT / "nowhere")
    with pytest.raises(ValueError, match="k_proj"):
        react.role_adapters_dir(key, ("q_proj",))


@pytest.mark.slow
def test_adapters_beat_base_on_own_skill():
    import torch

    from hf_kvreuse.models import load_smollm2

    torch.set_num_threads(2)
    items = squad()
    _, held = react.split_items(items)
    # Plan can only name an unseen article when the question names it, so its items are such questions.
    plan_items = [it for it in held if react.names_topic(it)][:8]
    other = held[:4]
    rng = random.Random(0)
    cases = {
        "plan": [(react.plan_example(it).prompt, lambda g, it=it: react.check_plan(g, it)) for it in plan_items],
        "act": [(react.act_example(it, react.observation_passages(it, items, 1, rng)).prompt,
                 lambda g, it=it: react.check_act(g, it)) for it in other[:3]],
        "reflect": [],
    }
    for i, it in enumerate(other):
        cand = it.answers[0] if i % 2 == 0 else react.wrong_candidate(it, items, rng)
        prompt = react.reflect_example(it, react.observation_passages(it, items, 1, rng), cand).prompt
        cases["reflect"].append((prompt, lambda g, r=i % 2 == 0: react.check_reflect(g, r)))

    model, tok = load_smollm2()
    pm = react.load_role_adapters(model)

    def score(role):
        return sum(check(react.generate(pm, tok, p, react.MAX_NEW_TOKENS[role])) for p, check in cases[role])

    for role in react.ROLES:
        with pm.disable_adapter():
            base = score(role)
        pm.set_adapter(role)
        tuned = score(role)
        assert tuned > base, (role, tuned, base)
