import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import RopeShifter, UnsupportedRopeError, OptimisticCache, tiny_model
from hf_kvreuse.rope import check_rope_supported

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


@pytest.mark.parametrize("rope", list(ROPES))
def test_round_trip_per_token_deltas(rope):
    sh = RopeShifter(_model(rope))
    keys = torch.randn(1, 2, 10, 16)
    delta = torch.tensor([0, 1, -3, 100, 7, 7, -50, 2, 1000, -1000])
    back = sh.shift(sh.shift(keys, delta), -delta)
    torch.testing.assert_close(back, keys, atol=1e-5, rtol=0)
    # per-token deltas equal one shift per token
    for t in (2, 8):
        torch.testing.assert_close(sh.shift(keys, delta)[..., t:t + 1, :], sh.shift(keys[..., t:t + 1, :], int(delta[t])))


@pytest.mark.parametrize("cfg", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}])
def test_dynamic_rope_refused(cfg):
    model = tiny_model("llama", rope_parameters=cfg)
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        RopeShifter(model)
    ids = torch.randint(3, 128, (1, 8))
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        OptimisticCache(model, input_ids=ids, donor_cache=DynamicCache(), donor_ids=ids)


def test_longrope_refused():
    half = 8  # head_dim 16 / 2
    cfg = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
           "original_max_position_embeddings": 256, "rope_theta": THETA}
    model = tiny_model("llama", rope_parameters=cfg)
    with pytest.raises(UnsupportedRopeError, match="longrope"):
        RopeShifter(model)
