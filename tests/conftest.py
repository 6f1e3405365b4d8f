import os

import torch

# Triton's interpreter must be on before anything imports triton (transformers does, through hf_kvreuse): then
# triton.language's own jitted helpers (tl.sum, ...) also run on CPU tensors. Only without a GPU: on a CUDA machine
# the kernels compile for the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hf_kvreuse import enable  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402

torch.set_num_threads(2)

# Property tests draw the same inputs on every run of `make test` and CI (a red run is reproducible from a clean
# clone): every hypothesis test's settings inherit this profile's derandomize=True (the seed comes from the test's
# own source) and no example database (a failure saved by an earlier local run does not change what runs).
# `make fuzz` (HF_KVREUSE_FUZZ=long) keeps random search: there the default stays hypothesis' own.
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # hypothesis is a dev extra; the modules that use it importorskip it
    pass
else:
    _hypothesis_settings.register_profile("hf_kvreuse-ci", derandomize=True, database=None)
    if os.environ.get("HF_KVREUSE_FUZZ", "fast") != "long":
        _hypothesis_settings.load_profile("hf_kvreuse-ci")

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session", params=ARCHS)
def arch_model(request):
    return enable(tiny_model(request.param))


@pytest.fixture(scope="session")
def llama():
    return enable(tiny_model("llama"))


@pytest.fixture(scope="session")
def llama_eager():
    return enable(tiny_model("llama", attn_implementation="eager"))


@pytest.fixture(scope="session")
def smollm2():
    from hf_kvreuse.models import load_smollm2

    model, tok = load_smollm2()
    return enable(model), tok


class WordTokenizer:
    """A tokenizer stand-in for the tiny models: token ``i`` reads `` w<i>`` (``\\n`` for multiples of 10); like a
    SentencePiece tokenizer, a decode drops the space in front of its first word."""

    def batch_decode(self, seqs, **kwargs):
        return [self.decode(s) for s in seqs]

    def decode(self, ids, **kwargs):
        text = "".join("\n" if int(i) % 10 == 0 else f" w{int(i)}" for i in ids)
        return text[1:] if text.startswith(" ") else text


def agent_prompts(seed=0, shared=40, role_a=6, role_b=9, vocab=128):
    """Two prompts sharing a block of `shared` tokens after different role prefixes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, vocab, (1, shared), generator=g)
    ra = torch.randint(3, vocab, (1, role_a), generator=g)
    rb = torch.randint(3, vocab, (1, role_b), generator=g)
    return torch.cat([ra, q], 1), torch.cat([rb, q], 1)


def exact_prefill(model, ids, start=0):
    """Plain full prefill of `ids` at positions start.. into a fresh DynamicCache: (cache, all logits)."""
    from transformers import DynamicCache

    from hf_kvreuse.compat import cache_kwargs

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], logits_to_keep=0,
                    **cache_kwargs(cache))
    return cache, out.logits


def assert_kv_close(a, b, atol=1e-5, rtol=1e-5, length=None):
    """Every layer's K and V of caches / KV lists `a` and `b` agree (on the first `length` tokens)."""
    from hf_kvreuse.kv import kv_of

    for (k, v), (rk, rv) in zip(kv_of(a), kv_of(b)):
        if length is not None:
            k, v, rk, rv = (t[..., :length, :] for t in (k, v, rk, rv))
        torch.testing.assert_close(k, rk, atol=atol, rtol=rtol)
        torch.testing.assert_close(v, rv, atol=atol, rtol=rtol)



def assert_same_generation(fused, unfused):
    """Two ``(cache, generate output)`` runs of one prompt agree: rows recomputed, every step's logits, the tokens
    and the returned K/V (the fused first step against its two-forward path)."""
    (fc, fo), (uc, uo) = fused, unfused
    assert fc.stats.recomputed_tokens == uc.stats.recomputed_tokens
    torch.testing.assert_close(torch.stack(fo.logits), torch.stack(uo.logits), atol=1e-4, rtol=1e-4)
    assert torch.equal(fo.sequences, uo.sequences)
    assert_kv_close(fc, uc)

@pytest.fixture
def pending_runs(monkeypatch):
    """Weak references to every fused first step's pending forward that runs while the fixture is active, with the
    cyclic garbage collector off: a reference that is still alive after ``generate`` is held by a reference cycle
    or by an object, not by something reference counting frees."""
    import gc
    import weakref

    from hf_kvreuse.generation import fused

    seen = []
    run = fused.PendingForward.run

    def tracking_run(self, model, cache, fed):
        seen.append(weakref.ref(self))
        return run(self, model, cache, fed)

    monkeypatch.setattr(fused.PendingForward, "run", tracking_run)
    gc.collect()
    gc.disable()
    try:
        yield seen
    finally:
        gc.enable()
