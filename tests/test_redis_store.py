"""The store protocol on a real Redis server (and the folder backend beside it).

A private ``redis-server`` per test module (or per test, where the test kills it) on a free loopback port, with
persistence off; every test skips when the binary is missing (``apt-get install redis-server``).
"""

import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

#: CI (``CI`` set, as .ci/run sets it): a missing server or client fails these tests instead of skipping them
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
try:
    import redis
except ImportError:
    if IN_CI:
        raise  # a collection error: CI installs the dev extra, which has the client
    pytest.skip("the redis client is not installed (pip install redis)", allow_module_level=True)

from hf_kvreuse.chunk_store import ChunkStore  # noqa: E402
from hf_kvreuse.models import tiny_model  # noqa: E402
from hf_kvreuse.generation.mixin import enable  # noqa: E402
from hf_kvreuse.session import ReuseSession  # noqa: E402
from hf_kvreuse.stores import CorruptEntryError, FolderBackend, encode_entry  # noqa: E402
from hf_kvreuse.stores.redis import RedisBackend  # noqa: E402
from hf_kvreuse.stores.tiers import KVEntryStore, StoreTier  # noqa: E402
from hf_kvreuse.vllm import KVDirStore, ModelIdentity  # noqa: E402

from conftest import assert_kv_close  # noqa: E402

SERVER = shutil.which("redis-server")
NO_SERVER = ("redis-server is not installed (Debian: apt-get install redis-server); the Redis store tests need a "
             "real server")


@pytest.fixture(scope="module", autouse=True)
def _needs_server():
    """Without redis-server every test here skips, saying why; under CI (``CI`` set) it fails: CI must not pass
    with the Redis store untested."""
    if SERVER is None:
        if IN_CI:
            pytest.fail(f"{NO_SERVER} (CI is set: a missing server fails the run)", pytrace=False)
        pytest.skip(NO_SERVER)

ID = ModelIdentity("a" * 64, "float32", "/m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A private redis-server on 127.0.0.1 (no persistence), restartable on the same port."""

    def __init__(self, *args: str):
        self.port = _free_port()
        self.args = args
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--protected-mode", "yes", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw):
        return redis.Redis(port=self.port, **kw)

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def server():
    s = Server("--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")
    yield s
    s.kill()


@pytest.fixture
def fresh(request):
    """A server of this test only (the test may kill it)."""
    s = Server(*getattr(request, "param", ()))
    yield s
    s.kill()


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama"))


def kv_tensors(n, layers=2, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, heads, n, dim, generator=g), torch.randn(layers, heads, n, dim, generator=g)


def _backends(server, tmp_path, tenant=None):
    return [FolderBackend(tmp_path / "folder", tenant=tenant), RedisBackend(server.url, tenant=tenant)]


# -- the protocol ----------------------------------------------------------------------------------------------------
def test_backends_round_trip_and_usage(server, tmp_path):
    """Both backends return what was put, bit for bit, list it, report its namespace's bytes and forget it on delete;
    a namespace budget deletes the oldest entries first.

    Planted bug that fails it: the budget pass (``_BudgetMixin._enforce``) ignores ``keep`` and deletes the entry
    just written."""
    for b in _backends(server, tmp_path, tenant="t1"):
        b.clear("ns-a")
        tensors = {"k": torch.randn(2, 3, 5, 4), "ids": torch.arange(5), "h": torch.randn(3).half()}
        b.put("ns-a", "e1", {"x": 1}, tensors)
        b.put("ns-a", "e2", {"x": 2}, {"k": torch.randn(4)})
        meta, got = b.get("ns-a", "e1")
        assert meta == {"x": 1} and set(got) == set(tensors)
        assert all(torch.equal(got[n], tensors[n]) and got[n].dtype == tensors[n].dtype for n in tensors)
        assert b.metas("ns-a") == {"e1": {"x": 1}, "e2": {"x": 2}}
        (u,) = b.usage("ns-a")
        assert u.entries == 2 and u.nbytes > 2 * 3 * 5 * 4 * 4
        assert "ns-a" in b.namespaces()
        b.delete("ns-a", "e1")
        assert b.get("ns-a", "e1") is None and b.get("ns-a", "never") is None
        b.max_bytes = 1  # only the entry just written stays
        b.put("ns-a", "e3", {"x": 3}, {"k": torch.randn(2, 3, 5, 4)})
        assert set(b.metas("ns-a")) == {"e3"} and b.evictions >= 1  # the oldest (e2) went first
        b.max_bytes = None
        b.clear("ns-a")
        assert b.metas("ns-a") == {}
    with pytest.raises(ValueError, match="namespace"):
        RedisBackend(server.url).put("a:b", "k", {}, {})


DAMAGES = ["data_byte", "meta_key", "meta_field", "nan_rehashed", "data_missing"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_corrupted_value_is_refused_and_recomputed(server, model, damage):
    """A damaged entry on the server (a flipped tensor byte, an entry copied under another key, an edited meta
    field, NaN values with a matching sha256, a hash without its data) is refused by the backend, and a
    ChunkStore on the tier recomputes the chunk (equal to a fresh computation) and deletes the bad entry.

    Planted bug that fails it: ``decode_entry`` skips the ``data_sha256`` comparison (``data_byte`` passes a flipped
    byte), or skips ``check_finite`` (``nan_rehashed``)."""
    tier = StoreTier(server.url, tenant=f"c-{damage.replace('_', '-')}")
    store = ChunkStore(disk=tier)
    ids = torch.arange(5, 17)
    fresh = store.get_or_compute(model, ids)
    key = ChunkStore.key(model, ids.reshape(1, -1))
    ns, name = tier._ns_key(key)
    rk = tier.backend._key(ns, name)
    client = server.client()
    mb, data = client.hmget(rk, ["meta", "data"])
    import json

    if damage == "data_byte":
        d = bytearray(data)
        d[-7] ^= 0x10
        client.hset(rk, "data", bytes(d))
    elif damage == "meta_key":
        client.hset(tier.backend._key(ns, "other"), mapping={"meta": mb, "data": data})
        rk, name = tier.backend._key(ns, "other"), "other"
    elif damage == "meta_field":
        m = json.loads(mb)
        m["user"]["start"] = 3
        client.hset(rk, "meta", json.dumps(m))
    elif damage == "nan_rehashed":
        from safetensors.torch import load

        t = load(data)
        t["k.0"][0, 0, 0, 0] = float("nan")
        m = json.loads(mb)
        mb2, data2 = encode_entry(ns, name, m["user"], t)
        client.hset(rk, mapping={"meta": mb2, "data": data2})
    elif damage == "data_missing":
        client.hdel(rk, "data")
    with pytest.raises(CorruptEntryError):
        tier.backend.get(ns, name)
    if damage == "meta_key":
        return
    again = ChunkStore(disk=tier)
    chunk = again.get_or_compute(model, ids)
    assert tier.refused == 1 and tier.hits == 0
    assert_kv_close(chunk.kv, fresh.kv, atol=0)
    assert tier.backend.get(ns, name) is not None  # recomputed and written again


class _CuttingProxy:
    """A loopback TCP proxy that forwards the client's first ``limit`` bytes to the server, then drops both
    connections (a writer or network that dies mid-command)."""

    def __init__(self, port: int, limit: int):
        self.port, self.limit = port, limit
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        conn, _ = self.sock.accept()
        up = socket.create_connection(("127.0.0.1", self.port))
        sent = 0

        def back():
            try:
                while data := up.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

        threading.Thread(target=back, daemon=True).start()
        try:
            while sent < self.limit and (data := conn.recv(min(65536, self.limit - sent))):
                up.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (up, conn):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.sock.close()


def test_writer_dying_mid_write_leaves_no_entry(server):
    """A connection cut anywhere inside an entry's write (after 1 byte, in the meta, in the tensors, one byte
    before the end) leaves no key at all: meta and tensors appear together or not at all.

    Planted bug that fails it: ``RedisBackend.put`` writes ``meta`` and ``data`` with two HSET commands (a cut
    between them leaves a meta without tensors)."""
    k = torch.randn(2, 4, 300, 16)
    mb, data = encode_entry("ns-cut", "e", {}, {"k": k})
    total = len(mb) + len(data) + 200  # RESP framing
    for frac in (0.0, 0.01, 0.3, 0.6, 0.99):
        proxy = _CuttingProxy(server.port, max(1, int(total * frac)))
        b = RedisBackend(proxy.url, tenant="cut", socket_timeout=5, retry_on_timeout=False)
        b.client.connection_pool.connection_kwargs["retry"] = None
        with pytest.raises(Exception):
            b.put("ns-cut", "e", {}, {"k": k})
        time.sleep(0.05)
        assert server.client().keys("cut:*") == [], frac
    # the full write, through a proxy that lets everything through, does appear
    proxy = _CuttingProxy(server.port, 1 << 40)
    RedisBackend(proxy.url, tenant="cut").put("ns-cut", "e", {}, {"k": k})
    assert torch.equal(RedisBackend(server.url, tenant="cut").get("ns-cut", "e")[1]["k"], k)
    server.client().delete(*server.client().keys("cut:*"))


def test_server_killed_and_restarted_everything_recomputes(fresh, model):
    """A server killed (no persistence) makes every lookup a miss while it is down and after its restart; the
    ChunkStore recomputes and the K/V equal the first computation; writes resume after the restart.

    Planted bug that fails it: ``StoreTier.get`` lets ``StoreUnavailableError`` propagate (the call fails instead
    of recomputing)."""
    tier = StoreTier(fresh.url)
    ids = torch.arange(3, 20)
    first = ChunkStore(disk=tier).get_or_compute(model, ids)
    assert tier.writes == 1 and ChunkStore(disk=tier).get(model, ids.reshape(1, -1)) is not None
    fresh.kill()
    tier.backend.client.connection_pool.disconnect()
    down = ChunkStore(disk=tier).get_or_compute(model, ids)
    assert tier.unavailable >= 1
    assert_kv_close(down.kv, first.kv, atol=0)
    fresh.start()
    hits = tier.hits
    again = ChunkStore(disk=tier).get_or_compute(model, ids)  # the restart lost it: recomputed, written again
    assert tier.hits == hits and tier.writes >= 2
    assert_kv_close(again.kv, first.kv, atol=0)
    assert ChunkStore(disk=tier).get(model, ids.reshape(1, -1)) is not None


@pytest.mark.parametrize("fresh", [("--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru")], indirect=True)
def test_memory_pressure_evicts_whole_entries(fresh):
    """Under ``maxmemory`` the server evicts entries; every key left is a whole entry that verifies, an evicted one
    is a miss (the vLLM store raises FileNotFoundError: the connector recomputes), and usage is reported.

    An entry larger than the server's memory is a lost write (a future miss), not an error.

    Planted bug that fails it: ``RedisBackend.get`` returns ``({}, {})`` for a missing key instead of None (an
    evicted entry taken for a present one)."""
    store = KVEntryStore(fresh.url)
    infos = []
    for i in range(20):
        k, v = kv_tensors(1024, layers=2, heads=2, dim=64, seed=i)  # ~2 MiB per entry
        infos.append((store.put(ID, list(range(i, i + 1024)), k, v), k))
    evicted = int(fresh.client().info("stats")["evicted_keys"])
    assert evicted > 0
    gone = 0
    for info, k in infos:
        try:
            k2, _ = store.load(info, ID)
            assert torch.equal(k2, k)
        except FileNotFoundError:
            gone += 1
    assert gone > 0 and gone < len(infos)
    for raw in fresh.client().keys("*"):
        assert fresh.client().hlen(raw) == 2  # never half an entry
    big = kv_tensors(10240, layers=2, heads=2, dim=64)  # ~21 MiB: more than the server may hold
    assert store.put(ID, list(range(10240)), *big) is None and store.unavailable == 1  # a lost write, no error
    usage = store.usage()  # entries left now (reads may evict more while the server is at its limit)
    assert sum(u.entries for u in usage) <= len(infos) - gone and sum(u.nbytes for u in usage) <= 16 << 20


def test_tenants_are_confined_by_acl(server):
    """With two ACL users restricted to ``~alice:*`` / ``~bob:*``, each reads and writes its own entries; neither can
    read nor write the other's keys (the server refuses), whatever tenant its client claims.

    Planted bug that fails it: ``RedisBackend`` leaves the tenant out of the key (``self.base`` without it)."""
    admin = server.client()
    for user in ("alice", "bob"):
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{user}-pw", f"~{user}:*", "+@all",
                              "-@dangerous")
    alice = RedisBackend(f"redis://alice:alice-pw@127.0.0.1:{server.port}/0", tenant="alice")
    bob = RedisBackend(f"redis://bob:bob-pw@127.0.0.1:{server.port}/0", tenant="bob")
    alice.put("ns-t", "e", {"who": "alice"}, {"k": torch.ones(3)})
    bob.put("ns-t", "e", {"who": "bob"}, {"k": torch.zeros(3)})
    assert alice.get("ns-t", "e")[0] == {"who": "alice"} and bob.get("ns-t", "e")[0] == {"who": "bob"}
    assert "alice" not in repr(alice).split("tenant")[0]  # no credentials in the repr
    mallory = RedisBackend(f"redis://alice:alice-pw@127.0.0.1:{server.port}/0", tenant="bob")
    with pytest.raises(redis.exceptions.NoPermissionError):
        mallory.get("ns-t", "e")
    with pytest.raises(redis.exceptions.NoPermissionError):
        mallory.put("ns-t", "e", {"who": "mallory"}, {"k": torch.ones(3)})
    assert bob.get("ns-t", "e")[0] == {"who": "bob"}
    assert [u.entries for u in alice.usage()] == [1]
    for user in ("alice", "bob"):
        admin.execute_command("ACL", "DELUSER", user)
    admin.delete(*admin.keys("alice:*"), *admin.keys("bob:*"))


# -- the library's stores on Redis -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama_redis")
    tiny_model("llama").save_pretrained(folder)
    return enable(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()), folder


def test_hf_writes_vllm_format_loads_and_reverse(server, saved, tmp_path):
    """A transformers prefill written to the Redis store reads back in the vLLM entry format ([layers, kv_heads,
    tokens, head_dim], the same fields as the folder store's JSON), bit for bit equal to the folder store's copy;
    an entry written in that format as vLLM's connector writes it (``written_by="vllm"``) serves transformers as the
    exact prefix: logits equal a full prefill's.

    Planted bug that fails it: ``KVEntryStore.put`` stores ``v`` under ``"k"``."""
    from hf_kvreuse.compat import cache_kwargs
    from hf_kvreuse.vllm.hf import load_prefix, save_cache, stack_kv
    from hf_kvreuse.kv import kv_of
    from transformers import DynamicCache

    model, folder = saved
    rstore, fstore = KVEntryStore(server.url, tenant="hfv"), KVDirStore(tmp_path / "dir")
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(cache))
    ri, fi = save_cache(rstore, model, ids, cache, folder=folder), save_cache(fstore, model, ids, cache, folder=folder)
    assert ri == fi  # the same entry id, fields and geometry
    (rk, rv), (fk, fv) = rstore.load(ri, ri.identity), fstore.load(fi, fi.identity)
    assert torch.equal(rk, fk) and torch.equal(rv, fv)
    # the reverse: an engine-format entry of a 20-token prompt, then transformers continues a 30-token prompt from it
    k, v = stack_kv([(kk[:, :, :20], vv[:, :, :20]) for kk, vv in kv_of(cache)])
    rstore.backend.clear(rstore._ns(ri.identity))
    rstore.put(ri.identity, ids[0, :20].tolist(), k, v, written_by="vllm")
    got, n = load_prefix(rstore, model, ids, folder=folder)
    assert n == 20
    with torch.no_grad():
        full = model(ids).logits[:, 20:]
        cont = model(ids[:, 20:], use_cache=True, **cache_kwargs(got)).logits
    torch.testing.assert_close(cont, full, atol=1e-5, rtol=1e-5)
    rstore.backend.clear(rstore._ns(ri.identity))


def test_session_saved_to_redis_loads_back(server, model):
    """A ReuseSession saved to Redis (one entry: every held cache) loads back with equal K/V; another model's load
    finds nothing (its namespace); a damaged entry is refused.

    Planted bug that fails it: ``tiers.load_session`` takes every ``e<i>.`` tensor prefix as ``e0.``."""
    from hf_kvreuse.persist import PersistedKVError

    s = ReuseSession(model, policy="optimistic")
    a, b = torch.arange(3, 25).reshape(1, -1), torch.arange(40, 70).reshape(1, -1)
    s.generate(a, max_new_tokens=2, do_sample=False)
    s.generate(b, max_new_tokens=2, do_sample=False)
    s.save(server.url, name="agents", tenant="sess")
    back = ReuseSession.load(server.url, model, name="agents", tenant="sess")
    old, new = list(s._entries.values()), list(back._entries.values())
    assert len(old) == len(new) == 2
    for e, f in zip(old, new):
        assert torch.equal(e.ids, f.ids)
        assert_kv_close(f.kv, e.kv, atol=0)
    with pytest.raises(KeyError):
        ReuseSession.load(server.url, enable(tiny_model("llama", seed=9)), name="agents", tenant="sess")
    rb = RedisBackend(server.url, tenant="sess")
    (ns,) = rb.namespaces()
    rk = rb._key(ns, "agents")
    d = bytearray(server.client().hget(rk, "data"))
    d[-3] ^= 1
    server.client().hset(rk, "data", bytes(d))
    with pytest.raises(PersistedKVError, match="sha256"):
        ReuseSession.load(server.url, model, name="agents", tenant="sess")
    rb.clear(ns)


def test_chunk_store_url_and_folder_backend_agree(server, model, tmp_path):
    """``ChunkStore(disk="redis://...")`` and a StoreTier on the folder backend serve a second store the chunk the
    first computed (a hit, K/V equal), with and without a prefix (the anchor row travels too).

    Planted bug that fails it: ``StoreTier.put`` drops the anchor tensors."""
    for disk in (server.url, StoreTier(tmp_path / "chunks")):
        a = ChunkStore(disk=disk)
        c = a.get_or_compute(model, torch.arange(9, 21), prefix_ids=[4, 5, 6])
        b = ChunkStore(disk=a.disk)
        got = b.get(model, torch.arange(9, 21).reshape(1, -1), prefix_ids=[4, 5, 6])
        assert got is not None and b.hits == 1 and got.start == 3 and got.anchor_token == 6
        assert_kv_close(got.kv, c.kv, atol=0)
        assert_kv_close(got.anchor, c.anchor, atol=0)
        assert "StoreTier(" in repr(b) and "hits=1" in repr(b.disk)
