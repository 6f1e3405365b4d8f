"""Host synchronisations per generated token, counted on CPU: every call that would wait for a GPU (``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()`` / ``int()`` / ``float()`` / ``__index__`` of a tensor,
``torch.equal``) is seen by a torch function mode. (``.to("cpu")`` is not counted: on a CPU run it cannot be told
from the moves to the model's device.) The stated bound: once the cache is swapped, a decode step costs no more
syncs than plain ``generate``'s (its stopping checks: one per token on transformers 5.17, up to three on
older releases)."""

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
import cache_zoo  # noqa: E402
from cache_zoo import METHODS, CacheZoo  # noqa: E402

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"}
#: extra host syncs per decode step allowed above plain generate's
EXTRA_SYNCS_PER_TOKEN = 0


class CountSyncs(TorchFunctionMode):
    """Counts the calls in :data:`SYNCS` made on this thread while active."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture(scope="module")
def zoo():
    return CacheZoo()


def _per_token(monkeypatch, run, short=4, long=12):
    """(syncs per extra generated token, counts) between a ``short`` and a ``long`` generation (a warm-up run
    first: cached properties and prompts are built once)."""
    counts = {}
    for n in (short, short, long):
        monkeypatch.setattr(cache_zoo, "NEW_TOKENS", n)
        with CountSyncs() as c:
            tokens = run()
        counts[n] = (c.total, tokens, c.calls)
    (a, ta, _), (b, tb, calls) = counts[short], counts[long]
    if tb == ta:
        pytest.skip("generation stopped early (eos) in both runs")
    return (b - a) / (tb - ta), calls


@pytest.fixture(scope="module")
def plain_rate(zoo):
    mp = pytest.MonkeyPatch()
    try:
        def run():
            ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
            n = cache_zoo.NEW_TOKENS
            return zoo.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).shape[1] - 40
        return _per_token(mp, run)[0]
    finally:
        mp.undo()


@pytest.mark.parametrize("method", METHODS)
def test_decode_syncs_per_token(monkeypatch, zoo, plain_rate, method):
    """Every cache's decode steps cost at most plain generate's host syncs per token
    (+ :data:`EXTRA_SYNCS_PER_TOKEN`).

    Planted bug that fails it: ``KVReuseCache.update`` reads ``float(key_states.abs().max())`` on every call (a
    per-layer, per-token sync)."""
    from hf_kvreuse.compat import HAS_QUERY_OFFSET

    if method == "latent" and not HAS_QUERY_OFFSET:
        pytest.skip("latent tokens need transformers>=5.17")
    # generate's own stopping checks: one per token on transformers 5.17, two or three on 4.57 / 5.0
    assert plain_rate <= 3.0

    def run():
        r = zoo.run(method)
        return r["logits"].shape[0]

    rate, calls = _per_token(monkeypatch, run)
    assert rate <= plain_rate + EXTRA_SYNCS_PER_TOKEN, f"{method}: {rate} syncs per token ({dict(calls)})"


@pytest.mark.xfail(reason="OptimisticCache's draft steps read float()/bool() per draft token "
                          "(speculative acceptance and the swap check); their removal is under way there. Strict: "
                          "once they are removed the XPASS fails the run, and this mark must go",
                   strict=True)
def test_optimistic_draft_syncs_per_token(zoo):
    """OptimisticCache's draft steps (before the swap, the background prefill held back) cost no more host syncs
    per token than plain decoding.

    Planted bug that fails it: (currently failing, as marked) the per-draft ``float()`` of the draft statistics."""
    from hf_kvreuse import OptimisticCache, output_cache
    from hf_kvreuse.generation.background import BackgroundPrefill
    from hf_kvreuse.models.arch_zoo import agent_prompts

    m = zoo.model
    ids_a, ids_b = agent_prompts(4)
    out_a = m.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    totals = {}
    ready, BackgroundPrefill.ready = BackgroundPrefill.ready, lambda self: False
    try:
        for drafts in (2, 2, 6):
            cache = OptimisticCache(m, ids_b, output_cache(out_a), out_a.sequences, max_optimistic_tokens=drafts)
            with CountSyncs() as c:
                m.generate(ids_b, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            totals[drafts] = c.total
    finally:
        BackgroundPrefill.ready = ready
    # the same 8 tokens: 4 more of them drafts in the second run; a draft step may cost what a plain one does
    assert totals[6] - totals[2] <= 0


def test_mapper_weights_moved_once(zoo):
    """TranslatedCache's map keeps its weights on the target device after the first prompt: mapping a second
    prompt moves no weight again (counted on the ``meta`` device, which a CPU mapper must be copied to), and a
    weight changed in place is copied afresh.

    Planted bug that fails it: :meth:`KVMapper.on_device` returns ``w.to(device)`` every time (no kept copy)."""
    mapper = zoo.mapper
    weights = {id(w) for lm in mapper.layers for w in (lm.w_k, lm.b_k, lm.w_v, lm.b_v)}
    g = mapper.geometry
    feats = [(torch.empty(5, g.fs, device="meta"), torch.empty(5, g.fs, device="meta"))
             for _ in range(g.source_layers)]
    moves = []

    class Moves(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "to" and args and id(args[0]) in weights:
                moves.append(1)
            return func(*args, **(kwargs or {}))

    for expect_moves in (True, False):
        moves.clear()
        with Moves():
            for t in range(g.target_layers):
                k, v = mapper.map_layer(t, feats)
        assert k.device.type == "meta"
        assert bool(moves) == expect_moves, len(moves)
    lm = mapper.layers[0]
    with torch.no_grad():
        lm.b_k.add_(0.0)  # an in-place change bumps the version: the copy is stale
    moves.clear()
    with Moves():
        mapper.map_layer(0, feats)
    assert len(moves) == 1
