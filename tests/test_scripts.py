"""The benchmark scripts stay runnable: a smoke run of the GPU script on CPU with a tiny model."""

import json
import os
import subprocess
import sys
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


@pytest.mark.slow
def test_base_lr_benchmark_smoke(tmp_path):
    """benchmarks/base_lr.py end to end on a tiny trace (shipped SmolLM2 role adapters). The timeout is generous:
    the run takes a minute or two alone, but over 10 minutes on the 2-core machine next to a benchmark."""
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


@pytest.mark.slow
def test_gpu_check_script_without_gpu(tmp_path):
    """scripts/gpu_check.sh on a machine without a GPU: every step runs under its limit, the GPU tests are
    skipped (not failed), the exit status says the check did not pass, and gpu_check.json holds every step."""
    env = dict(ENV, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(res["steps"]) == {"env", "pytest_gpu", "kernels", "optimistic"}
    assert res["steps"]["pytest_gpu"]["rc"] == 0 and res["tests"]
    assert all(t["outcome"] == "skipped" for t in res["tests"])
    assert "no CUDA device" in res["steps"]["kernels"]["log_tail"]
