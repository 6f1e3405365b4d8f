"""Reading caches, sessions and stats: one-line reprs, every stats field documented in its docstring's
"Attributes" section, and ``new_tokens`` counted the same way by every object that reports it."""

import dataclasses
import inspect
import re

import pytest
import torch

import hf_kvreuse
from hf_kvreuse import ReuseSession
from hf_kvreuse.persist import DiskTier

from cache_zoo import METHODS, CacheZoo
from conftest import agent_prompts

STATS = [hf_kvreuse.OptimisticStats, hf_kvreuse.BlockReuseStats, hf_kvreuse.LatentRemedyStats,
         hf_kvreuse.TranslatedStats, hf_kvreuse.BaseLRStats, hf_kvreuse.TurnStats, hf_kvreuse.SessionStats, DiskTier,
         hf_kvreuse.ChunkStore]


@pytest.fixture(scope="module")
def zoo():
    return CacheZoo()


@pytest.mark.parametrize("cls", STATS, ids=lambda c: c.__name__)
def test_every_stats_field_is_documented(cls):
    """Each public dataclass field is named in the class docstring's numpy "Attributes" section (fields inherited
    from a documented base class count)."""
    names = set()
    for klass in cls.__mro__:
        doc = inspect.getdoc(klass) or ""
        if "Attributes\n----------" in doc:
            section = doc.split("Attributes\n----------", 1)[1]
            for line in section.splitlines():
                m = re.match(r"^([a-z_][a-z0-9_, ]*) :", line)
                if m:
                    names.update(n.strip() for n in m.group(1).split(","))
    fields = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    fields -= {"path", "max_bytes", "disk"} if cls in (DiskTier, hf_kvreuse.ChunkStore) else set()
    assert fields <= names, f"{cls.__name__}: undocumented {sorted(fields - names)}"


@pytest.mark.parametrize("method", METHODS)
def test_cache_repr(zoo, method):
    if method == "latent" and not hf_kvreuse.compat.HAS_QUERY_OFFSET:
        pytest.skip("latent tokens need transformers>=5.17")
    cache = zoo.run(method)["cache"]
    text = repr(cache)
    assert text.startswith(type(cache).__name__ + "(") and "\n" not in text
    for part in ("phase='done'", "tokens=", "layers=4", "kv=", "B"):
        assert part in text, text
    assert "DynamicLayer" not in text
    assert repr(cache.stats).startswith(type(cache.stats).__name__ + "(") and len(repr(cache.stats)) < 800


def test_session_repr_and_new_tokens_one_meaning(llama):
    """``new_tokens`` is one count everywhere: the prompt tokens computed before the first token, the last prompt
    token included. A session's call reports the same number as its cache's stats, and exact prefix + donor rows +
    new tokens add up to the prompt.

    Planted bug that fails it: ``OptimisticCache._assemble`` records ``new_tokens`` without the last prompt token
    (the count before this fix: SessionStats said 3 where cache_stats said 2); the session does not subtract the
    repaired rows from ``donor_tokens`` (the sum exceeds the prompt by them)."""
    s = ReuseSession(llama, policy="optimistic", min_donor_tokens=8)
    assert "calls=0" in repr(s) and "held=0 caches" in repr(s)
    ids_a, ids_b = agent_prompts(3)
    s.generate(ids_a, agent="a", max_new_tokens=4, do_sample=False)
    s.generate(ids_b, agent="b", max_new_tokens=4, do_sample=False)
    st = s.last_stats
    assert st.method == "optimistic"
    assert st.new_tokens == st.cache_stats["new_tokens"]
    assert st.exact_prefix_tokens + st.donor_tokens + st.new_tokens == st.prompt_tokens
    assert st.cache_stats["reused_tokens"] + st.cache_stats["new_tokens"] == st.prompt_tokens
    for policy in ("full", "prefix", "blend"):
        s2 = ReuseSession(llama, policy=policy)
        s2.generate(ids_a, max_new_tokens=4, do_sample=False)
        s2.generate(torch.cat([ids_a, ids_b], 1), max_new_tokens=4, do_sample=False)
        t = s2.last_stats
        assert t.exact_prefix_tokens + t.donor_tokens + t.new_tokens == t.prompt_tokens, policy
    # repair= recomputes donor rows before the first token: they count as new, no longer as reused / donor rows
    s3 = ReuseSession.for_method(llama, "auto-commit-repair", min_donor_tokens=8)
    s3.generate(ids_a, agent="a", max_new_tokens=4, do_sample=False)
    s3.generate(ids_b, agent="b", max_new_tokens=4, do_sample=False)
    r = s3.last_stats
    assert r.method == "optimistic" and r.cache_stats["repaired_tokens"] > 0
    assert r.new_tokens == r.cache_stats["new_tokens"] == st.new_tokens + r.cache_stats["repaired_tokens"]
    assert r.exact_prefix_tokens + r.donor_tokens + r.new_tokens == r.prompt_tokens
    assert r.cache_stats["reused_tokens"] + r.cache_stats["new_tokens"] == r.prompt_tokens
    text = repr(s)
    assert text.startswith("ReuseSession(policy='optimistic'") and "calls=2" in text and "held=2 caches" in text
    assert f"{st.new_tokens} new" in text and "max_bytes=2 GiB" in text
    assert f"cache_stats={{...{len(st.cache_stats)} fields}}" in repr(st) and "held_bytes=" in repr(st)


def test_floor_counts_new_tokens_the_same_way(llama):
    """``timing.floor_seconds`` takes ``new_tokens`` as the stats report it (the last prompt token included)."""
    from hf_kvreuse.timing import floor_seconds

    from conftest import exact_prefill

    ids = agent_prompts(1)[0]
    cache, _ = exact_prefill(llama, ids[:, :-1])
    assert floor_seconds(llama, ids, cache, 1) > 0 and floor_seconds(llama, ids, cache, 5) > 0
    with pytest.raises(ValueError, match="new_tokens"):
        floor_seconds(llama, ids, cache, 0)


def test_store_repr(llama, tmp_path):
    from hf_kvreuse import ChunkStore

    store = ChunkStore(disk=DiskTier(tmp_path))
    store.get_or_compute(llama, torch.arange(3, 19))
    text = repr(store)
    assert text.startswith("ChunkStore(chunks=1, nbytes=") and "misses=1" in text
    assert "DiskTier(path=" in text and "chunks=1" in text and "writes=1" in text
