"""Names that become paths or keys stay in their place, and secrets stay out of what is shown.

* One name rule (:func:`hf_kvreuse.stores.check_name`) for every tenant, namespace, entry and session name, on
  every backend: never ``.`` / ``..``, never a separator, never the no-tenant folder, distinct names in distinct
  places (the folder backend, Redis, the vLLM folder store).
* One redaction (:func:`hf_kvreuse.stores.redact_url`) for every URL a repr, a log line or an exception shows,
  tested on every URL form redis-py accepts.
"""

import logging
import shutil
import socket
import types
from urllib.parse import unquote

import pytest
import torch

from hf_kvreuse import persist
from hf_kvreuse.stores import NO_TENANT, FolderBackend, StoreUnavailableError, check_name, open_backend, redact_url
from hf_kvreuse.vllm import KVDirStore, ModelIdentity

BAD = [".", "..", "...", "", "_", "_x", "-x", ".hidden", "a.", "a/b", "../a", "a\\b", "a:b", "a b", "a\n", "a*",
       "x" * 129, "nul", "NUL.entry", "com1", "lpt9.x", "Aux", None, 3, b"a"]
GOOD = ["a", "A1", "a.b", "a_b-c", "0", "x" * 128, "session", "vllm-0123abcd", "null", "com10", "console"]


def _tensors():
    return {"k": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


@pytest.mark.parametrize("name", BAD)
def test_name_rule_refuses(name):
    """Every name that is only dots, holds a separator, starts with '_' (the no-tenant folder), '.' or '-', ends
    in '.', is a device name or is not a short string is refused. Planted bug that makes it fail: ``_NAME`` back
    to ``^[A-Za-z0-9_.-]{1,128}$`` matched with ``match`` (accepts '.', '..', '_', 'a\\n')."""
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        check_name(name, "tenant")


@pytest.mark.parametrize("name", GOOD)
def test_name_rule_accepts(name):
    assert check_name(name, "tenant") == name


def test_folder_tenant_stays_in_the_store_folder(tmp_path):
    """``tenant=".."`` (and a namespace or key of dots) is refused before anything is written, so nothing lands
    outside the store folder; ``tenant="_"`` (the no-tenant folder) is refused, so no tenant reads the entries
    written without one. Planted bug that makes it fail: ``valid_name`` back to the old rule (``_NAME.match``
    of ``^[A-Za-z0-9_.-]{1,128}$``): the ``..`` tenant writes next to the store folder."""
    root = tmp_path / "store"
    plain = FolderBackend(root)
    plain.put("ns-a", "sess", {"who": "no tenant"}, _tensors())
    assert (root / NO_TENANT / "ns-a" / "sess.entry").exists()
    for tenant in ("..", ".", "_", "a/..", "../x"):
        with pytest.raises(ValueError):
            FolderBackend(root, tenant=tenant).put("ns-a", "sess", {"who": "intruder"}, _tensors())
    b = FolderBackend(root, tenant="t")
    for ns, key in (("..", "k"), (".", "k"), ("ns-a", ".."), ("ns-a", "../../x"), ("a/b", "k"), ("_", "k")):
        with pytest.raises(ValueError):
            b.put(ns, key, {}, _tensors())
        with pytest.raises(ValueError):
            b.get(ns, key)
        with pytest.raises(ValueError):
            b.delete(ns, key)
    with pytest.raises(ValueError):
        b.clear("..")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # nothing written beside the store folder
    assert b.get("ns-a", "sess") is None  # tenant "t" does not see the no-tenant entry
    assert plain.get("ns-a", "sess")[0] == {"who": "no tenant"}
    # distinct names: distinct files, each inside its tenant's folder
    names = ["a", "a.b", "a-b", "a_b", "ab", "A", "b.a", "a.b.c"]
    files = {FolderBackend(root, tenant=t)._file(ns, k).resolve() for t in names[:3] for ns in names for k in names}
    assert len(files) == 3 * len(names) ** 2
    assert all(f.is_relative_to(root.resolve() / t) for f in files for t in [f.relative_to(root.resolve()).parts[0]])


def test_vllm_folder_store_ids_stay_in_the_folder(tmp_path):
    """The vLLM folder store never reads an entry outside its folder: an id with a separator is no entry (``info``
    gives None) and ``load`` of such an id is refused by the name rule before any file is opened. Planted bug that
    makes it fail: ``KVDirStore.load`` without its ``check_name`` of the entry id (it opens the parent folder's
    files and refuses them only afterwards, for a name that is not the hash of their fields)."""
    ident = ModelIdentity("a" * 64, "float32", "/m")
    outer = KVDirStore(tmp_path)
    k = torch.randn(2, 2, 5, 4)
    info = outer.put(ident, list(range(5)), k, k.clone())
    inner = KVDirStore(tmp_path / "inner")
    assert inner.info(f"../{info.entry_id}") is None
    assert inner.info(info.entry_id) is None
    with pytest.raises(ValueError, match=r"entry id '\.\./"):
        inner.load(type(info)(**{**info.__dict__, "entry_id": f"../{info.entry_id}"}), ident)


# -- Redis: the server of tests/test_redis_store.py -------------------------------------------------------------------
SERVER = shutil.which("redis-server")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("redis")
    if SERVER is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    from test_redis_store import Server

    s = Server()
    yield s
    s.kill()


def test_redis_names_stay_in_their_place(server):
    """On Redis: the same rule refuses the same names, and a tenant named like the key prefix (``hfkv``, whose keys
    ``hfkv:hfkv:<ns>:<key>`` also match the no-tenant backend's scan of namespace ``hfkv``) is neither listed,
    counted nor cleared by the no-tenant backend. Planted bug that makes it fail: ``RedisBackend._keys`` keeps
    every key its scan pattern matches (no ``valid_name`` check of the rest of the key)."""
    from hf_kvreuse.stores.redis import RedisBackend

    for tenant in ("..", "_", "a:b", "a*"):
        with pytest.raises(ValueError):
            RedisBackend(server.url, tenant=tenant)
    plain = RedisBackend(server.url)
    for ns, key in (("..", "k"), ("ns", ".."), ("a:b", "k"), ("ns", "a:b"), ("ns", "*")):
        with pytest.raises(ValueError):
            plain.put(ns, key, {}, _tensors())
    prefixed = RedisBackend(server.url, tenant="hfkv")
    prefixed.put("ns-x", "kept", {"who": "tenant hfkv"}, _tensors())
    plain.put("hfkv", "mine", {"who": "no tenant"}, _tensors())
    assert sorted(plain.metas("hfkv")) == ["mine"]
    assert [(u.namespace, u.entries) for u in plain.usage("hfkv")] == [("hfkv", 1)]
    assert "ns-x" not in plain.namespaces()
    plain.clear("hfkv")
    assert plain.get("hfkv", "mine") is None
    assert prefixed.get("ns-x", "kept")[0] == {"who": "tenant hfkv"}  # another tenant's entry survives
    prefixed.clear("ns-x")


# -- secrets ---------------------------------------------------------------------------------------------------------
# (url, the secrets it holds, what the redacted URL still shows)
URLS = [
    ("redis://alice:pw-one@db.example:6379/0", ["alice", "pw-one"], "db.example:6379/0"),
    ("redis://:pw-two@db.example:6379", ["pw-two"], "db.example:6379"),
    ("redis://bob@db.example:6379/2", ["bob"], "db.example:6379/2"),
    ("rediss://carol:pw-three@db.example:6380/1?ssl_cert_reqs=none", ["carol", "pw-three"], "ssl_cert_reqs=none"),
    ("redis://db.example:6379/0?password=pw-four", ["pw-four"], "db.example:6379/0"),
    ("redis://db.example:6379/0?username=dave&password=pw-five&db=3", ["dave", "pw-five"], "db=3"),
    ("unix:///run/redis.sock?db=0&password=pw-six", ["pw-six"], "/run/redis.sock?db=0"),
    ("unix://erin:pw-seven@/run/redis.sock?db=1", ["erin", "pw-seven"], "/run/redis.sock?db=1"),
    ("REDIS://Frank:PW-Eight@DB.example:6379/0?PassWord=PW-Nine", ["Frank", "PW-Eight", "PW-Nine"], "DB.example"),
    ("Rediss://db.example:6380?UserName=gina&Password=pw-ten", ["gina", "pw-ten"], "db.example:6380"),
    ("redis://db.example:6379/0?pass%77ord=pw-eleven", ["pw-eleven"], "db.example:6379/0"),
    ("redis://:pw%40twelve@db.example:6379", ["pw%40twelve", "pw@twelve"], "db.example:6379"),
    ("redis://:pw@thirteen@db.example:6379", ["pw@thirteen", "thirteen"], "db.example:6379"),
    ("redis://:pw/fourteen@db.example:6379", ["pw/fourteen", "fourteen"], "redis://"),
    ("redis://:pw?fifteen@db.example:6379", ["pw?fifteen", "fifteen"], "redis://"),
    ("redis://:pw#sixteen@db.example:6379", ["pw#sixteen", "sixteen"], "redis://"),
    ("unix:///run/redis.sock?password=pw@seventeen", ["pw@seventeen", "seventeen"], "unix://"),
    ("valkey://hank:pw-eighteen@db.example:6379", ["hank", "pw-eighteen"], "db.example:6379"),
    ("redis://db.example:6379/0?ssl_password=pw-nineteen&socket_timeout=5", ["pw-nineteen"], "socket_timeout=5"),
    ("redis://db.example:6379/0?password=pw-twenty#frag", ["pw-twenty", "frag"], "db.example:6379/0"),
]


@pytest.mark.parametrize("url, secrets, shown", URLS)
def test_redact_url_every_form(url, secrets, shown):
    """No user name, password or secret query value survives :func:`redact_url` on any URL form redis-py accepts
    (credentials before ``@``, ``password`` / ``username`` query parameters, ``rediss://``, ``unix://``, mixed
    case, percent-encoded names and values, raw ``@ / ? #`` in a password), and where the server is stays shown;
    whatever redis-py itself parses as a username or password is among the hidden. Planted bug that makes it fail:
    ``redact_url`` leaves the query alone (only credentials before ``@`` are stripped, as before the fix)."""
    redis = pytest.importorskip("redis")
    out = redact_url(url)
    parsed = {}
    try:
        parsed = redis.connection.parse_url(url.replace("valkey://", "redis://", 1))
    except ValueError:
        pass
    hidden = set(secrets) | {str(parsed[k]) for k in ("username", "password") if parsed.get(k)}
    for s in hidden:
        assert s not in out and unquote(s) not in out, (url, out, s)
    assert shown in out and out.lower().startswith(url.split("://")[0].lower() + "://")
    assert redact_url("/data/kv@store/folder") == "/data/kv@store/folder"  # a folder is shown as it is


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_backend_shows_no_secret(caplog):
    """The backend's repr, the repr of every store built on it, the ``StoreUnavailableError`` of a server that
    cannot be reached (and the warning a tier logs for it), a server message quoting a credential, and the errors
    of the folder-only functions given a URL show no credential (no server needed: the port is closed). Planted bug
    that makes it fail: ``RedisBackend`` keeps ``self.url = url.split("@")[-1]`` (the URL's query is shown)."""
    redis = pytest.importorskip("redis")
    from hf_kvreuse.stores.redis import RedisBackend
    from hf_kvreuse.stores.tiers import KVEntryStore, StoreTier

    port = _closed_port()
    url = f"Redis://ivy:pw-user@127.0.0.1:{port}/0?password=pw-query&username=ivy&socket_connect_timeout=1"
    secrets = ("pw-user", "pw-query", "ivy")
    b = open_backend(url, socket_timeout=1, retry_on_timeout=False)
    assert isinstance(b, RedisBackend)  # a scheme in any case is a URL, never a folder named after it
    tier, kv = StoreTier(url), KVEntryStore(url)
    shown = [repr(b), repr(tier), repr(kv)]
    with pytest.raises(StoreUnavailableError) as err:
        b.put("ns", "k", {}, _tensors())
    shown.append(str(err.value))
    with caplog.at_level(logging.WARNING):
        assert tier.get(None, ("fp", "a", "b")) is None and tier.unavailable == 1
    shown.append(caplog.text)
    b.client.hget = lambda *a, **k: (_ for _ in ()).throw(redis.ConnectionError("AUTH pw-query ivy refused"))
    with pytest.raises(StoreUnavailableError) as err:
        b.meta("ns", "k")
    shown.append(str(err.value))
    ready = RedisBackend(redis.Redis(host="127.0.0.1", port=port, username="ivy", password="pw-user"))
    shown.append(repr(ready))
    for fn in (lambda: persist.save_session(types.SimpleNamespace(), url),
               lambda: persist.load_session(url, None, session_cls=object)):
        with pytest.raises(TypeError) as err:
            fn()
        shown.append(str(err.value))
    with pytest.raises(ValueError) as err:
        open_backend("s3://ivy:pw-user@bucket/x?password=pw-query")
    shown.append(str(err.value))
    for text in shown:
        for s in secrets:
            assert s not in text, (s, text)
    assert f"127.0.0.1:{port}" in repr(b) and f"127.0.0.1:{port}" in repr(ready)
