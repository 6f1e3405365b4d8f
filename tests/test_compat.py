"""hf_kvreuse.compat: the release-dependent paths, including those the installed transformers does not take."""

import sys

import pytest
import torch

from hf_kvreuse import compat


def test_prepare_inputs_feeds_trailing_tokens_on_either_api(monkeypatch):
    ids = torch.arange(10)[None]
    seen = {}

    def prepare(input_ids, **kwargs):
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(compat, "HAS_CACHE_POSITION", True)
    monkeypatch.setattr(compat, "HAS_NEXT_SEQUENCE_LENGTH", False)  # < 5.3: cache_position selects the tokens
    compat.prepare_inputs(prepare, ids, 3, {"cache_position": torch.tensor([9]), "use_cache": True})
    assert seen["cache_position"].tolist() == [7, 8, 9] and "next_sequence_length" not in seen
    seen.clear()
    compat.prepare_inputs(prepare, ids, None, {"cache_position": torch.tensor([9])})
    assert seen["cache_position"].tolist() == [9]
    seen.clear()
    monkeypatch.setattr(compat, "HAS_NEXT_SEQUENCE_LENGTH", True)  # 5.3 to 5.5: both
    compat.prepare_inputs(prepare, ids, 3, {"cache_position": torch.tensor([9])})
    assert seen["cache_position"].tolist() == [7, 8, 9] and seen["next_sequence_length"] == 3
    seen.clear()
    monkeypatch.setattr(compat, "HAS_CACHE_POSITION", False)  # 5.6+
    compat.prepare_inputs(prepare, ids, 3, {})
    assert seen == {"next_sequence_length": 3}


def test_config_kwargs_rope(monkeypatch):
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    monkeypatch.setattr(compat, "TRANSFORMERS_VERSION", (4, 57))
    assert compat.config_kwargs({"rope_parameters": params, "x": 1}) == {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500.0, "x": 1}
    assert compat.config_kwargs({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == {"rope_theta": 7.0}
    monkeypatch.setattr(compat, "TRANSFORMERS_VERSION", (5, 0))
    assert compat.config_kwargs({"rope_parameters": params}) == {"rope_parameters": params}


@pytest.mark.skipif(compat.TRANSFORMERS_VERSION < (5, 0),
                    reason="transformers 4.x works with peft 0.17; the peft>=0.18 requirement is for transformers 5.x")
def test_old_peft_on_transformers_5_names_the_release(monkeypatch):
    class OldPeft:  # what importing peft 0.17 does on transformers 5
        def find_spec(self, name, path=None, target=None):
            if name == "peft":
                raise ImportError("cannot import name 'HybridCache' from 'transformers'")

    monkeypatch.delitem(sys.modules, "peft", raising=False)
    monkeypatch.setattr(sys, "meta_path", [OldPeft()] + sys.meta_path)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.17.0")
    with pytest.raises(ImportError, match=r"peft>=0\.18\.0"):
        compat.import_peft()


def test_logical_offset_needs_query_offset(monkeypatch, llama):
    from hf_kvreuse.cache_classes.base import KVReuseCache

    cache = KVReuseCache(llama)
    compat.check_mask_geometry(cache)
    cache.logical_offset = 3
    monkeypatch.setattr(compat, "HAS_QUERY_OFFSET", False)
    with pytest.raises(NotImplementedError, match=r"transformers>=5\.17"):
        compat.prepare_inputs(lambda ids, **kw: kw, torch.zeros(1, 4, dtype=torch.long), None, {"cache": cache})
    monkeypatch.setattr(compat, "HAS_QUERY_OFFSET", True)
    compat.check_mask_geometry(cache)
