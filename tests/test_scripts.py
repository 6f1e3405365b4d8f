"""The benchmark scripts stay runnable (smoke runs on CPU with a tiny model), keep what they measured when cut, and
the prepared GPU check keeps to its time budget."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the scripts import hf_kvreuse from this checkout (not from wherever the venv's editable install points)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "optimistic_gpu.py"), "--device", "cpu",
                           "--preset", "tiny", "--reps", "2", "--dtype", "float32", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert all(res["checks"][k] for k in ("zero_optimistic_equals_generate", "self_donor_equals_generate",
                                          "after_swap_equals_generate"))
    row = res["rows"][0]
    assert row["opt_ttft_s"] > 0 and row["full_ttft_s"] > 0 and len(row["samples"]) == 2
    assert res["complete"] is True and res["in_progress"] is None  # checkpoints: see the kernel benchmark's test


@pytest.mark.slow
@pytest.mark.bench_smoke
def test_base_lr_benchmark_smoke(tmp_path):
    """benchmarks/base_lr.py end to end on a tiny trace (shipped SmolLM2 role adapters). The timeout is generous:
    the run took a minute or two alone on a fast day, 342 s alone on 2026-12-01, and over 10 minutes next to a
    benchmark. Not in ``make test`` (which it alone would push past 15 minutes): ``make test-bench-smoke``, run by
    ``.ci/run``."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_lr.py"), "--scale", "0.02", "--repeats",
                           "1", "--items", "1", "--observation", "96", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "base_lr.json").read_text())
    rows = {r["variant"]: r for r in res["efficiency"]["rows"]}
    assert set(rows) == {"nonshared", "prelrshared", "rebaseshared/after_turn", "rebaseshared/alongside"}
    assert rows["prelrshared"]["prefill_tokens"] < rows["nonshared"]["prefill_tokens"]
    assert (tmp_path / "base_lr.png").exists() and len(res["accuracy"]["rows"]) == 4
    assert {"act_ci", "agree_ci"} <= set(res["accuracy"]["rows"][0])
    # shards join: the same shard twice gives n = 2 with the same rates
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_lr.py"), "--merge",
                           str(tmp_path / "base_lr.json"), str(tmp_path / "base_lr.json"), "--out", str(tmp_path),
                           "--tag", "joined"], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    joined = json.loads((tmp_path / "joined.json").read_text())["accuracy"]["rows"]
    assert [r["n"] for r in joined] == [2] * 4
    assert [r["act_pct"] for r in joined] == [r["act_pct"] for r in res["accuracy"]["rows"]]


GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["env", "real_scale", "gpu_kernels", "pytest_gpu", "kernels", "optimistic", "optimistic_chunked"]


def test_gpu_check_budget_is_eight_minutes():
    """The GPU check's worst case is at most 8 minutes: every step's limit plus its kill-after, plus the summary's
    reserve, within the 480 s budget (and the budget itself, which the script also enforces as a deadline).

    Planted bug that fails it: the step limits of issue 11 (60 + 200 + 150 + 90 s plus 10 s kill-afters: 9 min)."""
    text = GPU_CHECK.read_text()

    def setting(name: str, literal: str, absent: int) -> int:
        """A variable's default (``NAME=${ENV:-N}``), else a literal in the command (``--kill-after=N``)."""
        m = re.search(rf"^{name}=\$\{{\w+:-(\d+)\}}", text, re.M) or re.search(literal, text)
        return int(m.group(1)) if m else absent

    budget = setting("BUDGET_S", r"$^", 480)
    kill = setting("KILL_AFTER", r"--kill-after=(\d+)", 0)
    summary = setting("SUMMARY_S", r"$^", 0)
    steps = re.findall(r"^run_step (\w+) (\d+) ", text, re.M)
    worst = sum(int(limit) + kill for _, limit in steps) + summary
    assert budget <= 480 and worst <= budget, (worst, budget)
    assert [name for name, _ in steps] == STEPS


def _fake_python(tmp_path: Path, behaviour: str) -> Path:
    """An interpreter for the GPU check whose steps ``behaviour`` (a bash command, e.g. ``exec sleep 60``) while
    the summary (``python -``) runs on the real one."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$1" = "-" ] && exec {sys.executable} "$@"\n{behaviour}\n')
    fake.chmod(0o755)
    return fake


def test_gpu_check_cuts_steps_at_the_deadline(tmp_path):
    """Steps that hang are cut by their limits and by the budget's deadline: the check ends within its budget,
    and gpu_check.json names what ran, what was cut and why.

    Planted bug that fails it: ``run_step`` ignores the deadline (each step gets its full limit: the first
    hanging step alone outlasts the 12 s budget: its recorded ``limit_s`` exceeds the 6 s the budget leaves).
    The check asserts what the script decided (limits, cuts), not how long the run took: the wall clock depends
    on the machine's load. (The subprocess ``timeout`` only turns a hang into a failure.)"""
    out = tmp_path / "out"
    env = dict(ENV, PYTHON=str(_fake_python(tmp_path, "exec sleep 60")), GPU_CHECK_BUDGET_S="12",
               GPU_CHECK_KILL_AFTER_S="1", GPU_CHECK_SUMMARY_S="5", GPU_CHECK_MIN_STEP_S="2")
    proc = subprocess.run(["bash", str(GPU_CHECK), str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["ran"] == ["env"] and res["steps"]["env"]["outcome"] == "cut" and res["steps"]["env"]["limit_s"] <= 6
    assert [c["step"] for c in res["cut"]] == STEPS
    assert "limit" in res["cut"][0]["why"] and all("not started" in c["why"] for c in res["cut"][1:])
    assert res["complete"] == {"real_scale": None, "kernels": None, "optimistic": None, "optimistic_chunked": None}


def _killed_keeps_rows(cmd: list[str], out: Path, enough, timeout: float) -> dict:
    """Start ``cmd``, wait until its JSON ``out`` satisfies ``enough``, SIGKILL it: the JSON it leaves."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(
        ENV, TRITON_INTERPRET="1"), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if enough(json.loads(out.read_text())):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return json.loads(out.read_text())


def test_kernel_benchmark_cut_keeps_its_rows(tmp_path):
    """benchmarks/triton_kernels.py killed after its first row leaves a valid JSON with that row, marked
    incomplete (what gpu_check.sh keeps when the step hits its limit).

    Planted bug that fails it: the script writes its JSON only at the end (the code before issue 22)."""
    out = tmp_path / "kernels.json"
    res = _killed_keeps_rows([sys.executable, str(ROOT / "benchmarks" / "triton_kernels.py"), "--device", "cpu",
                              "--dtype", "fp32", "--tokens", "8", "8000", "--reps", "1", "--warmup", "0",
                              "--only", "token_deviation", "--out", str(out)], out,
                             lambda d: len(d.get("rows", [])) >= 1, timeout=120)
    assert res["complete"] is False and res["rows"][0]["tokens"] == 8 and "triton_s" in res["rows"][0]


@pytest.mark.slow
def test_gpu_check_script_without_gpu(tmp_path):
    """scripts/gpu_check.sh on a machine without a GPU: every step runs under its limit, the GPU tests are
    skipped (not failed), the exit status says the check did not pass, and gpu_check.json holds every step."""
    env = dict(ENV, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(GPU_CHECK), str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    # every step ran under a limit the 480 s budget allowed (what the script decided; its wall time is the load's)
    assert list(res["steps"]) == STEPS and all(s["limit_s"] <= 480 for s in res["steps"].values())
    assert res["steps"]["pytest_gpu"]["rc"] == 0 and res["steps"]["gpu_kernels"]["rc"] == 0 and res["tests"]
    assert all(t["outcome"] == "skipped" for t in res["tests"])
    assert "no CUDA device" in res["steps"]["kernels"]["log_tail"]


def test_gate_curve_replays_thresholds_from_verified_drafts():
    """research/optimistic/gate_curve.py: a verified call whose first wrong draft is at index 2 is clean under a gate that fires
    at step 0, 1 or 2 and unclean under one that fires later or never; a gate at the first token adds the background
    prefill to that call's TTFT; a workflow agrees only if every call is clean. Planted bug that fails it: the gate
    step compared with ``<=`` (``wrong > emitted``), which calls a gate firing exactly at the wrong draft unclean."""
    sys.path.insert(0, str(ROOT / "research" / "optimistic"))
    try:
        import gate_curve
    finally:
        sys.path.remove(str(ROOT / "research" / "optimistic"))

    def call(margins, accepted, rejected, bg=5.0):
        return dict(draft_ttft_s=1.0, stats=dict(method="optimistic", ttft_s=9.0, cache_stats=dict(
            rebase="verify", draft_margins=margins, accepted_tokens=accepted, rejected_tokens=rejected,
            background_prefill_s=bg)))

    wrong_at_2 = call([0.9, 0.8, 0.3, 0.9], 2, 2)
    assert gate_curve.call_under_gate(wrong_at_2["stats"]["cache_stats"], 0.5) == (True, 2)
    assert gate_curve.call_under_gate(wrong_at_2["stats"]["cache_stats"], 0.2) == (False, None)
    assert gate_curve.call_under_gate(wrong_at_2["stats"]["cache_stats"], 0.85) == (True, 1)
    all_right = call([0.4, 0.9], 2, 0)
    full = dict(method="full", workflow="w", context_tokens=1, question=0,
                turns=[dict(stats=dict(method="full", ttft_s=10.0))] * 2)
    verify = dict(method="auto-verify", workflow="w", context_tokens=1, question=0, turns=[wrong_at_2, all_right])
    rows = {r["gate"]: r for r in gate_curve.curve([full, verify], thresholds=(0.0, 0.5))["rows"]}
    assert rows[0.0]["agreement_lower_bound"] == 0.0 and rows[0.0]["clean_call_share"] == 0.5
    assert rows[0.5]["agreement_lower_bound"] == 1.0 and rows[0.5]["gated_at_first_token"] == 1
    assert rows[0.0]["ttft_ratio"] == 0.1 and rows[0.5]["ttft_ratio"] == (0.1 + 0.6) / 2


def test_gate_curve_replays_the_gate_on_a_repaired_cache_over_calls_with_full_prompts():
    """research/optimistic/gate_curve.py --repaired: the gate replayed on an ungated commit run's cache (``first_divergence``
    against the gated step) beside the plain optimistic cache's verified drafts, over the calls whose prompt is full
    prefill's in both runs (a call after a reply that differs from full prefill's is left out). Planted bug that
    fails it: no stop after a differing reply (the third call, whose prompt differs, counted)."""
    sys.path.insert(0, str(ROOT / "research" / "optimistic"))
    try:
        import gate_curve
    finally:
        sys.path.remove(str(ROOT / "research" / "optimistic"))

    def turn(answer, **c):
        return dict(answer=answer, stats=dict(cache_stats=c or None, ttft_s=1.0))

    def rec(method, turns):
        return dict(method=method, workflow="w", context_tokens=1, question=0, turns=turns)

    full = rec("full", [turn("a"), turn("b"), turn("c")])
    verify = rec("auto-verify", [turn("a", rebase="verify", draft_margins=[0.9, 0.1], accepted_tokens=1,
                                      rejected_tokens=1),
                                 turn("b", rebase="verify", draft_margins=[0.95], accepted_tokens=1, rejected_tokens=0),
                                 turn("c", rebase="verify", draft_margins=[0.9], accepted_tokens=1, rejected_tokens=0)])
    repair = rec("auto-commit-repair", [turn("a", draft_margins=[0.3, 0.9], first_divergence=None),
                                        turn("x", draft_margins=[0.04], first_divergence=0),
                                        turn("c", draft_margins=[0.01], first_divergence=None)])
    rows = {r["gate"]: r for r in gate_curve.repair_curve([full, verify, repair], "auto-commit-repair",
                                                          thresholds=(0.0, 0.2))["rows"]}
    assert rows[0.0] == dict(gate=0.0, calls=2, plain_clean=1, plain_gated_at_first_token=0, repaired_clean=1,
                             repaired_gated_at_first_token=0)
    assert rows[0.2] == dict(gate=0.2, calls=2, plain_clean=2, plain_gated_at_first_token=0, repaired_clean=2,
                             repaired_gated_at_first_token=1)
    with pytest.raises(SystemExit, match="no auto-commit-gate0.1-blend0.05 calls"):
        gate_curve.repair_curve([full, verify], "auto-commit-gate0.1-blend0.05")


def test_gate_probe_registers_thresholds_and_gate_curve_reports_them():
    """research/optimistic/gate_probe.py registers ``auto-commit-gate<t>`` as commit mode with ``gate=t`` and
    ``auto-commit-gate<t>-blend<r>`` / ``-epic<k>`` with that repair too (other names left alone, a threshold or
    ratio outside (0, 1] and a fractional row count refused) and research/optimistic/gate_curve.py's measured rows include every
    such run and prefix. Planted bugs that fail it: the threshold parsed as an int (``gate=0`` for ``0.2``); the
    repair suffix parsed but not passed on (a gate-only mode); the ``-unfused`` suffix parsed but not passed on."""
    from hf_kvreuse import session

    sys.path.insert(0, str(ROOT / "research" / "optimistic"))
    try:
        import gate_curve
        import gate_probe
    finally:
        sys.path.remove(str(ROOT / "research" / "optimistic"))
    try:
        assert gate_probe.register("full,prefix,auto-commit-gate0.2,auto-commit-gate.35") == [
            "auto-commit-gate0.2", "auto-commit-gate.35"]
        assert session.MODES["auto-commit-gate0.2"] == dict(policy="auto", rebase="commit",
                                                            method_kwargs=dict(gate=0.2))
        assert session.MODES["auto-commit-gate.35"]["method_kwargs"]["gate"] == 0.35
        with pytest.raises(SystemExit, match="in \\(0, 1\\]"):
            gate_probe.register("auto-commit-gate1.5")
        assert gate_probe.register("auto-commit-gate0.1-blend0.05,auto-commit-gate0.1-epic4") == [
            "auto-commit-gate0.1-blend0.05", "auto-commit-gate0.1-epic4"]
        assert session.MODES["auto-commit-gate0.1-blend0.05"]["method_kwargs"] == dict(
            gate=0.1, repair="blend", repair_ratio=0.05)
        assert session.MODES["auto-commit-gate0.1-epic4"]["method_kwargs"] == dict(
            gate=0.1, repair="epic", repair_tokens=4)
        with pytest.raises(SystemExit, match="blend repair ratio"):
            gate_probe.register("auto-commit-gate0.1-blend1.5")
        with pytest.raises(SystemExit, match="whole number"):
            gate_probe.register("auto-commit-gate0.1-epic2.5")
        assert gate_probe.register("auto-commit-gate0.2-unfused,auto-commit-gate0.1-epic4-unfused") == [
            "auto-commit-gate0.2-unfused", "auto-commit-gate0.1-epic4-unfused"]
        assert session.MODES["auto-commit-gate0.2-unfused"]["method_kwargs"] == dict(gate=0.2, fuse_first_step=False)
        assert session.MODES["auto-commit-gate0.1-epic4-unfused"]["method_kwargs"] == dict(
            gate=0.1, repair="epic", repair_tokens=4, fuse_first_step=False)
        assert "fuse_first_step" not in session.MODES["auto-commit-gate0.1-epic4"]["method_kwargs"]
    finally:
        for k in ("auto-commit-gate0.2", "auto-commit-gate.35", "auto-commit-gate1.5", "auto-commit-gate0.1-blend0.05",
                  "auto-commit-gate0.1-epic4", "auto-commit-gate0.2-unfused", "auto-commit-gate0.1-epic4-unfused"):
            session.MODES.pop(k, None)

    def rec(method, agrees, ratio):
        return dict(method=method, agrees=agrees, turns=[dict(ttft_ratio=ratio)])

    rows = {m["method"]: m for m in gate_curve.measured(
        [rec("prefix", True, 0.1), rec("auto-commit-gate0.2", True, 0.05), rec("auto-commit-gate0.2", False, 0.07),
         rec("auto-verify", True, 0.03)])}
    assert set(rows) == {"prefix", "auto-commit-gate0.2"}
    assert rows["auto-commit-gate0.2"]["agreement"] == 0.5 and abs(rows["auto-commit-gate0.2"]["ttft_ratio"] - 0.06) < 1e-12


def test_bench_table_pairs_methods_by_question():
    """scripts/bench_table.py --paired-against: a method is compared with the baseline on the questions both ran,
    matched by (workflow, context, question); wins and losses count questions where only one agrees with full.
    ``--with`` adds another run's methods, never replacing the first file's. Planted bug that fails it: pairing by
    record order instead of by question (the shuffled baseline then gives other wins / losses)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_table
    finally:
        sys.path.pop(0)

    def rec(method, q, agrees, correct):
        return dict(workflow="w", context_tokens=1000, question=q, method=method, agrees=agrees, correct=correct)

    base = [rec("base", f"q{i}", agrees=i < 6, correct=i < 3) for i in range(10)]
    other = [rec("other", f"q{i}", agrees=i < 9, correct=i < 3) for i in range(10)]
    extra = [rec("other", "q99", agrees=True, correct=True)]  # no baseline record: left out of the pairs
    result = {"records": base[::-1] + other + extra + [rec("full", "q0", True, True)]}
    lines = bench_table.paired_table(result, "base").splitlines()
    assert len(lines) == 3
    cols = [c.strip() for c in lines[2].split("|")]
    assert cols[1:3] == ["other", "10"] and cols[3].startswith("+30 [") and cols[4] == "3 / 0"
    assert cols[5].startswith("+0 [")
    with pytest.raises(SystemExit, match="has methods"):
        bench_table.paired_table(result, "nope")
    # --with: another run's methods join the pairs; a method the first file has keeps its own records
    later = {"records": [rec("new", f"q{i}", agrees=True, correct=True) for i in range(10)]
             + [rec("base", f"q{i}", agrees=True, correct=True) for i in range(10)]}
    joined = bench_table.with_methods_of(result, [later])
    rows = {line.split("|")[1].strip(): line for line in bench_table.paired_table(joined, "base").splitlines()[2:]}
    assert set(rows) == {"other", "new"} and rows["new"].split("|")[3].strip().startswith("+40 [")


def test_bench_table_ttft_against_pairs_calls_by_question_and_turn():
    """scripts/bench_table.py --ttft-against: per-call TTFT ratios at the same (workflow, context, question, turn),
    the first token decoded (``draft_ttft_s``) and the first verified one (``stats.ttft_s``); a question the
    baseline did not run is left out; ``--by-turn`` the same per turn index, with the baseline's TTFT over full's, its
    reused prompt share and the optimistic / gated-at-token-1 counts; ``--calls`` the per-method counts. Planted
    bugs that fail it: pairing by record order in ``ttft_table`` (TTFT or end to end) or in ``calls_table`` (the baseline's and full
    prefill's records are in another order here)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_table
    finally:
        sys.path.pop(0)

    def rec(method, q, ttfts, drafts=None):
        turns = [dict(stats=dict(ttft_s=t)) for t in ttfts]
        for turn, d in zip(turns, drafts or []):
            turn["draft_ttft_s"] = d
        return dict(workflow="w", context_tokens=1000, question=q, method=method, turns=turns)

    base = [rec("prefix", "q0", [1.0, 2.0]), rec("prefix", "q1", [4.0, 4.0])]
    mine = [rec("m", "q0", [1.0, 4.0], drafts=[0.5, 4.0]), rec("m", "q1", [1.0, 1.0]), rec("m", "q9", [9.0, 9.0])]
    for r, e2e in zip(base + mine, (10.0, 20.0, 15.0, 10.0, 1.0)):
        r["e2e_s"] = e2e
    lines = bench_table.ttft_table({"records": base[::-1] + mine}, "prefix").splitlines()
    cols = [c.strip() for c in lines[2].split("|")]
    # shown ratios 0.5, 2, 0.25, 0.25 -> median 0.375; medians of the times 1 / 3; 3 of 4 at <= 0.5;
    # verified ratios 1, 2, 0.25, 0.25 -> 0.625; end to end per question 15/10, 10/20 -> 1.0
    assert cols[1:8] == ["m", "4 (2)", "0.38", "0.33", "75%", "0.62", "1.00"]
    with pytest.raises(SystemExit, match="has methods"):
        bench_table.ttft_table({"records": mine}, "prefix")
    # --by-turn: per turn index, over the questions full, prefix and the method all ran
    full = [rec("full", "q0", [10.0, 10.0]), rec("full", "q1", [8.0, 20.0])]
    for r, reused in zip(base, (0.0, 0.5)):
        for t in r["turns"]:
            t["stats"].update(prompt_tokens=100, new_tokens=int(100 * (1 - reused)))
    mine[0]["turns"][0]["stats"].update(method="optimistic", cache_stats=dict(gated_step=0, repaired_tokens=2))
    mine[1]["turns"][0]["stats"].update(method="optimistic", cache_stats=dict(gated_step=3, repaired_tokens=6))
    rows = [[c.strip() for c in line.split("|")][1:8]
            for line in bench_table.ttft_by_turn({"records": full + base[::-1] + mine}, "prefix").splitlines()[2:]]
    # turn 0: ratios 0.5 and 0.25, prefix / full 0.1 and 0.5; turn 1: ratios 2 and 0.25, prefix / full 0.2 and 0.2;
    # prefix reused 0% of q0's prompts and 50% of q1's
    assert rows == [["m", "0", "2", "0.38", "0.30", "25.0%", "2 (1)"],
                    ["m", "1", "2", "1.12", "0.20", "25.0%", "0 (0)"]]
    with pytest.raises(SystemExit, match="needs 'full'"):
        bench_table.ttft_by_turn({"records": base + mine}, "prefix")
    # --calls: replies equal to full's by question and turn, optimistic / gated / repaired counts
    for r, answers in zip(full + mine, (["a", "b"], ["c", "d"], ["a", "x"], ["c", "d"], ["z", "z"])):
        for t, a in zip(r["turns"], answers):
            t["answer"] = a
    calls = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")][2:6]
             for line in bench_table.calls_table({"records": full[::-1] + mine}).splitlines()[2:]}
    assert calls == {"m": ["3/4", "2", "2 (1)", "4"]}


def test_assembly_profile_times_the_unmatched_rows_and_restores_partial_forward(tmp_path):
    """research/performance/assembly_profile.py on a tiny model, both modes: every call computes the 25 new rows (two forwards:
    24 in the assembly, the last fed by generate; fused: all in the first step), the timed ``partial_forward`` is
    part of the assembly only in the first mode, and the library's
    ``partial_forward`` is the original again afterwards. Planted bug that fails it: the timing wrapper left
    installed (no ``finally``)."""
    import hf_kvreuse.cache_classes.optimistic as optimistic
    import hf_kvreuse.generation.fused as fused

    sys.path.insert(0, str(ROOT / "research" / "performance"))
    try:
        import assembly_profile
    finally:
        sys.path.remove(str(ROOT / "research" / "performance"))
    original = optimistic.partial_forward
    out = tmp_path / "p.json"
    assembly_profile.main(["--model", "tiny", "--reps", "2", "--out", str(out)])
    assert optimistic.partial_forward is original and fused.partial_forward is original
    r = json.loads(out.read_text())
    assert set(r["forward_over_prefix_s"]) == {"1", "25", "66"}
    assert {m: len(c) for m, c in r["calls"].items()} == {"two_forwards": 2, "fused": 2}
    for mode, calls in r["calls"].items():
        for c in calls:
            assert c["new_tokens"] == 25 and c["prefix_tokens"] == 1090  # 15 + 10 new rows, the last one fed
            if mode == "two_forwards":
                assert 0 < c["partial_forward_s"] <= c["assemble_s"] <= c["ttft_s"]
            else:  # the unmatched rows' forward is the first step's, after the assembly
                assert c["assemble_s"] < c["ttft_s"] and 0 < c["partial_forward_s"] <= c["ttft_s"]
    assert r["median"]["fused_over_two_forwards_ttft"] > 0


def test_latent_ablation_table_pairs_by_dev_example(tmp_path, capsys):
    """research/latent/latent_ablation_table.py --paired-against: held-out rows are matched by (family, record, direction),
    training-family rows are left out of the difference; two runs over the same sequence of examples (a dev folder
    of two seeds: keys repeat) pair row by row. Planted bugs that fail it: pairing by row order always (the
    reference's rows reversed then give the same mean difference with another interval); pairing by key always
    (the repeated keys collapse: n=10, not 20)."""
    sys.path.insert(0, str(ROOT / "research" / "latent"))
    try:
        import latent_ablation_table
    finally:
        sys.path.pop(0)

    def run(name, ok_held, ok_train):
        rows = [dict(family="retrieval", record=i, direction="a->b", ok=ok_held(i)) for i in range(10)]
        rows += [dict(family="prices", record=i, direction="a->b", ok=ok_train) for i in range(10)]
        dev = {f: dict(n=10, full_acc=0.9, reuse_acc=0.1, acc=0.5, kl=0.1) for f in ("retrieval", "prices")}
        d = dict(config=dict(n_latent=8, read="last", layers=[-1], hidden=256, tail_tokens=0),
                 bridge=dict(step=1, stage_cpu_s={}), dev=dev, dev_rows={"bridge": rows})
        path = tmp_path / f"latent_ablation_{name}.json"
        path.write_text(json.dumps(d))
        return d, str(path)

    ref, ref_path = run("ref", lambda i: i < 3, True)
    ref["dev_rows"]["bridge"].reverse()
    (tmp_path / "latent_ablation_ref.json").write_text(json.dumps(ref))
    _, other_path = run("other", lambda i: i < 6, False)
    latent_ablation_table.main(["--paired-against", ref_path, other_path])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # by example: 3 right in both, 3 only in `other` -> +30 [+1, +51]; by row order it would be +30 [-26, +70]
    assert last.split("|")[-2].strip() == "+30 [+1, +51] (n=10)"
    # one dev folder with records of two seeds (keys repeat), the same order in both runs: paired row by row, all 20
    ref2, ref2_path = run("ref2", lambda i: i < 3, True)
    two = lambda d: d["dev_rows"]["bridge"][:10] * 2  # noqa: E731
    ref2["dev_rows"]["bridge"] = two(ref2)
    (tmp_path / "latent_ablation_ref2.json").write_text(json.dumps(ref2))
    other2, other2_path = run("other2", lambda i: i < 6, False)
    other2["dev_rows"]["bridge"] = two(other2)
    (tmp_path / "latent_ablation_other2.json").write_text(json.dumps(other2))
    latent_ablation_table.main(["--paired-against", ref2_path, other2_path])
    assert capsys.readouterr().out.strip().splitlines()[-1].split("|")[-2].strip().endswith("(n=20)")


def test_bench_table_same_questions_pairs_two_settings_by_question():
    """scripts/bench_table.py --same-questions: a method's agreement here and in another run, over the questions
    both ran (others left out), paired. Planted bug that fails it: pairing the two runs' records by order."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_table
    finally:
        sys.path.pop(0)

    def rec(method, q, agrees):
        return dict(workflow="w", context_tokens=1000, question=q, method=method, agrees=agrees, correct=agrees)

    here = {"records": [rec("full", f"q{i}", True) for i in range(6)] + [rec("m", f"q{i}", i < 2) for i in range(6)]}
    other = {"records": [rec("full", f"q{i}", True) for i in range(10)]
             + [rec("m", f"q{i}", i >= 4) for i in reversed(range(10))] + [rec("only_there", "q0", True)]}
    lines = bench_table.same_questions_table(here, other, "16 tokens").splitlines()
    assert len(lines) == 3
    cols = [c.strip() for c in lines[2].split("|")]
    # here q0, q1 agree; there q4, q5 (of q0-q5): -0 difference overall, but 2/6 vs 2/6 on other questions
    assert cols[1:5] == ["m", "6", "2/6", "2/6"] and cols[5].startswith("+0 [")
    with pytest.raises(SystemExit, match="full prefill"):
        bench_table.same_questions_table(here, {"records": [rec("m", "q0", True)]}, "x")


def test_gpu_table_reads_a_gpu_check():
    """scripts/gpu_table.py renders the committed gpu_check.json: test counts per step (the failed ones named),
    every kernel at every length (bandwidth only for memory-bound ones), OptimisticCache's rows. Planted bug that
    fails it: cells looked up by row order instead of (kernel, tokens) (the rows are interleaved by length)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_table.py"),
                          str(ROOT / "benchmarks" / "results" / "gpu" / "gpu_check.json")],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads((ROOT / "benchmarks" / "results" / "gpu" / "gpu_check.json").read_text())
    n_fail = sum(t["outcome"] == "failed" for t in doc["tests"])
    assert out.count("- failed: ") == n_fail
    rope = {r["tokens"]: r for r in doc["kernels"]["rows"] if r["kernel"] == "rope_rebase"}
    line = next(ln for ln in out.splitlines() if ln.startswith("| rope_rebase |"))
    assert [c.strip() for c in line.split("|")[2:-1]] == [
        f"{rope[t]['speedup']:.2f}x; {100 * rope[t]['peak_fraction']:.0f} %" for t in sorted(rope)]
    assert "| lowrank_attention_prefill |" in out and "; " not in next(
        ln for ln in out.splitlines() if ln.startswith("| lowrank_attention_prefill |"))
    assert out.count("| optimistic | ") == len(doc["optimistic"]["rows"])


def test_latent_rows_probe_table_scores_selections_against_full_prefill():
    """research/latent/latent_rows_probe.py --table: accuracy counts an example only where full prefill is right and the
    selection agrees with it; "recovered" is against direct reuse's accuracy on the same examples; the paired
    difference is against tail16 by example. Planted bug that fails it: accuracy from ``agree`` alone (the
    examples full prefill gets wrong counted too)."""
    sys.path.insert(0, str(ROOT / "research" / "latent"))
    try:
        import latent_rows_probe
    finally:
        sys.path.pop(0)

    rows = []
    for i in range(10):  # full right on 8; direct reuse right on 1; tail16 on 3; focus16 on 7 (+ agrees on a wrong one)
        full_ok = i < 8
        res = {"none": {"agree": i == 0, "kl": 0.3}, "tail16": {"agree": i < 3, "kl": 0.2},
               "focus16": {"agree": i < 7 or i == 9, "kl": 0.05}}
        rows.append(dict(family="code", full_ok=full_ok, reuse_agree=i == 0, res=res))
    table = latent_rows_probe.table({"rows": rows})
    line = next(x for x in table.splitlines() if x.startswith("| held-out, all three | focus16 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[2] == "10" and cells[3].startswith("70% [")       # 7 of 10 (the 10th agrees with a wrong full)
    assert cells[4] == "86%"                                       # (0.7 - 0.1) / (0.8 - 0.1)
    assert cells[5].startswith("+40 [")                            # 7 vs 3, paired
    assert cells[6] == "80%"                                       # agreement counts every example


def test_latent_remedy_paired_matches_cases_by_family_record_direction(tmp_path):
    """benchmarks/latent_remedy.py --paired: A - B over the same cases, matched by (family, record, direction)
    whatever the row order, per family and over all. Planted bug that fails it: pairing the two methods' rows by
    order (here B's rows are reversed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import latent_remedy
    finally:
        sys.path.pop(0)
    rows = [dict(family="code", record=i, direction=d, method="full", ok=True) for i in range(5) for d in ("a", "b")]
    a = [dict(family="code", record=i, direction="a->b", method="A", ok=i < 3) for i in range(10)]
    b = [dict(family="code", record=i, direction="a->b", method="B", ok=i < 2) for i in range(10)][::-1]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows + a + b}))
    out = latent_remedy.paired(str(path), ["A:B"]).splitlines()
    assert out[2].startswith("| code | A - B | +10 [") and out[3].startswith("| all | A - B | +10 [")
    assert out[3] == "| all | A - B | +10 [-10, +31] | 10 |"   # by case; paired by row order: [-31, +48]


def test_latent_remedy_merge_times_each_method_against_its_own_run(tmp_path):
    """benchmarks/latent_remedy.py --merge: a method's TTFT ratio pairs each row with direct reuse of the same run
    (side by side); a method whose run had no direct reuse gets no ratio, and a merged input keeps its runs apart
    from the other inputs' (run ids under the input's index). Planted bugs that fail it: falling back to another
    run's direct reuse (the run condition dropped) -> ``B`` gets a ratio; run ids kept as they were in a merged
    input (``r.get("run", f"{i}")``) -> the second input's A pairs with the first input's run "1" (5.0, not 2.0)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import latent_remedy
    finally:
        sys.path.pop(0)

    def rows(method, ttft, record=0, run=None):
        out = [dict(family="code", record=record, direction=f"full_{s}", method="full", ok=True, answer="1",
                    ttft_s=1.0) for s in "ab"] + [dict(family="code", record=record, direction="a->b",
                                                        method=method, ok=True, agree_full=True, answer="1",
                                                        ttft_s=ttft)]
        return [{**r, **({"run": run} if run else {})} for r in out]

    # an earlier merge: its run "0" timed A beside direct reuse on record 0 (ratio 2.0); its run "1" timed only
    # direct reuse, on record 1
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps({"meta": {}, "rows": rows("reuse", 1.0, 0, "0") + rows("A", 2.0, 0, "0")
                                  + rows("reuse", 0.25, 1, "1")}))
    late = tmp_path / "late.json"       # second input (index 1): A alone on record 1, under another load
    late.write_text(json.dumps({"meta": {}, "rows": rows("A", 2.0, 1)}))
    solo = tmp_path / "solo.json"       # B alone, no direct reuse in its run
    solo.write_text(json.dumps({"meta": {}, "rows": rows("B", 9.0)}))
    out = tmp_path / "out.json"
    latent_remedy.merge(str(out), [str(merged), str(late), str(solo)])
    res = json.loads(out.read_text())["summary"]["all"]
    assert "ttft_vs_reuse" not in res["B"]
    assert res["A"]["ttft_vs_reuse"] == 2.0   # record 1's A had no direct reuse beside it: no ratio (not 8.0)


REAL_SCALE = ROOT / "benchmarks" / "real_scale_gpu.py"


@pytest.mark.slow
def test_real_scale_dry_run(tmp_path):
    """benchmarks/real_scale_gpu.py --tiny on CPU runs every part of the prepared GPU step (every method of the
    3-agent workflow on both models, TranslatedCache, BaseLRCache) without an error; the exact methods give full
    prefill's tokens and their first verified token; the approximate ones claim none.

    Planted bug that fails it: FocusRecomputeCache built without its tokenizer
    (``FocusRecomputeCache(model, ids[2], [span], store=store)``: a TypeError recorded in ``errors``)."""
    out = tmp_path / "rs.json"
    proc = subprocess.run([sys.executable, str(REAL_SCALE), "--tiny", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and doc["skipped"] == [] and doc["complete"] is True
    got = {(r["model"], r["method"]) for r in doc["rows"]}
    want = {(m, meth) for m in ("llama3-8b", "qwen2.5-1.5b") for meth in
            ("full", "prefix", "optimistic-commit", "optimistic-verify", "blend-0.15", "tail-16", "focus")}
    want |= {("qwen2.5-1.5b", "translated-0.3"), ("llama3-8b", "base_lr-prelrshared"),
             ("llama3-8b", "base_lr-nonshared")}
    assert got == want, got ^ want
    for r in doc["rows"]:
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and "peak_mib" in r
        if r["method"] in ("prefix", "optimistic-verify"):
            assert r["identical"] is True and r["exact"] is True and r["first_verified_s"] is not None
        if r["method"] in ("blend-0.15", "tail-16", "focus", "optimistic-commit", "translated-0.3"):
            assert r["exact"] is False and r["first_verified_s"] is None


@pytest.mark.slow
def test_real_scale_budget_keeps_a_valid_json(tmp_path):
    """With no time left, benchmarks/real_scale_gpu.py starts nothing, names every skipped part and marks the
    JSON incomplete (what a lease cut short leaves).

    Planted bug that fails it: ``complete`` set to True unconditionally at the end."""
    out = tmp_path / "rs.json"
    proc = subprocess.run([sys.executable, str(REAL_SCALE), "--tiny", "--device", "cpu", "--budget-s", "0",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and doc["complete"] is False
    assert {s["part"] for s in doc["skipped"]} == {"session", "translated", "base_lr"}
