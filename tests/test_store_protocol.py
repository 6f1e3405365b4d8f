"""The store protocol's entry encoding and its folder backend (no server needed)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvreuse.stores import CorruptEntryError, FolderBackend, decode_entry, encode_entry, open_backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]


@st.composite
def tensor_sets(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
        dtype = draw(st.sampled_from(DTYPES))
        g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
        t = torch.randn(shape, generator=g) * 10
        out[f"t{i}"] = t.to(dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), flip=st.integers(0, 1 << 30), bit=st.integers(0, 7))
def test_entry_round_trips_and_any_flipped_bit_is_refused(tensors, flip, bit):
    """Any set of tensors (dtypes, shapes, empty ones) decodes bit for bit; flipping any one bit of the tensor bytes
    or of the meta is refused (sha256 of the data, sha256 of the meta's fields, or unreadable JSON).

    Planted bug that fails it: ``_digest`` leaves ``key`` out of the hashed fields and ``decode_meta`` skips the key
    comparison (a flipped bit in the key passes)."""
    mb, data = encode_entry("ns-p", "k1", {"a": [1, 2]}, tensors)
    meta, got = decode_entry("ns-p", "k1", mb, data, "test")
    assert meta == {"a": [1, 2]} and set(got) == set(tensors)
    for n, t in tensors.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)
    d = bytearray(data)
    d[flip % len(d)] ^= 1 << bit
    with pytest.raises(CorruptEntryError):
        decode_entry("ns-p", "k1", mb, bytes(d), "test")
    m = bytearray(mb)
    m[flip % len(m)] ^= 1 << bit
    try:
        decode_entry("ns-p", "k1", bytes(m), data, "test")
    except CorruptEntryError:
        pass
    else:  # a flip that leaves valid JSON with the same meaning (e.g. in a number's insignificant spelling) only
        import json

        assert json.loads(bytes(m)) == json.loads(mb)
    with pytest.raises(CorruptEntryError, match="not ns-p/k2"):
        decode_entry("ns-p", "k2", mb, data, "test")


def test_folder_backend_refuses_torn_and_foreign_files(tmp_path):
    """A truncated entry file and an entry file copied under another key are refused; names that could leave the
    folder are refused before any file is touched; a URL opens a Redis backend and a path a folder.

    Planted bug that fails it: ``FolderBackend._read`` does not check the meta length against the file size."""
    b = FolderBackend(tmp_path, tenant="t")
    b.put("ns-f", "a", {}, {"k": torch.randn(50)})
    f = b._file("ns-f", "a")
    raw = f.read_bytes()
    f.write_bytes(raw[:40])
    with pytest.raises(CorruptEntryError):
        b.get("ns-f", "a")
    f.write_bytes(raw)
    b._file("ns-f", "b").write_bytes(raw)
    with pytest.raises(CorruptEntryError, match="not ns-f/b"):
        b.get("ns-f", "b")
    assert set(b.metas("ns-f")) == {"a"}
    for bad in ("../x", "a/b", "", "x" * 200):
        with pytest.raises(ValueError):
            b.put("ns-f", bad, {}, {})
        with pytest.raises(ValueError):
            b.get(bad, "a")
    assert isinstance(open_backend(tmp_path / "x"), FolderBackend)
    assert open_backend(b) is b
    pytest.importorskip("redis")
    from hf_kvreuse.stores.redis import RedisBackend

    r = open_backend("redis://user:secret@127.0.0.1:1/0", tenant="t")
    assert isinstance(r, RedisBackend) and "secret" not in repr(r)
