"""Attention-FFN disaggregation: a small K3-like decoder on the client, its MoE layers on the tier.

    moe = RemoteMoE.connect("default")            # a lane to the deployments serving the MoE layers
    model = Decoder(checkpoint, moe)              # embedding, attention, layer-0 MLP, LM head here
    out = model.generate(prompts, max_new_tokens=16, micro_batches=2)   # greedy

The decoder runs the non-MoE half of the model in this process: embedding, per layer a pre-norm
attention (a plain causal GQA attention with RoPE and a KV cache: a **stand-in** for K3's own
KDA/MLA attention, which is out of scope), residual adds, the dense layers (layer 0) as local
MLPs, the final norm and the LM head. Every MoE layer is one call to an :class:`MoELayers`:
:class:`RemoteMoE` sends it to the TP-group deployment serving that layer (routed by layer when an
app splits layers over deployments); :class:`LocalMoE` runs ``moe_runtime``'s single-device
``moe_forward`` in process: the same model, undisaggregated, the reference for exactness.

Ping-pong micro-batching (MegaScale-Infer): ``micro_batches = m`` splits the batch into ``m``
groups of rows, each with its own KV cache, and runs them as concurrent coroutines: while one
group awaits its MoE call on the tier, the others run their attention. ``m = 1`` is the plain
loop. Rows never interact (attention is per row, the MoE layer per token), so the tokens do
not depend on ``m``.

The decoder's extra tensors and config fields are those ``examples.synthetic_decoder``
documents and ``scripts/make_checkpoint.py --decoder`` writes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from deployments.client import DEFAULT_TIMEOUT_S, AttentionWorker, MoEClient
from deployments.common.layer_routing import LayerRoutes
from examples.synthetic_decoder import (
    ATTENTION,
    DECODER_FIELDS,
    DENSE_MLP,
    NORMS,
    DecoderLayout,
    check_decoder_fields,
)
from moe_runtime.activation import GatedActivation
from moe_runtime.checkpoint import CheckpointReader, load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward


@dataclass(frozen=True)
class DecoderConfig:
    """The MoE config plus the decoder fields of ``config.json`` (not part of LatentMoEConfig:
    the tier never needs them)."""

    moe: LatentMoEConfig
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    intermediate_size: int
    layout: DecoderLayout

    @classmethod
    def from_pretrained(cls, checkpoint: str | Path) -> DecoderConfig:
        moe = LatentMoEConfig.from_pretrained(checkpoint)  # checks the file and the MoE fields
        doc = json.loads((Path(checkpoint) / "config.json").read_text())
        k3 = isinstance(doc.get("text_config"), dict)
        text = {**doc, **doc["text_config"]} if k3 else doc
        check_decoder_fields(text)
        sizes = {f: int(text[f]) for f in DECODER_FIELDS if f != "rope_theta"}
        return cls(moe=moe, layout=DecoderLayout(k3), rope_theta=float(text["rope_theta"]), **sizes)


class MoELayers(Protocol):
    """The MoE layers the decoder calls: ``await moe(x_TH, layer)`` -> ``[T, H]`` (no residual)."""

    layers: frozenset[int]

    async def __call__(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor: ...


class LocalMoE:
    """Every MoE layer in this process with ``moe_runtime.layer.moe_forward`` (the reference)."""

    def __init__(self, checkpoint: str | Path, dtype: torch.dtype = torch.float32, backend: str = "torch"):
        self.cfg = LatentMoEConfig.from_pretrained(checkpoint)
        reader = CheckpointReader(checkpoint)
        self.weights = {i: load_layer_weights(reader, self.cfg, i, dtype) for i in self.cfg.moe_layers}
        self.layers = frozenset(self.weights)
        self.backend = backend

    async def __call__(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        return moe_forward(x_TH, self.weights[layer], self.cfg, self.backend)


class RemoteMoE:
    """MoE layers on the tier, routed by the app's routing table (``common.layer_routing``) to
    the TP-group deployment serving each layer: through a lane by default (``client.lane``: a
    session per deployment, one data-plane round trip per call, the Serve path when no session
    can be had), or through the Serve handles (``lane=False``). Close it (or use it as a context
    manager) to close the sessions."""

    def __init__(self, client: MoEClient, lane: bool = True, max_tokens: int = 64):
        self.client = client
        self.layers = frozenset(x for served in client.layer_routes().layers.values() for x in served)
        self.lane = client.lane(max_tokens=max_tokens) if lane else None

    @classmethod
    def connect(cls, app_name: str = "default", deployments: dict[str, Iterable[int]] | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, lane: bool = True) -> RemoteMoE:
        """``deployments``: name -> layers to use instead of the app's own table (the first
        listed is the default); None: asked from the app's ingress now."""
        routes = None
        if deployments is not None:
            table = {name: [int(x) for x in layers] for name, layers in deployments.items()}
            routes = LayerRoutes.from_dict({"default": next(iter(table)), "layers": table})
        return cls(MoEClient(app_name, timeout_s=timeout_s, routes=routes), lane=lane)

    async def __call__(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        if self.lane is not None:
            return await self.lane.forward_async(x_TH, layer)
        return await self.client.forward_async(x_TH, layer)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()

    def __enter__(self) -> RemoteMoE:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def deployment_statuses(self) -> dict[str, dict[str, Any]]:
        """Each deployment's own ``status()`` (one replica's counters), by name."""
        return {name: MoEClient.direct(name, self.client.app_name, self.client.timeout_s).status()
                for name in self.client.layer_routes().layers}


@dataclass
class Generation:
    """Greedy output: ``tokens [B, N]``, ``logits [B, N, V]`` (fp32) and the phase wall times."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prefill_s: float
    decode_s: float

    @property
    def decode_steps(self) -> int:
        return self.tokens.shape[1] - 1  # the first token comes from the prefill


@dataclass
class _MicroBatch:
    """Rows decoded together: their KV cache (per layer ``[B, kv, S, hd]``) and lengths."""

    prompts: list[list[int]]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [B] tokens already in the cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def split_rows(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(n)`` whose sizes differ by at most one."""
    bounds = [n * p // parts for p in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class Decoder:
    """A K3-shaped decoder whose MoE layers are whatever :class:`MoELayers` ``moe`` runs."""

    def __init__(self, checkpoint: str | Path, moe: MoELayers | None, dtype: torch.dtype = torch.float32):
        """``moe`` None: the caller runs the MoE layers itself (:meth:`layers_of`)."""
        self.cfg = cfg = DecoderConfig.from_pretrained(checkpoint)
        missing = [] if moe is None else sorted(set(cfg.moe.moe_layers) - set(moe.layers))
        if missing:
            raise ValueError(f"MoE layer(s) {missing} of the model are not served by {type(moe).__name__} "
                             f"(it has {sorted(moe.layers)})")
        self.moe, self.dtype = moe, dtype
        reader = CheckpointReader(checkpoint)
        lay = cfg.layout

        def read(name: str) -> torch.Tensor:
            return reader.read(name).to(dtype)

        self.embed, self.final_norm, self.lm_head = read(lay.embed), read(lay.final_norm), read(lay.lm_head)
        n = cfg.moe.num_hidden_layers
        self.layers = [{name: read(lay.layer(i, name)) for name in NORMS + ATTENTION} for i in range(n)]
        for i in range(n):
            if not cfg.moe.is_moe_layer(i):
                self.layers[i].update({name: read(lay.layer(i, name)) for name in DENSE_MLP})
        self.act = GatedActivation.from_config(cfg.moe)
        hd = cfg.head_dim
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    # -- the per-layer pieces -------------------------------------------------------------

    def _rope(self, x: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [B, heads, T, hd]`` by position (the half-split layout of HF Llama)."""
        ang = (pos_BT.double()[..., None] * self.inv_freq)[:, None]  # [B, 1, T, hd/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin

    def _attention(self, i: int, h_BTH: torch.Tensor, mb: _MicroBatch, pos_BT: torch.Tensor,
                   ends_B: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.layers[i]
        B, T, _ = h_BTH.shape
        heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def proj(name: str, n: int) -> torch.Tensor:
            return (h_BTH @ w[name].t()).view(B, T, n, hd).transpose(1, 2)

        q = self._rope(proj("self_attn.q_proj", heads), pos_BT)
        k = self._rope(proj("self_attn.k_proj", kv), pos_BT)
        v = proj("self_attn.v_proj", kv)
        # Scatter the new keys/values at their positions; padded tokens land past the row's end,
        # where the mask hides them until a real token overwrites the slot.
        idx = pos_BT[:, None, :, None].expand(B, kv, T, hd)
        mb.k[i].scatter_(2, idx, k)
        mb.v[i].scatter_(2, idx, v)
        S = int(ends_B.max())
        keys = torch.arange(S)
        mask = (keys <= pos_BT[..., None]) & (keys < ends_B[:, None, None])  # [B, T, S]
        group = heads // kv
        kk = mb.k[i][:, :, :S].repeat_interleave(group, 1)
        vv = mb.v[i][:, :, :S].repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, None])
        return o.transpose(1, 2).reshape(B, T, heads * hd) @ w["self_attn.o_proj"].t()

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self.layers[i]
        a = self.act(h @ w["mlp.gate_proj"].t(), h @ w["mlp.up_proj"].t()).to(h.dtype)
        return a @ w["mlp.down_proj"].t()

    async def _forward(self, mb: _MicroBatch, tokens_BT: torch.Tensor, new_B: torch.Tensor) -> torch.Tensor:
        """Run ``tokens_BT`` (row ``b`` has ``new_B[b]`` real tokens, then padding) through the
        model with ``self.moe`` as its MoE layers, append them to the cache and return the logits
        of each row's last real token."""
        steps = self.layers_of(mb, tokens_BT, new_B)
        moe_out = None
        try:
            while True:
                layer, rows = steps.send(moe_out)
                moe_out = await self.moe(rows, layer)
        except StopIteration as done:
            return done.value

    def layers_of(self, mb: _MicroBatch, tokens_BT: torch.Tensor,
                  new_B: torch.Tensor) -> Generator[tuple[int, torch.Tensor], torch.Tensor, torch.Tensor]:
        """:meth:`_forward` as a generator for whoever runs the MoE layers: yields ``(layer,
        rows)`` for each MoE layer in order (the real tokens only), takes that layer's output
        back (``send``), and returns the logits."""
        c = self.cfg
        eps = c.moe.rms_norm_eps
        B, T = tokens_BT.shape
        pos_BT = mb.lengths[:, None] + torch.arange(T)
        ends_B = mb.lengths + new_B
        real_BT = torch.arange(T) < new_B[:, None]
        x = self.embed[tokens_BT]
        for i, w in enumerate(self.layers):
            x = x + self._attention(i, rms_norm(x, w["input_layernorm"], eps), mb, pos_BT, ends_B)
            h = rms_norm(x, w["post_attention_layernorm"], eps)
            if not c.moe.is_moe_layer(i):
                x = x + self._mlp(i, h)
                continue
            out = yield i, h[real_BT].contiguous()  # real tokens only: padding never travels
            x[real_BT] += out.to(x.dtype)
        mb.lengths = ends_B
        last = x[torch.arange(B), new_B - 1]
        return (rms_norm(last, self.final_norm, eps) @ self.lm_head.t()).float()

    # -- generation -----------------------------------------------------------------------

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, micro_batches: int = 1) -> None:
        """ValueError naming what is wrong with a generation's arguments."""
        V = self.cfg.vocab_size
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
        for n, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {n} is empty: each prompt needs at least one token")
            bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {n} has token id(s) {bad[:5]} outside 0..{V - 1} (vocab_size {V})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 1 <= micro_batches <= len(prompts):
            raise ValueError(f"micro_batches must be in 1..{len(prompts)} (the batch size), "
                             f"got {micro_batches}")

    def micro_batch(self, prompts: list[list[int]], max_new_tokens: int) -> _MicroBatch:
        """Rows decoded together, with an empty KV cache for their prompts and new tokens."""
        c = self.cfg
        shape = (len(prompts), c.num_key_value_heads, max(map(len, prompts)) + max_new_tokens, c.head_dim)
        n = c.moe.num_hidden_layers
        return _MicroBatch(prompts, [torch.zeros(shape, dtype=self.dtype) for _ in range(n)],
                           [torch.zeros(shape, dtype=self.dtype) for _ in range(n)],
                           torch.zeros(len(prompts), dtype=torch.long))

    @staticmethod
    def step_inputs(mb: _MicroBatch, logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens_BT, new_B)`` of the next forward: the prompts (``logits`` None: the prefill),
        else each row's greedy token after ``logits``."""
        if logits is not None:
            return logits.argmax(-1)[:, None], torch.ones(len(mb.prompts), dtype=torch.long)
        lens = torch.tensor([len(p) for p in mb.prompts])
        tokens = torch.zeros(len(mb.prompts), int(lens.max()), dtype=torch.long)
        for b, p in enumerate(mb.prompts):
            tokens[b, : len(p)] = torch.tensor(p)
        return tokens, lens

    async def _prefill(self, mb: _MicroBatch) -> torch.Tensor:
        return await self._forward(mb, *self.step_inputs(mb, None))

    async def _decode(self, mb: _MicroBatch, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
        out = [logits]
        for _ in range(steps):
            out.append(await self._forward(mb, *self.step_inputs(mb, out[-1])))
        return out

    async def generate_async(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                             micro_batches: int = 1) -> Generation:
        """Greedy-decode ``max_new_tokens`` per prompt with ``micro_batches`` groups in flight."""
        self.check(prompts, max_new_tokens, micro_batches)
        rows = [list(p) for p in prompts]
        mbs = [self.micro_batch(rows[s], max_new_tokens) for s in split_rows(len(rows), micro_batches)]
        start = time.perf_counter()
        first = await asyncio.gather(*(self._prefill(mb) for mb in mbs))
        prefilled = time.perf_counter()
        steps = await asyncio.gather(*(self._decode(mb, lg, max_new_tokens - 1)
                                       for mb, lg in zip(mbs, first, strict=True)))
        done = time.perf_counter()
        logits = torch.cat([torch.stack(s, 1) for s in steps])  # [B, N, V]
        return Generation(logits.argmax(-1), logits, prefilled - start, done - prefilled)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 micro_batches: int = 1) -> Generation:
        """Blocking :meth:`generate_async` (not from inside a running event loop)."""
        return asyncio.run(self.generate_async(prompts, max_new_tokens, micro_batches))


class DecoderWorker(AttentionWorker):
    """The decoder as a cohort's attention worker (``client.cohort``): its own prompts and KV
    cache; each step decodes one token for every prompt (the first step is the prefill, which
    sends every prompt token's rows), and returns the new token ids. Run it as a Ray actor::

        workers = [ray.remote(DecoderWorker).remote(checkpoint, prompts_i, max_new_tokens) ...]
        with MoEClient(app).cohort(workers, max_tokens=...) as cohort:   # >= the prompts' tokens
            for _ in range(max_new_tokens):
                new_tokens = cohort.step([None] * len(workers))

    ``generation()`` returns everything decoded so far (tokens and logits), as
    :meth:`Decoder.generate` does. Step inputs are not used.
    """

    def __init__(self, checkpoint: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 dtype: torch.dtype = torch.float32):
        self.model = Decoder(checkpoint, None, dtype)
        self.model.check(prompts, max_new_tokens)
        self.max_new_tokens = max_new_tokens
        self.mb = self.model.micro_batch([list(p) for p in prompts], max_new_tokens)
        self.logits: list[torch.Tensor] = []  # one [B, V] per finished step
        self.steps: Generator | None = None  # the running step's layers
        self.pending: tuple[int, torch.Tensor] | torch.Tensor | None = None  # next (layer, rows), or logits
        self.lengths_before = self.mb.lengths.clone()

    def start(self, step_input: Any) -> None:
        if len(self.logits) >= self.max_new_tokens:
            raise ValueError(f"this worker decoded its max_new_tokens = {self.max_new_tokens} already")
        self.lengths_before = self.mb.lengths.clone()
        last = self.logits[-1] if self.logits else None
        self.steps = self.model.layers_of(self.mb, *self.model.step_inputs(self.mb, last))
        self.pending = self._advance(None)

    def _advance(self, moe_out: torch.Tensor | None) -> Any:
        try:
            return self.steps.send(moe_out)
        except StopIteration as done:
            return done.value

    def attend(self, layer: int) -> torch.Tensor:
        if not isinstance(self.pending, tuple) or self.pending[0] != layer:
            at = self.pending[0] if isinstance(self.pending, tuple) else "its end"
            raise ValueError(f"the cohort asks for MoE layer {layer}, but this decoder is at layer {at}: "
                             "the cohort must run every MoE layer of the model, in order")
        return self.pending[1]

    def absorb(self, layer: int, moe_out_TH: torch.Tensor) -> None:
        self.pending = self._advance(moe_out_TH)

    def finish(self) -> list[int]:
        if not isinstance(self.pending, torch.Tensor):
            raise ValueError(f"the step ended at MoE layer {self.pending[0]}: the cohort skipped layers")
        self.logits.append(self.pending)
        self.steps = self.pending = None
        return self.logits[-1].argmax(-1).tolist()

    def abort(self) -> None:
        """The step's keys and values stay in the cache past each row's length, where the mask
        hides them until the re-run overwrites them: restoring the lengths undoes the step."""
        self.mb.lengths = self.lengths_before.clone()
        self.steps = self.pending = None

    def generation(self) -> Generation:
        """Everything decoded so far: ``tokens [B, N]``, ``logits [B, N, V]`` (no timings)."""
        logits = torch.stack(self.logits, 1)
        return Generation(logits.argmax(-1), logits, 0.0, 0.0)


def tier_busy(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, float]:
    """Forwards and TP-group busy seconds between two ``status()`` answers of one deployment
    (``counters.forwards`` and ``counters.forward_ms.mean``)."""

    def busy(st: dict[str, Any]) -> tuple[int, float]:
        c = st["counters"]
        return c["forwards"], (c["forward_ms"]["mean"] or 0.0) * c["forwards"] / 1e3

    (n0, s0), (n1, s1) = busy(before), busy(after)
    return n1 - n0, s1 - s0
