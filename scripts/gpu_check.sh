#!/usr/bin/env bash
# The prepared GPU check (issues 11, 22): on one CUDA GPU (sized for an H200) it ends within BUDGET_S = 480 s
# (8 minutes, kill-after and the summary included) and writes one JSON, gpu_check.json, naming every step, what
# ran, what was cut and why:
#   1. env: versions and the device;
#   2. real_scale: benchmarks/real_scale_gpu.py: the methods side by side on a 3-agent workflow (Llama-3-8B shape,
#      Qwen2.5-Coder-1.5B from benchmarks/assets/qwen2.5-coder-1.5b when carried, else random init of its config;
#      16k, 4k, 32k tokens): TTFT, first verified token, end to end, peak memory (most important first);
#   3. gpu_kernels: pytest tests/test_gpu_kernels.py: the attention kernels at every head dim (64-256) and dtype
#      against their torch references on the GPU (the shapes the compile check sizes);
#   4. pytest_gpu: pytest -m gpu tests/test_gpu.py: side-stream OptimisticCache exact after the swap, no leaks
#      over 20 calls, every cache on CUDA bf16 (Triton kernels vs the torch backend), a GPU/CPU layer split,
#      offload refusal;
#   5. kernels: benchmarks/triton_kernels.py: every kernel against its eager torch reference at 32 layers x 8 KV
#      heads x 128 dims, 4k-32k tokens, with the achieved bandwidth as a fraction of the H200's ~4.8 TB/s;
#   6. optimistic: benchmarks/optimistic_gpu.py (short): OptimisticCache TTFT and end-to-end against full prefill;
#   7. optimistic_chunked: the same at 16k tokens with background_chunk_tokens=2048 (what chunking costs).
#
# Under HF_KVREUSE_KERNELS=auto every step records its measured kernel choices in OUT_DIR/kernel_choices (one
# JSON per environment), summarised in gpu_check.json.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default: $OUT if set (the device tool), else benchmarks/results/gpu
#   PYTHON=python3 scripts/gpu_check.sh   # the interpreter that has a CUDA torch (default: python3)
#
# Time: every step has its own limit (timeout, then SIGKILL KILL_AFTER s later); a step never runs past the
# budget's deadline (its limit shrinks to what is left after the summary's reserve; with less than MIN_STEP_S
# left it is not started). Step limits + kill-afters + the summary's limit add up to <= 480 s
# (tests/test_scripts.py checks it). The benchmarks rewrite their JSON after every row, so a cut step keeps what
# it measured; the pytest steps write a verbose log, parsed when their junit XML is missing.
# Exit status: 0 when every step passed, 1 otherwise. CI never runs this script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-benchmarks/results/gpu}}
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}   # the whole check, summary included
KILL_AFTER=${GPU_CHECK_KILL_AFTER_S:-5}
SUMMARY_S=${GPU_CHECK_SUMMARY_S:-15}  # reserved for (and the limit of) the summary at the end
MIN_STEP_S=${GPU_CHECK_MIN_STEP_S:-10}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET HF_KVREUSE_KERNELS HF_KVREUSE_GPU_TEST_DEVICE
export HF_KVREUSE_KERNEL_CACHE="$OUT_DIR/kernel_choices"
QWEN_DIR=${GPU_CHECK_QWEN_DIR:-benchmarks/assets/qwen2.5-coder-1.5b}
start=$(date +%s)
deadline=$(( start + BUDGET_S ))
status=0

run_step() {  # name, limit in seconds, command...
  local name=$1 limit=$2 t0 rc left
  shift 2
  t0=$(date +%s)
  left=$(( deadline - t0 - SUMMARY_S - KILL_AFTER ))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    echo "== $name: not started, ${left} s left of the ${BUDGET_S} s budget"
    echo "$name not_run 0 $limit 0" >>"$OUT_DIR/steps.txt"
    status=1
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (limit ${limit} s)"
  timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name $rc $(( $(date +%s) - t0 )) $limit 1" >>"$OUT_DIR/steps.txt"
  tail -n 25 "$OUT_DIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

rm -f "$OUT_DIR/steps.txt"
run_step env 15 "$PY" -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))"
run_step real_scale 185 "$PY" benchmarks/real_scale_gpu.py --budget-s 160 --model-dir "$QWEN_DIR" --out "$OUT_DIR/real_scale.json"
run_step gpu_kernels 70 "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu_kernels.py -rA --junitxml="$OUT_DIR/gpu_kernels.xml"
run_step pytest_gpu 65 "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py -rA --junitxml="$OUT_DIR/pytest_gpu.xml"
run_step kernels 35 "$PY" benchmarks/triton_kernels.py --reps 10 --warmup 3 --out "$OUT_DIR/kernels.json"
run_step optimistic 35 "$PY" benchmarks/optimistic_gpu.py --models llama-1b --contexts 16384 --reps 2 --out "$OUT_DIR/optimistic_gpu.json"
run_step optimistic_chunked 20 "$PY" benchmarks/optimistic_gpu.py --models llama-1b --contexts 16384 --reps 1 --no-checks --background-chunk-tokens 2048 --out "$OUT_DIR/optimistic_chunked.json"

timeout --kill-after=2 "$(( SUMMARY_S - 2 ))" "$PY" - "$OUT_DIR" "$start" "$BUDGET_S" <<'EOF'
import glob, json, os, re, sys, time, xml.etree.ElementTree as ET
out, start, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(name):
    p = os.path.join(out, name)
    try:
        return json.load(open(p))
    except Exception as e:  # a step that failed early leaves no JSON
        return {"missing": f"{name}: {type(e).__name__}: {e}"}
def tests_of(step):
    """Test outcomes from the junit XML, or, when the step was cut before pytest wrote it, from the -v log."""
    tests = []
    try:
        for case in ET.parse(os.path.join(out, f"{step}.xml")).iter("testcase"):
            outcome, msg = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome, msg = ("failed" if tag == "failure" else tag), (el.get("message") or "")[:500]
                    break
            tests.append(dict(step=step, name=case.get("name"), outcome=outcome,
                              seconds=float(case.get("time", 0)), message=msg))
    except Exception:
        try:
            log = open(os.path.join(out, f"{step}.log"), errors="replace").read()
        except OSError:
            return tests
        for m in re.finditer(r"^\S+::(\S+) (PASSED|FAILED|SKIPPED|ERROR)", log, re.M):
            tests.append(dict(step=step, name=m.group(1), outcome=m.group(2).lower(), source="log (no junit XML)"))
    return tests
steps, ran, cut = {}, [], []
for line in open(os.path.join(out, "steps.txt")):
    name, rc, secs, limit, started = line.split()
    if started == "0":
        steps[name] = dict(outcome="not_run", limit_s=int(limit))
        cut.append(dict(step=name, why=f"not started: less than the minimum step time left of the {budget} s budget"))
        continue
    rc, secs, limit = int(rc), int(secs), int(limit)
    log = open(os.path.join(out, f"{name}.log"), errors="replace").read()
    timed_out = rc in (124, 137)
    steps[name] = dict(rc=rc, seconds=secs, limit_s=limit, timed_out=timed_out,
                       outcome="cut" if timed_out else "passed" if rc == 0 else "failed", log_tail=log[-4000:])
    ran.append(name)
    if timed_out:
        cut.append(dict(step=name, why=f"cut by its {limit} s limit ({'SIGKILL' if rc == 137 else 'SIGTERM'}) "
                                       "after keeping what it wrote"))
tests = tests_of("gpu_kernels") + tests_of("pytest_gpu")
kern, opt, chunked = load("kernels.json"), load("optimistic_gpu.json"), load("optimistic_chunked.json")
real = load("real_scale.json")
choices = {}
for f in sorted(glob.glob(os.path.join(out, "kernel_choices", "choices-*.json"))):
    try:
        d = json.load(open(f))
        choices[os.path.basename(f)] = dict(environment=d.get("environment"), choices=d.get("choices"))
    except Exception as e:
        choices[os.path.basename(f)] = {"missing": f"{type(e).__name__}: {e}"}
def real_rows(doc, method, model="llama3-8b"):
    return [dict(context=r.get("context_tokens"), ttft_speedup=r.get("ttft_speedup"),
                 first_verified_s=r.get("first_verified_s"), full_ttft_s=r.get("full_ttft_s"))
            for r in (doc.get("rows", []) if isinstance(doc, dict) else [])
            if r.get("method") == method and r.get("model") == model]
rows = kern.get("rows", [])
def opt_rows(doc):
    return [dict(model=r.get("model"), context=r.get("context_tokens"), ttft_over_floor=r.get("ttft_over_floor"),
                 ok=(r.get("ttft_over_floor") or 99) <= 1.5) for r in doc.get("rows", [])] if isinstance(doc, dict) else []
result = dict(
    wall_s=int(time.time()) - start, budget_s=budget, ran=ran, cut=cut, steps=steps, tests=tests,
    complete={k: d.get("complete") for k, d in (("real_scale", real), ("kernels", kern), ("optimistic", opt),
                                                ("optimistic_chunked", chunked))},
    real_scale=real, kernel_choices=choices, kernels=kern, optimistic=opt, optimistic_chunked=chunked,
    targets=dict(
        real_scale_8b_optimistic_verify=real_rows(real, "optimistic-verify"),
        real_scale_8b_optimistic_commit=real_rows(real, "optimistic-commit"),
        kernels_3x=[dict(kernel=r["kernel"], tokens=r["tokens"], speedup=r.get("speedup"), ok=r.get("meets_speedup"))
                    for r in rows],
        bandwidth_60pct=[dict(kernel=r["kernel"], tokens=r["tokens"], fraction=r.get("peak_fraction"),
                              ok=r.get("meets_bandwidth")) for r in rows if r.get("memory_bound")],
        optimistic_ttft_over_floor=opt_rows(opt), optimistic_chunked_ttft_over_floor=opt_rows(chunked)))
json.dump(result, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(f"wrote {out}/gpu_check.json after {result['wall_s']} s; ran {ran}; cut {[c['step'] for c in cut]}")
print(json.dumps(result["targets"], indent=1))
EOF
[ $? -eq 0 ] || status=1
exit $status
