"""The online guard of policy "fast" (hf_kvreuse.guard): what counts as unclean, and the mode it allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvreuse.guard import DivergenceGuard, GuardConfig, unclean_under_gate


def _verify(accepted, rejected, margins):
    return dict(rebase="verify", accepted_tokens=accepted, rejected_tokens=rejected, draft_margins=margins)


def test_unclean_under_gate_cases():
    """Planted bug: ``unclean_under_gate`` tests ``gated >= accepted`` (a gate firing AT the wrong draft would count
    it as emitted) -> the second assert fails."""
    assert unclean_under_gate(_verify(2, 1, [0.9, 0.9, 0.9]), 0.5) is True     # wrong draft 2, no gate before
    assert unclean_under_gate(_verify(2, 1, [0.9, 0.9, 0.2]), 0.5) is False    # the gate fires at the wrong draft
    assert unclean_under_gate(_verify(2, 1, [0.1, 0.9, 0.9]), 0.5) is False    # the gate fired at token 0
    assert unclean_under_gate(_verify(3, 0, [0.9, 0.9, 0.9]), 0.5) is False    # every draft kept
    assert unclean_under_gate(_verify(0, 0, []), 0.5) is None                  # no drafts: nothing learnt
    assert unclean_under_gate(dict(rebase="commit", divergent_tokens=2), 0.5) is True
    assert unclean_under_gate(dict(rebase="commit", divergent_tokens=0), 0.5) is False
    assert unclean_under_gate(dict(rebase="commit", divergent_tokens=None), 0.5) is None
    assert unclean_under_gate({}, 0.5) is None


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.integers(0, 8), st.integers(0, 3), st.lists(st.floats(0, 1), min_size=0, max_size=12),
       st.floats(0, 1))
def test_unclean_matches_a_step_by_step_replay(accepted, rejected, margins, gate):
    """The closed form equals a replay of commit + gate step by step: emit drafts while the margin is >= gate;
    unclean when the emitted ones include the first withdrawn draft (index ``accepted``)."""
    got = unclean_under_gate(_verify(accepted, rejected, margins), gate)
    if accepted + rejected == 0:
        assert got is None
        return
    emitted_wrong = False
    for i in range(accepted + rejected):
        if i < len(margins) and margins[i] < gate:
            break   # this step's token comes from the exact cache, and every later one
        if rejected and i == accepted:
            emitted_wrong = True
            break
    assert got is emitted_wrong


def test_guard_trips_to_verify_and_recovers():
    """The window: a key trips when more than ``max_unclean`` of its last ``window`` calls were unclean and returns
    to commit once they leave the window. Planted bug: ``decide`` compares ``bad >= max_unclean`` -> the second
    assert fails."""
    g = DivergenceGuard(GuardConfig(gate=0.5, window=4, max_unclean=1, cooldown=2))
    assert g.decide("critic")[0] == "commit"
    bad, good = dict(rebase="commit", divergent_tokens=1), dict(rebase="commit", divergent_tokens=0)
    g.record("critic", bad)
    assert g.decide("critic")[0] == "commit"          # one unclean call of four is allowed
    g.record("critic", bad)
    assert g.decide("critic")[0] == "verify"          # two: tripped
    assert g.decide("writer")[0] == "commit"          # per agent
    clean_verify = _verify(3, 0, [0.9, 0.9, 0.9])
    g.record("critic", clean_verify)                  # cooldown 2 -> 1; window [bad, bad, clean]
    assert g.decide("critic")[0] == "verify"
    g.record("critic", clean_verify)                  # cooldown 1 -> 0; window [bad, bad, clean, clean]
    assert g.decide("critic")[0] == "verify"          # still two unclean in the window
    g.record("critic", clean_verify)                  # window [bad, clean, clean, clean]
    assert g.decide("critic")[0] == "commit"
    s = g.summary()["critic"]
    assert s["calls"] == 5 and s["unclean"] == 2 and s["mode"] == "commit"


@pytest.mark.parametrize("kw", [dict(gate=1.5), dict(window=0), dict(max_unclean=8, window=8), dict(cooldown=-1)])
def test_guard_config_validates(kw):
    with pytest.raises(ValueError, match="GuardConfig"):
        GuardConfig(**kw)


def test_guard_cooldown_holds_verify_after_the_window_is_clean():
    """A tripped key stays on verify for ``cooldown`` recorded calls even when its window is clean again. Planted
    bug: ``record`` never sets the cooldown -> the third ``"verify"`` assert fails (the window alone allows
    commit)."""
    g = DivergenceGuard(GuardConfig(gate=0.5, window=2, max_unclean=0, cooldown=3))
    g.record("a", dict(rebase="commit", divergent_tokens=3))
    assert g.decide("a")[0] == "verify"
    clean = _verify(4, 0, [0.9] * 4)
    g.record("a", clean)                       # window [bad, clean]
    assert g.decide("a")[0] == "verify"
    g.record("a", clean)                       # window [clean, clean], cooldown 3 -> 1
    assert g.decide("a")[0] == "verify"
    g.record("a", clean)                       # cooldown 1 -> 0
    assert g.decide("a")[0] == "commit"
