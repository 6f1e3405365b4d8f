"""Measured kernel dispatch under ``HF_KVREUSE_KERNELS=auto`` (:mod:`hf_kvreuse.dispatch`), on CPU with Triton's
interpreter and a fake clock: each path advances the clock by its planted cost."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import json

import pytest
import torch

pytest.importorskip("triton")

from hf_kvreuse import dispatch, kernels  # noqa: E402
from hf_kvreuse.rope import RopeShifter  # noqa: E402
from hf_kvreuse.triton import lowrank_attention as la  # noqa: E402
from hf_kvreuse.triton import rope_rebase as rr  # noqa: E402

from test_kernel_lowrank_attention import _inputs as _lr_inputs  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Rotary:
    def __init__(self, rot):
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def costs(monkeypatch, clock):
    """Planted costs (seconds per call) of the rope_rebase and lowrank_attention paths; ``calls`` counts them."""
    cost = dict(torch=5.0, triton=1.0, calls=[])
    for mod, names in ((rr, ("rope_rebase_torch", "rope_rebase_triton")),
                       (la, ("lowrank_attention_torch", "lowrank_attention_triton"))):
        for name in names:
            orig = getattr(mod, name)
            which = name.rsplit("_", 1)[1]

            def wrapped(*a, _orig=orig, _which=which, **k):
                cost["calls"].append(_which)
                clock.t += cost[_which] if not callable(cost[_which]) else cost[_which](a)
                return _orig(*a, **k)

            monkeypatch.setattr(mod, name, wrapped)
    return cost


def _install(monkeypatch, tmp_path, clock, **kw):
    d = dispatch.Dispatcher(clock=clock, sync=lambda dev: None, warmup=1, reps=3, folder=tmp_path,
                            measure_cpu=True, **kw)
    monkeypatch.setattr(dispatch, "_DISPATCHER", d)
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return d


def _rope_case(T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(1, 2, T, 32, generator=g)
    return src, torch.arange(T) - 2, RopeShifter(_Rotary(32), layout="half")


def _run_rope(src, delta, sh):
    dst = torch.empty_like(src)
    kernels.rope_rebase(dst, src, delta, sh)
    return dst


def test_faster_path_chosen(monkeypatch, tmp_path, clock, costs):
    """The first call of a (kernel, dtype, bucket) times both paths and keeps the faster: Triton when the clock
    says it is faster, torch when it says torch is; the call's result equals the torch reference either way; later
    calls in the same bucket do not measure again; lowrank attention with decode-sized queries (slow kernel) and
    prefill-sized ones (fast kernel) get their own choices.

    Planted bug that fails it: :meth:`Dispatcher.measure` keeps the slowest path (``max`` for ``min``)."""
    d = _install(monkeypatch, tmp_path, clock)
    src, delta, sh = _rope_case()
    want = torch.empty_like(src)
    rr.rope_rebase_torch(want, src, delta, sh)
    got = _run_rope(src, delta, sh)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    choice = d.choices("cpu")["rope_rebase|float32|1x2x8x32"]
    assert choice.backend == "triton" and choice.seconds == {"torch": 5.0, "triton": 1.0}
    costs["calls"].clear()
    _run_rope(*_rope_case(T=7, seed=1))  # same bucket (7 -> 8): no measuring, one triton call
    assert costs["calls"] == ["triton"]

    costs.update(torch=1.0, triton=5.0)
    d = _install(monkeypatch, tmp_path / "other", clock)
    assert torch.equal(_run_rope(src, delta, sh), want)
    assert d.choices("cpu")["rope_rebase|float32|1x2x8x32"].backend == "torch"

    # lowrank attention: the kernel slower than torch for one query row, faster for 32
    costs.update(torch=2.0, triton=lambda a: 3.0 if a[0].shape[2] <= 4 else 1.0)
    d = _install(monkeypatch, tmp_path / "lr", clock)
    for q in (1, 32):
        args = _lr_inputs(1, 4, 2, q, 40, 16, 4, torch.float32, seed=q)
        got = kernels.lowrank_attention(*args, None, 0.25)
        torch.testing.assert_close(got, la.lowrank_attention_torch(*args, None, 0.25), atol=1e-5, rtol=1e-4)
    picks = {k: c.backend for k, c in d.choices("cpu").items() if k.startswith("lowrank")}
    assert sorted(picks.values()) == ["torch", "triton"], picks


def test_failing_path_never_chosen(monkeypatch, tmp_path, clock, costs):
    """A Triton path that raises, or whose result differs from the torch reference, is never chosen however fast
    the clock says it is; the reason is kept with the choice, and the call still returns the reference result.

    Planted bug that fails it: :meth:`Dispatcher.measure` skips the comparison with the reference
    (``why = None``)."""
    src, delta, sh = _rope_case()
    want = torch.empty_like(src)
    rr.rope_rebase_torch(want, src, delta, sh)
    costs.update(torch=5.0, triton=0.1)
    orig = rr.rope_rebase_triton

    def wrong(dst, *a, **k):
        orig(dst, *a, **k)
        dst.add_(1e-2)

    def broken(*a, **k):
        raise RuntimeError("out of shared memory")

    for bad, why in ((wrong, "differs from the torch reference"), (broken, "RuntimeError: out of shared memory")):
        monkeypatch.setattr(rr, "rope_rebase_triton", bad)
        d = _install(monkeypatch, tmp_path / why[:5], clock)
        assert torch.equal(_run_rope(src, delta, sh), want)
        choice = d.choices("cpu")["rope_rebase|float32|1x2x8x32"]
        assert choice.backend == "torch" and "triton" not in choice.seconds
        assert choice.refused["triton"].startswith(why)


def test_choices_file_keyed_and_invalidated(monkeypatch, tmp_path, clock, costs):
    """The choice is written to a JSON file named after the environment and read back by a fresh process
    (dispatcher) without measuring; another environment (torch version, GPU, library) measures again; a file
    whose recorded environment or entries do not verify is ignored (measured again and rewritten), and so is a
    choices file that is a link to a file outside the folder.

    Planted bug that fails it: :meth:`Dispatcher._read` drops the comparison of the file's recorded environment
    (``doc.get("environment") != env``)."""
    src, delta, sh = _rope_case()
    d = _install(monkeypatch, tmp_path, clock)
    _run_rope(src, delta, sh)
    name, env = d._env(torch.device("cpu"))
    path = tmp_path / name
    doc = json.loads(path.read_text())
    assert doc["environment"] == env and doc["choices"]["rope_rebase|float32|1x2x8x32"]["backend"] == "triton"

    costs["calls"].clear()
    _install(monkeypatch, tmp_path, clock)
    _run_rope(src, delta, sh)
    assert costs["calls"] == ["triton"]  # read back: no measuring

    # another environment: another file, measured again
    real_env = dispatch.environment
    monkeypatch.setattr(dispatch, "environment", lambda dev: {**real_env(dev), "torch": "9.9"})
    costs["calls"].clear()
    d2 = _install(monkeypatch, tmp_path, clock)
    _run_rope(src, delta, sh)
    assert "torch" in costs["calls"] and d2._env(torch.device("cpu"))[0] != name
    monkeypatch.setattr(dispatch, "environment", real_env)

    # a file under the right name claiming another environment, or with a bad entry: ignored and rewritten
    for tamper in (lambda doc: doc["environment"].update(device_name="NVIDIA H200"),
                   lambda doc: doc["choices"]["rope_rebase|float32|1x2x8x32"].update(backend="cuda")):
        doc = json.loads(path.read_text())
        doc["choices"]["rope_rebase|float32|1x2x8x32"]["backend"] = "torch"
        tamper(doc)
        path.write_text(json.dumps(doc))
        costs["calls"].clear()
        d3 = _install(monkeypatch, tmp_path, clock)
        _run_rope(src, delta, sh)
        assert costs["calls"][-1] == "triton" and "torch" in costs["calls"]
        assert d3.choices("cpu")["rope_rebase|float32|1x2x8x32"].backend == "triton"
        assert json.loads(path.read_text())["environment"] == env

    # a link leading out of the folder is not read
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    doc = json.loads(path.read_text())
    doc["choices"]["rope_rebase|float32|1x2x8x32"]["backend"] = "torch"
    outside.write_text(json.dumps(doc))
    path.unlink()
    path.symlink_to(outside)
    costs["calls"].clear()
    d4 = _install(monkeypatch, tmp_path, clock)
    assert d4._read(name, env) == {}
    _run_rope(src, delta, sh)
    assert "torch" in costs["calls"] and d4.choices("cpu")["rope_rebase|float32|1x2x8x32"].backend == "triton"


def test_frozen_modes_do_not_measure(monkeypatch, tmp_path, clock, costs):
    """``HF_KVREUSE_KERNELS=torch`` and ``=triton`` run their backend without measuring or recording anything.

    Planted bug that fails it: :func:`kernels.measured` measures whatever the mode (drops ``mode() != "auto"``)."""
    d = _install(monkeypatch, tmp_path, clock)
    src, delta, sh = _rope_case()
    for forced in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", forced)
        costs["calls"].clear()
        _run_rope(src, delta, sh)
        assert costs["calls"] == [forced]
    assert d.choices("cpu") == {} and not list(tmp_path.glob("*.json"))


def test_stats_report_the_measured_choices(monkeypatch, tmp_path, clock, costs):
    """A cache generated under measured ``auto`` reports, in ``stats.kernels``, the backend each kernel ran on
    (``"auto(rope_rebase=triton, ...)"``), and its tokens equal the torch backend's.

    Planted bug that fails it: ``KVReuseCache.end_generate`` does not call ``refresh_kernels`` (the stats keep
    ``"auto"``)."""
    from hf_kvreuse import DirectReuseCache, enable
    from hf_kvreuse.models import tiny_model
    from hf_kvreuse.models.arch_zoo import rag_prompt

    model = enable(tiny_model("llama"))
    ids, spans = rag_prompt(1)
    runs = {}
    for name in ("torch", "auto"):
        _install(monkeypatch, tmp_path / name, clock)
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        cache = DirectReuseCache(model, ids, spans)
        runs[name] = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False), cache.stats.kernels
    assert runs["torch"][1] == "torch"
    assert runs["auto"][1].startswith("auto(") and "rope_rebase=triton" in runs["auto"][1], runs["auto"][1]
    assert torch.equal(runs["auto"][0], runs["torch"][0])


def test_tile_variant_chosen_when_fastest(monkeypatch, tmp_path, clock):
    """Selected-row attention's tile variants are measured beside the default tiles and torch: the variant the
    clock says is fastest is kept, and the real call runs the kernel with that variant's tiles (its result equal
    to the torch reference); a variant that differs from the reference is refused.

    Planted bug that fails it: :func:`kernels.selected_attention` runs a chosen variant with the default tiles
    (``run_triton(out)`` for every ``"triton..."`` choice)."""
    from hf_kvreuse.triton import selected_attention as sa

    d = _install(monkeypatch, tmp_path, clock)
    seen = []
    orig_t, orig_b = sa.selected_attention_triton, sa.selected_attention_blocked
    cost = {(None, None): 3.0, (16, None): 1.0, (None, 32): 2.0}

    def triton(*a, block_m=None, block_n=None, **k):
        seen.append((block_m, block_n))
        clock.t += cost[(block_m, block_n)]
        out = orig_t(*a, block_m=block_m, block_n=block_n, **k)
        return out.add_(1.0) if (block_m, block_n) == (None, 32) else out  # a wrong variant

    def blocked(*a, **k):
        clock.t += 5.0
        return orig_b(*a, **k)

    monkeypatch.setattr(sa, "selected_attention_triton", triton)
    monkeypatch.setattr(sa, "selected_attention_blocked", blocked)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (5, 9, 9))
    pos = sa.SelectedPositions(torch.tensor([1, 3, 4, 6, 8]), torch.arange(9))
    got = kernels.selected_attention(q, k, v, pos, 0.25)
    qp, kp, kvalid = pos.on(q.device)
    want = orig_b(q, k, v, qp, kp, 0.25, kvalid, plan=pos.plan(q.device))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    choice = next(c for key, c in d.choices("cpu").items() if key.startswith("selected_attention"))
    assert choice.backend == "triton:bm16" and "triton:bn32" in choice.refused, choice
    assert seen[-1] == (16, None)
