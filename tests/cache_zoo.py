"""Every cache of the library, built the same way on a tiny model, for tests that run all of them (the
Triton-backend end-to-end test on CPU, the CUDA checks of tests/test_gpu.py).

``CacheZoo(device, dtype).run(method)`` generates with ``method``'s cache from a fixed prompt and returns the
tokens, the per-step logits and the cache's ``stats.kernels``. Caches are built fresh per call (each holds one
conversation); the models, the source model's map, the latent bridge and the LoRA adapters are built once.
"""

from __future__ import annotations

import functools

import torch

from hf_kvreuse import (BaseLRCache, BlendCache, ChunkStore, DirectReuseCache, EPICCache, KVMapper,
                        LatentBridge, LatentRemedyCache, OffsetCache, OptimisticCache, TailRecomputeCache,
                        TranslatedCache, enable, output_cache)
from hf_kvreuse.compat import HAS_QUERY_OFFSET
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.models import tiny_model
from hf_kvreuse.models.arch_zoo import agent_prompts, rag_prompt

METHODS = ["direct", "blend", "epic", "tail", "offset", "optimistic", "latent", "translated", "base_lr"]
NEW_TOKENS = 6


class CacheZoo:
    """Tiny models on ``device`` / ``dtype`` and a factory of every cache over them."""

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype

    def _to(self, model):
        return model.to(device=self.device, dtype=self.dtype).eval()

    @functools.cached_property
    def model(self):
        return enable(self._to(tiny_model("llama", seed=11)))

    @functools.cached_property
    def source(self):
        """A smaller model of the same vocabulary, for TranslatedCache."""
        return self._to(tiny_model("qwen2", seed=12, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96))

    @functools.cached_property
    def mapper(self):
        g = torch.Generator().manual_seed(0)
        calib = [torch.randint(3, 128, (48,), generator=g) for _ in range(16)]
        return KVMapper.fit(self.source, self.model, calib, stride=1, progress=False)

    @functools.cached_property
    def bridge(self):
        torch.manual_seed(0)
        b = LatentBridge(self.model, n_latent=2, hidden=32)
        with torch.no_grad():
            for p in b.mlp.parameters():
                p.normal_(0, 0.3)
        return b.to(device=self.device, dtype=self.dtype)

    @functools.cached_property
    def peft_model(self):
        from peft import LoraConfig, get_peft_model

        pm = get_peft_model(tiny_model("llama", seed=13),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                       init_lora_weights=False), adapter_name="plan")
        pm.add_adapter("act", LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                         init_lora_weights=False))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return self._to(pm)

    def _ids(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def run(self, method: str) -> dict:
        """Generate with ``method``; returns ``tokens`` [1, N + new], ``logits`` [new, vocab] (float32, CPU) and
        ``kernels`` (the cache's stats)."""
        gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True)
        m = self.model
        if method == "base_lr":
            pm = self.peft_model
            g = torch.Generator().manual_seed(2)
            seq = self._ids(torch.randint(3, 128, (1, 20), generator=g))
            cache = BaseLRCache(pm, method="rebaseshared")
            pm.set_adapter("plan")
            seq = pm.generate(input_ids=seq, cache=cache, max_new_tokens=3, do_sample=False)
            seq = torch.cat([seq, self._ids(torch.randint(3, 128, (1, 7), generator=g))], 1)
            pm.set_adapter("act")
            out = pm.generate(input_ids=seq, cache=cache, **gen)
        elif method == "optimistic":
            ids_a, ids_b = (self._ids(t) for t in agent_prompts(4))
            out_a = m.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
            cache = OptimisticCache(m, ids_b, output_cache(out_a), out_a.sequences, max_optimistic_tokens=3,
                                    rebase="commit")
            # the swap waits for step 3 in every run: a background prefill done before the first step would swap
            # earlier in one run than another (exact vs donor logits: 5.4 apart on an H200), timing, not kernels
            ready, BackgroundPrefill.ready = BackgroundPrefill.ready, lambda self: False
            try:
                out = m.generate(ids_b, cache=cache, **gen)
            finally:
                BackgroundPrefill.ready = ready
        elif method == "translated":
            ids = self._ids(torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5)))
            cache = TranslatedCache(m, self.source, self.mapper, ids, recompute_ratio=0.3)
            out = m.generate(ids, cache=cache, **gen)
        else:
            ids, spans = rag_prompt(2)
            ids = self._ids(ids)
            if method == "latent":
                if not HAS_QUERY_OFFSET:
                    raise RuntimeError("latent tokens need transformers>=5.17")
                cache = LatentRemedyCache(m, ids, spans, bridge=self.bridge, store=ChunkStore())
            elif method == "offset":
                # each block computed after another context whose last token is the block's anchor here
                prefixes = [self._ids(torch.tensor([7, 9, int(ids[0, s - 1])])) for s, _ in spans]
                cache = OffsetCache(m, ids, spans, block_prefix_ids=prefixes)
            else:
                cls, kw = {"direct": (DirectReuseCache, {}), "blend": (BlendCache, {"recompute_ratio": 0.3}),
                           "epic": (EPICCache, {}), "tail": (TailRecomputeCache, {})}[method]
                cache = cls(m, ids, spans, **kw)
            out = m.generate(ids, cache=cache, **gen)
        return dict(tokens=out.sequences.cpu(), logits=torch.cat(out.logits).float().cpu(),
                    kernels=cache.stats.kernels, cache=cache)
