"""Per-layer device bookkeeping (hf_kvreuse.devices) on CPU: layers reported on another device (the ``meta`` device
stands in for a second accelerator, as accelerate's hooks report one) get their rows, zeros and K/V there."""

from types import SimpleNamespace

import pytest
import torch

from hf_kvreuse import DirectReuseCache, OptimisticCache, enable
from hf_kvreuse.devices import PerDevice, decoder_layers, layer_devices, offloaded
from hf_kvreuse.generation.partial import _ScatterCache
from hf_kvreuse.models import tiny_model

from conftest import agent_prompts


@pytest.fixture
def model():
    m = enable(tiny_model("llama"))
    yield m
    for layer in decoder_layers(m):
        layer.__dict__.pop("_hf_hook", None)


def test_layer_devices_follow_each_layer(model):
    assert layer_devices(model) == [torch.device("cpu")] * model.config.num_hidden_layers
    decoder_layers(model)[2]._hf_hook = SimpleNamespace(execution_device="meta")
    devs = layer_devices(model)
    assert devs[2] == torch.device("meta") and devs[0] == devs[3] == torch.device("cpu")


def test_scatter_rows_follow_each_layer(model):
    """The partial-recompute cache writes each layer's rows with an index on that layer's device.

    Planted bug that fails it: ``_ScatterCache.update`` indexes with the rows as given (layer 0's device):
    ``index_copy_`` into a layer on another device raises."""
    n, rows = 10, torch.tensor([1, 4, 7])
    kv = [(torch.zeros(1, 2, n, 16, device=d), torch.zeros(1, 2, n, 16, device=d))
          for d in ("cpu", "meta", "cpu", "cpu")]
    cache = _ScatterCache(model.config, kv, rows)
    new = torch.ones(1, 2, 3, 16, device="meta")
    k, v = cache.update(new, new, 1)
    assert k.device.type == "meta" and cache.writes[1] == 1
    k0, _ = cache.update(torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16), 0)
    assert k0[0, 0, rows].eq(1).all() and k0[0, 0, 0].eq(0).all()


def test_block_zeros_on_each_layers_device(model):
    """Without blocks, the assembled K/V of every layer are allocated on that layer's device.

    Planted bug that fails it: ``assemble_blocks`` allocates every layer on the first parameter's device."""
    decoder_layers(model)[1]._hf_hook = SimpleNamespace(execution_device="meta")
    ids, _ = agent_prompts(0)
    cache = DirectReuseCache(model, ids, blocks=[])
    kv = cache.assemble_blocks()
    assert [k.device.type for k, _ in kv] == ["cpu", "meta", "cpu", "cpu"]


def test_offloaded_models_are_refused_for_background_prefill(model):
    ids_a, ids_b = agent_prompts(1)
    out = model.generate(ids_a, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    from hf_kvreuse import output_cache

    donor = (output_cache(out), out.sequences)
    assert not offloaded(model)
    decoder_layers(model)[0]._hf_hook = SimpleNamespace(execution_device="cpu", offload=True)
    assert offloaded(model)
    with pytest.raises(ValueError, match="offloaded weights"):
        OptimisticCache(model, ids_b, *donor, rebase="commit")
    OptimisticCache(model, ids_b, *donor, max_optimistic_tokens=0,
                    rebase="commit")  # exact prefill before the first token: fine


def test_per_device_copies_are_made_once():
    t = torch.arange(4)
    pd = PerDevice(t)
    assert pd.on(torch.device("cpu")) is t
    m1 = pd.on(torch.device("meta"))
    assert m1 is pd.on(torch.device("meta")) and m1.device.type == "meta"


def test_hook_devices_are_indexed():
    """accelerate's execution devices come back indexed (``cuda`` -> ``cuda:N``), so they compare equal to the
    devices tensors report; CPU and meta stay as they are; a device this build cannot use is returned as given.

    Planted bug that fails it (on a CUDA machine; here only the fallback is checked): ``_module_device`` returns
    the hook's unindexed device (``device('cuda') != device('cuda:0')``: seen failing tests/test_gpu.py on an
    H200)."""
    from hf_kvreuse.devices import _indexed

    assert _indexed(torch.device("cpu")) == torch.device("cpu")
    assert _indexed(torch.device("meta")) == torch.device("meta")
    cuda = _indexed(torch.device("cuda"))
    assert cuda == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                    else torch.device("cuda"))
