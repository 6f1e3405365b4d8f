import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import UnsupportedRopeError, OptimisticCache
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import RopeShifter, check_rope_supported

from conftest import exact_prefill

THETA = 10000.0
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": THETA},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": THETA},
}


def _model(rope):
    kw = {} if ROPES[rope] is None else {"rope_parameters": ROPES[rope]}
    return tiny_model("llama", **kw)


def _prefill(model, ids, start):
    return exact_prefill(model, ids, start)[0]


@pytest.mark.parametrize("rope", list(ROPES))
def test_shift_equals_fresh_prefill_at_shifted_positions(rope):
    """Every layer's keys of a prefill at ``0..`` shifted by ``d`` equal a prefill's at ``d..`` (values unchanged),
    for each supported rope type.

    Planted bug that fails it ([linear], not [default]): ``RopeShifter`` computes ``inv_freq`` from a hand-written
    ``theta=10000`` instead of the module's buffer (the model check refuses the model, the test errors)."""
    model = _model(rope)
    assert check_rope_supported(model) == rope
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    d = 37
    a, b = _prefill(model, ids, 0), _prefill(model, ids, d)
    sh = RopeShifter(model)
    for la, lb in zip(a.layers, b.layers):
        # whole-context moves keep hidden states (relative-position invariance), so every layer must match
        assert (la.keys - lb.keys).abs().max() > 1e-2  # the shift is not a no-op
        torch.testing.assert_close(sh.shift(la.keys, d), lb.keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(sh.shift(lb.keys, -d), la.keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(la.values, lb.values, atol=2e-5, rtol=0)


def _layer0_keys(model, ids, positions):
    """The model's own layer-0 keys of ``ids`` at arbitrary ``positions`` (layer 0 sees no other context)."""
    from hf_kvreuse.compat import cache_kwargs

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, position_ids=positions[None], **cache_kwargs(cache))
    return cache.layers[0].keys


def _family(name):
    import transformers

    if name.startswith("llama-"):
        return _model(name[6:])
    cls, kw = {"cohere": (transformers.CohereConfig, {}),                       # interleaved
               "glm": (transformers.GlmConfig, {"head_dim": 16}),              # interleaved, partial rotary
               "stablelm": (transformers.StableLmConfig, {"partial_rotary_factor": 0.25}),  # half, partial
               "phi3": (transformers.Phi3Config, {"partial_rotary_factor": 0.5})}[name]
    cfg = cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("name", [f"llama-{r}" for r in ROPES] + ["cohere", "glm", "stablelm", "phi3"])
def test_per_token_deltas_match_the_models_own_keys(name):
    """Keys at positions ``p`` shifted by per-token deltas equal the keys the model itself computes at ``p + d``
    (checked against the model's forward, not against the shifter run backwards).

    Planted bug that fails it: ``RopeShifter`` with the other layout (``layout="half"`` for Cohere / GLM,
    ``"interleaved"`` for the rest), or ``cos_sin`` without the ``cat``/``repeat_interleave`` of the angles."""
    model = _family(name)
    sh = RopeShifter(model)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(1000, 1010)
    delta = torch.tensor([0, 1, -3, 100, 7, 7, -50, 2, 1000, -1000])
    got = sh.shift(_layer0_keys(model, ids, pos), delta)
    want = _layer0_keys(model, ids, pos + delta)
    assert (want - _layer0_keys(model, ids, pos)).abs().max() > 1e-2  # the deltas do move the keys
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    wrong = RopeShifter(model, layout="half" if sh.layout == "interleaved" else "interleaved")
    assert (wrong.shift(_layer0_keys(model, ids, pos), delta) - want).abs().max() > 1e-2


@pytest.mark.parametrize("cfg", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}])
def test_dynamic_rope_refused(cfg):
    model = tiny_model("llama", rope_parameters=cfg)
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        RopeShifter(model)
    ids = torch.randint(3, 128, (1, 8))
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        OptimisticCache(model, input_ids=ids, donor_cache=DynamicCache(), donor_ids=ids, rebase="commit")


def test_longrope_refused():
    half = 8  # head_dim 16 / 2
    cfg = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
           "original_max_position_embeddings": 256, "rope_theta": THETA}
    model = tiny_model("llama", rope_parameters=cfg)
    with pytest.raises(UnsupportedRopeError, match="longrope"):
        RopeShifter(model)
