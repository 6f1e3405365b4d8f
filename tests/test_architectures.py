"""Every cache on every decoder-only architecture of the zoo: exact, or refused at construction. Never wrong.

For each architecture of :mod:`hf_kvreuse.models.arch_zoo` (tiny random-init configs of the installed transformers) and
each check of :data:`hf_kvreuse.models.arch_zoo.CHECKS` (self-control of every block cache, full recompute, layer-0
re-positioning of standalone blocks and of an OptimisticCache's donor rows), the cache either reproduces the
model (tokens and logits, or layer-0 K/V) or its constructor raises a ``ValueError`` naming the model. A refusal
must also be explained by the model check: a cache may refuse only a model whose probe failed for a mechanism
the cache relies on. ``python scripts/arch_table.py`` prints the resulting table (docs/ARCHITECTURES.md).
"""

import functools

import pytest
import torch
import transformers


from hf_kvreuse import enable
from hf_kvreuse.compat import TRANSFORMERS_VERSION
from hf_kvreuse.models.arch_zoo import CHECKS, SPECS, run_check, zoo_configs, zoo_model
from hf_kvreuse.model_check import check_model

ARCHS = sorted(zoo_configs())
#: no RoPE at all (learned absolute positions or ALiBi): every cache must refuse them
NO_ROPE = {"gpt2", "opt", "bloom", "gpt_bigcode", "biogpt", "xglm"}
#: the Llama-layout models every cache must accept (half-split or interleaved, full or partial rotary)
#: the release the full suite runs on (the version legs run the fast tests on older ones)
NEWEST = TRANSFORMERS_VERSION >= (5, 24)
MUST_WORK = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "stablelm", "cohere", "glm",
             "olmo", "olmo2", "starcoder2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4", "nemotron"}
#: which probes of model_check each check's cache relies on (BlendCache drives the decoder layers itself)
NEEDS = {c: ("rope", "engine", "layers") if c.startswith("blend") else ("rope", "engine") for c in CHECKS}

#: known library bugs: (arch, check) -> reason; the test is xfail(strict=True) until they are fixed
KNOWN_BUGS: dict = {}
UNNAMED_REFUSALS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (50x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: what transformers' builder raises for a model it cannot build on this release (unknown model type, a config
#: field it lacks, sdpa not offered, a missing optional package)
BUILD_ERRORS = (ImportError, KeyError, ValueError, TypeError, AttributeError, NotImplementedError)


@functools.lru_cache(maxsize=None)
def _build(arch):
    """Only the model builder's own errors make a skip, and never for MUST_WORK on the newest tested release (an
    older release may lack a model's config fields: e.g. StableLM's ``pad_token_id`` on transformers 5.0);
    ``enable`` (library code) runs outside the ``try``: its error is a failure."""
    try:
        model = zoo_model(arch)
    except BUILD_ERRORS as e:
        if arch in MUST_WORK and NEWEST:
            raise
        return None, f"{type(e).__name__}: {str(e)[:200]}"
    return enable(model), None


def _model(arch):
    model, why = _build(arch)
    if model is None:
        pytest.skip(f"{arch} does not build on transformers {transformers.__version__}: {why}")
    return model


@functools.lru_cache(maxsize=None)
def _outcome(arch, check):
    """run_check once per (arch, check): None (exact) or the refusal message; raises on a wrong output."""
    return run_check(_model(arch), check)


def test_zoo_covers_the_required_architectures():

    if TRANSFORMERS_VERSION < (5, 24):
        pytest.skip("the zoo's configs are written for transformers 5.24 (the surveyed release); older releases "
                    f"check the {len(ARCHS)} architectures whose configs build there")
    required = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "stablelm",
                "cohere", "glm", "granite", "olmo", "olmo2", "starcoder2", "phi", "persimmon", "gpt_neox", "gptj",
                "falcon", "gpt2", "opt", "bloom", "mixtral", "qwen2_moe", "olmoe"}
    assert required <= set(ARCHS), sorted(required - set(ARCHS))
    assert len(ARCHS) >= len(SPECS) - 5  # almost every spec builds in this transformers
    for arch in ("llama", "gemma3_text", "cohere"):
        cfg = zoo_configs([arch])[arch]
        assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 4 and cfg.num_attention_heads == 4
        assert all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"])


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_or_refused(arch, check, request):
    if (arch, check) in KNOWN_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[(arch, check)]))
    model = _model(arch)
    refusal = _outcome(arch, check)  # raises AssertionError on a wrong output
    report = check_model(model)
    failed = [p for p in NEEDS[check] if not getattr(report, f"{p}_ok")]
    if refusal is None:
        assert arch not in NO_ROPE, f"{arch} has no RoPE but {check} accepted it"
        assert not failed, f"{check} accepted {arch} although the model check failed {failed}"
        return
    # a justified refusal: the model check explains it
    assert failed, f"{check} refused {arch} although every probe it relies on passed: {refusal}"
    # which models must work is surveyed on 5.24; older releases may implement a family differently (4.57's Gemma
    # scales its embeddings in the model's forward), and then a refusal is the right answer there
    if TRANSFORMERS_VERSION >= (5, 24):
        assert arch not in MUST_WORK, f"{check} refused {arch}: {refusal}"


@pytest.mark.parametrize("arch", ARCHS)
def test_refusals_name_the_model(arch, request):
    """Every refusal says which model it refuses (its class or its model_type)."""
    if arch in UNNAMED_REFUSALS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=UNNAMED_REFUSALS[arch]))
    model = _model(arch)
    for check in CHECKS:
        if (arch, check) in KNOWN_BUGS:
            continue
        refusal = _outcome(arch, check)
        if refusal is not None:
            assert type(model).__name__ in refusal or repr(model.config.model_type) in refusal, refusal
