"""MoonViT3d vision tower and its projector (Kimi-K3 and Kimi-K2.5).

Reads top to bottom in the order data meets it: patch embedding, position
embedding, 2-D rotary embedding, attention, MLP, block, tower, patch merge,
projector. Module names equal the checkpoint's key names, so loading needs
no renames. Images attend only within themselves (varlen); the model knows
nothing about ranks or requests.

Attention runs one of two ways (``choose_attention``): ``varlen``, one
``torch.nn.attention.varlen.varlen_attn`` call per layer over the whole batch,
when the tower runs on a CUDA device of compute capability 8.0 or newer, in
bfloat16 or float16 (flash attention takes no float32), this torch has
``varlen_attn`` and the batch's images are small (fewer than
``VARLEN_BELOW_MEAN_PATCHES`` patches on average); otherwise ``sdpa``, one
``scaled_dot_product_attention`` call per image (the CPU path, float32 on CUDA,
and batches of large images, where SDPA's own kernel choice, cuDNN's flash
attention on Hopper, beats ``varlen_attn``'s, except for many small images,
where one launch per image and layer makes SDPA wait on the host; the H200
figures are in docs/benchmarks/gpu-h200.md). Both use scale 1/sqrt(head_dim).
``varlen`` asks for ``num_splits=1`` where this torch accepts it, so an image's
attention output does not depend on which other images share its batch.

Tables that depend only on an image's grid (interpolated position embeddings,
rotary factors) are cached per (h, w), device and dtype in small LRU caches;
a cached table is bit for bit the one computed afresh.

Pieces between attention calls, for ``kimi_encoder.execution``: the patch
embedding, each block's ``pre_attention`` (norm, qkv, rotary) and
``post_attention`` (output projection, residuals, norm, MLP), and the projector
are plain tensor code, which ``torch.compile`` takes whole ("piecewise"), with the
patch count left dynamic. Attention stays outside them: its segments are a list of
lengths (one SDPA call per image, or ``varlen_attn``'s Python ``max_len``), which
would specialize a compiled graph on every batch's composition, and both already
call fused attention kernels. ``VisionTower.encode`` is everything from pixels to
the final norm over tables computed beforehand: what a CUDA graph captures.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .tables import TableCache


@functools.cache
def varlen_function() -> Callable | None:
    """This torch's ``varlen_attn``, or None (torch before 2.10). Imported on first use: its
    module imports ``torch._dynamo``, about a second of every process's start that a CPU
    rank, an ingress or a client never needs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


Grid = tuple[int, int, int]
# Grids whose derived tables each cache keeps: a rank fed images of many shapes computes
# one table per grid, and below the byte bound thousands of small ones added up
# (docs/benchmarks.md, "Soak").
TABLE_GRIDS = 64
ATTENTION_CHOICES = ("auto", "varlen", "sdpa")


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    # K3's RMSNorm is built without eps: torch uses finfo(dtype).eps of the input.
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(dim)
    return nn.LayerNorm(dim, eps=1e-5)


class PositionEmbedding(nn.Module):
    """Learned (H, W, D) table resampled to each image's grid, plus a time term for t > 1.

    The result is read-only (for one image it may be the cached table itself).
    Resampled tables are cached per (h, w) while gradients are off. The cache
    is emptied whenever the weight may have changed: another tensor or storage
    behind ``weight``, an in-place write (its version counter), a
    ``load_state_dict`` or a ``.to()``/``.half()``/``.cuda()``.
    """

    def __init__(self, cfg: VisionConfig, cache_bytes: int = 256 << 20):
        super().__init__()
        self.mode = cfg.pos_emb_interpolation_mode
        self.weight = nn.Parameter(
            torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size)
        )
        table = _sincos_table(cfg.hidden_size, cfg.pos_emb_time)  # on the CPU, then moved
        self.register_buffer("time_weight", table.to(torch.get_default_device()), persistent=False)
        self.tables = TableCache(cache_bytes, TABLE_GRIDS)
        self._stamp: tuple | None = None  # what the cached tables were computed from

    def reset_buffers(self) -> None:
        """Recompute the fixed time table in place of whatever ``to_empty`` left there (it
        is no parameter: checkpoints do not hold it)."""
        frames, _, dim = self.time_weight.shape
        self.time_weight = _sincos_table(dim, frames).to(self.time_weight.device)

    def forward(self, grids: Sequence[Grid]) -> torch.Tensor:
        out = []
        for t, h, w in grids:
            pos = self.table(h, w)  # (h*w, D)
            if t > 1:
                time = self.time_weight[:t].to(pos.dtype)  # (t, 1, D)
                pos = (pos.unsqueeze(0) + time).flatten(0, 1)
            out.append(pos)
        return out[0] if len(out) == 1 else torch.cat(out)  # one image: the table itself

    def table(self, h: int, w: int) -> torch.Tensor:
        """(h*w, D): the weight resampled to an h x w grid, cached where that is safe."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        # Training needs the graph; an inference tensor has no version counter to watch.
        if torch.is_grad_enabled() or self.weight.is_inference():
            return self.interpolate(h, w)
        weight = self.weight
        stamp = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
        if self._stamp is None or self._stamp[0]() is not weight or self._stamp[1:] != stamp:
            self.tables.clear()
            self._stamp = (weakref.ref(weight), *stamp)
        return self.tables.get((h, w), self.interpolate, h, w)

    def interpolate(self, h: int, w: int) -> torch.Tensor:
        """(h*w, D): the weight resampled to an h x w grid (uncached)."""
        table = self.weight.permute(2, 0, 1).unsqueeze(0)  # (1, D, H0, W0)
        pos = F.interpolate(table, size=(h, w), mode=self.mode, align_corners=False)
        # Contiguous, as every other table is: one layout for a compiled patch embedding.
        return pos.squeeze(0).permute(1, 2, 0).flatten(0, 1).contiguous()  # (h*w, D)

    def _apply(self, fn, recurse=True):
        self.tables.clear()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.tables.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_stamp": None}  # a weak reference does not pickle


def _sincos_table(dim: int, frames: int) -> torch.Tensor:
    """(frames, 1, dim) fixed sin/cos time embedding, computed in float32 on the CPU even
    where a model is built under a device context: a meta ``arange`` runs torch's Python
    decompositions, which import ``torch._dynamo`` (a second of every rank's start)."""
    omega = torch.arange(dim // 2, dtype=torch.float32, device="cpu") / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angles = torch.arange(frames, dtype=torch.float32, device="cpu")[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).unsqueeze(1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(
            3, cfg.hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias
        )
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixels: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N, 3, p, p) pixels and their (N, hidden) position embedding -> (N, hidden)."""
        # The patch-sized, patch-strided convolution is one matmul over flattened patches:
        # the same numbers, without cuDNN (whose float32 convolutions run in TF32 by
        # default, so float32 on CUDA would not be float32). The weights stay the conv's.
        weight = self.proj.weight.flatten(1)  # (hidden, 3*p*p)
        return F.linear(pixels.flatten(1), weight, self.proj.bias) + pos


def rope_table(h: int, w: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """(h*w, head_dim/2, 2) rotations of one frame, patches row-major: each angle's
    (cos, sin), the real view of its complex factor.

    Frequencies ``1/theta^(k/head_dim)`` for k = 0, 4, 8, ...; a patch at
    (y, x) gets ``[cis(x f0), cis(y f0), cis(x f1), cis(y f1), ...]``.
    """
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    )
    ys = torch.arange(h, device=device).float().repeat_interleave(w)
    xs = torch.arange(w, device=device).float().repeat(h)
    angles = torch.stack([torch.outer(xs, freqs), torch.outer(ys, freqs)], dim=-1)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles).flatten(1))


class Rope2D(nn.Module):
    """(num_patches, head_dim/2, 2) rotations of several images: each frame's
    ``rope_table``, cached per (h, w) and device, repeated over its t frames (read-only,
    like the position embedding)."""

    def __init__(self, head_dim: int, theta: float, cache_bytes: int = 64 << 20):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.tables = TableCache(cache_bytes, TABLE_GRIDS)

    def forward(self, grids: Sequence[Grid], device: torch.device) -> torch.Tensor:
        out = []
        for t, h, w in grids:
            key = (h, w, device)
            table = self.tables.get(key, rope_table, h, w, self.head_dim, self.theta, device)
            out.append(table if t == 1 else table.repeat(t, 1, 1))
        return out[0] if len(out) == 1 else torch.cat(out)  # one image: the table itself


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of x: (N, heads, head_dim) by rope: (N, head_dim/2, 2).

    Eager: one complex multiplication (faster on CPU than the real formula's strided
    arithmetic, docs/gpu.md). Compiled: the real formula, which inductor fuses (it
    generates no code for complex numbers); the two agree within float rounding.
    """
    if torch.compiler.is_compiling():
        return rotate_pairs(x, rope)
    xc = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    cis = torch.view_as_complex(rope).unsqueeze(1)  # (N, 1, head_dim/2)
    return torch.view_as_real(xc * cis).flatten(-2).type_as(x)


def rotate_pairs(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in real arithmetic: (a, b) -> (a cos - b sin, a sin + b cos)."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (N, heads, head_dim/2)
    cos, sin = rope.unsqueeze(1).unbind(-1)  # each (N, 1, head_dim/2)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


@dataclass(frozen=True)
class Segments:
    """Where each image lies in the packed patch sequence, and how attention runs over it.

    ``cu_seqlens`` is (images + 1,) int32 offsets on the device, built once per
    forward for the ``varlen`` path (None on the ``sdpa`` path).
    """

    lengths: list[int]
    max_len: int
    kernel: str  # 'varlen' or 'sdpa'
    cu_seqlens: torch.Tensor | None = None

    @classmethod
    def of(
        cls, grids: Sequence[Grid], device: torch.device, dtype: torch.dtype, requested: str
    ) -> Segments:
        lengths = [t * h * w for t, h, w in grids]
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        mean = sum(lengths) / max(len(lengths), 1)
        # Off CUDA only an explicit 'varlen' needs the function (for its error message).
        wants = device.type == "cuda" or requested == "varlen"
        varlen_fn = varlen_function() if wants else None
        kernel = choose_attention(requested, device.type, dtype, capability, varlen_fn, mean)
        offsets, max_len = cumulative_lengths(lengths)
        cu = None
        if kernel == "varlen":  # pinned and asynchronous: the host does not wait for the GPU
            host = torch.tensor(offsets, dtype=torch.int32).pin_memory()
            cu = host.to(device, non_blocking=True)
        return cls(lengths, max_len, kernel, cu)


# 'auto' takes varlen_attn only for batches of small images (module docstring).
VARLEN_BELOW_MEAN_PATCHES = 512


def cumulative_lengths(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Offsets ``[0, l0, l0 + l1, ...]`` of packed sequences and the longest length.

    >>> cumulative_lengths([4, 16, 8])
    ([0, 4, 20, 28], 16)
    """
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets, max(lengths, default=0)


def choose_attention(
    requested: str,
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    varlen_fn: Callable | None,
    mean_patches: float = 0.0,
) -> str:
    """'varlen' or 'sdpa' (module docstring): ``requested`` is 'auto', 'varlen' or 'sdpa'.

    ``capability`` is the CUDA device's (major, minor), ``varlen_fn`` this torch's
    ``varlen_attn`` (None when it has none), ``mean_patches`` the batch's mean image length.
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(
            f"Unknown attention {requested!r}; allowed: {', '.join(ATTENTION_CHOICES)}."
        )
    why = varlen_unsupported(device_type, dtype, capability, varlen_fn)
    if requested == "varlen" and why:
        raise ValueError(f"attention 'varlen' {why}. Use attention 'auto' or 'sdpa'.")
    small = mean_patches < VARLEN_BELOW_MEAN_PATCHES
    fits = why is None
    return "varlen" if requested == "varlen" or (requested == "auto" and fits and small) else "sdpa"


def varlen_unsupported(
    device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, varlen_fn
) -> str | None:
    """Why ``varlen_attn`` cannot run here (arguments as ``choose_attention``'s), or None."""
    if (
        device_type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and capability is not None
        and capability >= (8, 0)
        and varlen_fn is not None
    ):
        return None
    return (
        f"needs a CUDA device of compute capability 8.0+, bfloat16 or float16 and "
        f"torch.nn.attention.varlen.varlen_attn; got device {device_type!r} (capability "
        f"{capability}), dtype {dtype}, varlen_attn {'present' if varlen_fn else 'missing'}"
    )


@functools.cache
def varlen_options(varlen_fn: Callable, head_dim: int) -> dict:
    """The keywords to pass to this torch's ``varlen_attn``: ``scale`` and ``num_splits=1``
    where it takes them (without ``scale`` it already uses 1/sqrt(head_dim))."""
    params = inspect.signature(varlen_fn).parameters
    options: dict = {}
    if "scale" in params:
        options["scale"] = head_dim**-0.5
    if "num_splits" in params:
        options["num_splits"] = 1
    return options


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Full attention within each image: (N, heads, head_dim) each -> (N, heads, head_dim)."""
    if seg.kernel == "varlen":
        varlen_attn = varlen_function()
        options = varlen_options(varlen_attn, q.shape[-1])
        cu = seg.cu_seqlens
        return varlen_attn(q, k, v.contiguous(), cu, cu, seg.max_len, seg.max_len, **options)
    out = []
    split = seg.lengths
    for qs, ks, vs in zip(q.split(split), k.split(split), v.split(split), strict=True):
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
        )  # (1, heads, n, head_dim)
        out.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(out)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)
        self.approximate = "tanh" if cfg.activation == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm transformer block; attention restricted to each image's segment."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = _norm(cfg, cfg.hidden_size)
        self.norm1 = _norm(cfg, cfg.hidden_size)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.qkv_hidden_size, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.hidden_size, bias=cfg.attn_bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        q, k, v = self.pre_attention(x, rope)
        return self.post_attention(x, attend(q, k, v, segments))

    def pre_attention(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm, qkv projection, rotary: (N, hidden) -> q, k, v, each (N, heads, head_dim)."""
        qkv = self.wqkv(self.norm0(x)).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and residual, then the MLP and its residual: (N, hidden)."""
        x = x + self.wo(attended.flatten(1))  # (N, heads, head_dim) -> (N, hidden)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, rope, segments)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """MoonViT3d: patches of many images in, merged (tokens, kh*kw, hidden) out."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_kernel = "auto"  # or 'varlen' / 'sdpa' to force a kernel (choose_attention)
        self.patch_embed = PatchEmbed(cfg)
        self.rope = Rope2D(cfg.head_dim, cfg.rope_theta)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        dtype = self.patch_embed.proj.weight.dtype  # of every activation
        segments = Segments.of(grids, pixels.device, dtype, self.attention_kernel)
        pos = self.patch_embed.pos_emb(grids)
        x = self.encode(pixels, pos, self.rope(grids, pixels.device), segments)
        return merge_patches(x, grids, self.cfg.merge_kernel_size)

    def encode(
        self, pixels: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        """Packed patches with their grids' tables -> final hidden states (N, hidden)."""
        return self.encoder(self.patch_embed(pixels, pos), rope, segments)


def merge_patches(x: torch.Tensor, grids: Sequence[Grid], kernel: tuple[int, int]) -> torch.Tensor:
    """Mean over time, then kh x kw blocks -> (sum of h/kh * w/kw, kh*kw, hidden).

    Merged tokens are row-major; sub-patches within one are ordered
    (0,0), (0,1), (1,0), (1,1).
    """
    kh, kw = kernel
    out = []
    for seq, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids, strict=True):
        seq = seq.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
        seq = seq[0] if t == 1 else seq.mean(dim=0)
        out.append(seq.reshape((h // kh) * (w // kw), kh * kw, -1))
    return torch.cat(out)


class Projector(nn.Module):
    """Merged patches -> LLM hidden size.

    K3 (``patchmergerv2``): Linear, exact GELU, Linear (no biases), RMSNorm.
    K2.5 (``patchmerger``): LayerNorm per sub-patch first, biased Linears, no post-norm.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.mm_hidden_size * cfg.merge_area
        k25 = cfg.variant == "k25"
        eps = cfg.projector_ln_eps
        # Only the variant's norm exists as a module (its keys are the checkpoint's).
        self.pre_norm = nn.LayerNorm(cfg.mm_hidden_size, eps=eps) if k25 else None
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=k25),
            nn.GELU(),
            nn.Linear(width, cfg.text_hidden_size, bias=k25),
        )
        self.post_norm = None if k25 else nn.RMSNorm(cfg.text_hidden_size, eps=eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        if self.pre_norm is not None:  # K2.5
            merged = self.pre_norm(merged)
        x = self.proj(merged.flatten(1))  # (tokens, kh*kw*hidden) -> (tokens, text_hidden)
        return x if self.post_norm is None else self.post_norm(x)  # K3: RMSNorm


class KimiVisionModel(nn.Module):
    """Tower and projector; state-dict keys equal the checkpoint's."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = Projector(cfg)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """(sum t*h*w, 3, p, p) pixels of several images -> (sum of tokens, text_hidden)."""
        pixels = pixels.to(self.vision_tower.patch_embed.proj.weight.dtype)
        return self.mm_projector(self.vision_tower(pixels, grids))
