"""MoonViT3d vision tower and its projector (Kimi-K3 and Kimi-K2.5).

Reads top to bottom in the order data meets it: patch embedding, position
embedding, 2-D rotary embedding, attention, MLP, block, tower, patch merge,
projector. Module names equal the checkpoint's key names, so loading needs
no renames. Images attend only within themselves (varlen); the model knows
nothing about ranks or requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig

Grid = tuple[int, int, int]


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    # K3's RMSNorm is built without eps: torch uses finfo(dtype).eps of the input.
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(dim)
    return nn.LayerNorm(dim, eps=1e-5)


class PositionEmbedding(nn.Module):
    """Learned (H, W, D) table resampled to each image's grid, plus a time term for t > 1."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.mode = cfg.pos_emb_interpolation_mode
        self.weight = nn.Parameter(
            torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size)
        )
        self.register_buffer(
            "time_weight", _sincos_table(cfg.hidden_size, cfg.pos_emb_time), persistent=False
        )

    def forward(self, grids: Sequence[Grid]) -> torch.Tensor:
        out = []
        for t, h, w in grids:
            if (h, w) == tuple(self.weight.shape[:2]):
                pos = self.weight.flatten(0, 1)
            else:
                table = self.weight.permute(2, 0, 1).unsqueeze(0)  # (1, D, H0, W0)
                pos = F.interpolate(table, size=(h, w), mode=self.mode, align_corners=False)
                pos = pos.squeeze(0).permute(1, 2, 0).flatten(0, 1)  # (h*w, D)
            if t > 1:
                time = self.time_weight[:t].to(pos.dtype)  # (t, 1, D)
                pos = (pos.unsqueeze(0) + time).flatten(0, 1)
            out.append(pos)
        return torch.cat(out)


def _sincos_table(dim: int, frames: int) -> torch.Tensor:
    """(frames, 1, dim) fixed sin/cos time embedding, computed in float32."""
    omega = torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).unsqueeze(1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(
            3, cfg.hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias
        )
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.proj(pixels).view(pixels.shape[0], -1)  # (num_patches, hidden)
        return x + self.pos_emb(grids)


def rope_2d(grids: Sequence[Grid], head_dim: int, theta: float, device) -> torch.Tensor:
    """(num_patches, head_dim/2) complex64 factors, fp32.

    Frequencies ``1/theta^(k/head_dim)`` for k = 0, 4, 8, ...; a patch at
    (y, x) gets ``[cis(x f0), cis(y f0), cis(x f1), cis(y f1), ...]``.
    """
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    )
    out = []
    for t, h, w in grids:
        ys = torch.arange(h, device=device).float().repeat_interleave(w)
        xs = torch.arange(w, device=device).float().repeat(h)
        angles = torch.stack([torch.outer(xs, freqs), torch.outer(ys, freqs)], dim=-1)
        cis = torch.polar(torch.ones_like(angles), angles).flatten(1)  # (h*w, head_dim/2)
        out.append(cis.repeat(t, 1))
    return torch.cat(out)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of x: (N, heads, head_dim) by cis: (N, head_dim/2)."""
    xc = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis.unsqueeze(1)).flatten(-2).type_as(x)


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

    def attention(self, x: torch.Tensor, cis: torch.Tensor, segments: list[int]) -> torch.Tensor:
        qkv = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each (N, heads, head_dim)
        q, k = apply_rope(q, cis), apply_rope(k, cis)
        out = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments), strict=True):
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
            )  # (1, heads, n, head_dim)
            out.append(o.squeeze(0).transpose(0, 1))
        return self.wo(torch.cat(out).flatten(1))  # (N, qkv) -> (N, hidden)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cis, segments)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, segments: list[int]) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cis, segments)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """MoonViT3d: patches of many images in, merged (tokens, kh*kw, hidden) out."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        cfg = self.cfg
        x = self.patch_embed(pixels, grids)
        cis = rope_2d(grids, cfg.head_dim, cfg.rope_theta, pixels.device)
        segments = [t * h * w for t, h, w in grids]
        x = self.encoder(x, cis, segments)
        return merge_patches(x, grids, cfg.merge_kernel_size)


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
        bias = cfg.variant == "k25"
        if bias:
            self.pre_norm = nn.LayerNorm(cfg.mm_hidden_size, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=bias),
            nn.GELU(),
            nn.Linear(width, cfg.text_hidden_size, bias=bias),
        )
        if not bias:
            self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "pre_norm"):
            merged = self.pre_norm(merged)
        x = self.proj(merged.flatten(1))  # (tokens, kh*kw*hidden) -> (tokens, text_hidden)
        return self.post_norm(x) if hasattr(self, "post_norm") else x


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
