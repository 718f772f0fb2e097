"""The tower's plumbing: attention dispatch, packed lengths and cached grid tables.

Cached position embeddings and rotary factors must be bit for bit the tables
computed afresh (the uncached formulas are restated here as they were before
caching), and the position-embedding cache must notice every way its weight
can change. The CUDA tests compare the varlen kernel with per-image SDPA.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F

from kimi_encoder import model as m
from kimi_encoder.config import get_preset
from kimi_encoder.weights import random_model, random_state_dict

TINY = get_preset("tiny").vision  # pos-emb table 16 x 16, head_dim 24
GRIDS = [(1, 8, 12), (1, 16, 16), (2, 6, 4), (1, 2, 2), (1, 40, 10), (1, 8, 12), (3, 2, 6)]


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(TINY, seed=3, device="cpu", dtype=torch.float32)


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    ("lengths", "offsets", "longest"),
    [([], [0], 0), ([4], [0, 4], 4), ([4, 16, 8], [0, 4, 20, 28], 16), ([9, 9], [0, 9, 18], 9)],
    ids=["none", "one", "three", "equal"],
)
def test_cumulative_lengths(lengths, offsets, longest):
    assert m.cumulative_lengths(lengths) == (offsets, longest)


def _varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    raise AssertionError("only its presence matters to choose_attention")


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
H200, T4 = (9, 0), (7, 5)
DISPATCH = [
    # requested, device, dtype, capability, has varlen_attn, kernel
    ("auto", "cuda", BF16, H200, True, "varlen"),
    ("auto", "cuda", F16, (8, 0), True, "varlen"),
    ("auto", "cuda", F32, H200, True, "sdpa"),  # flash attention takes no float32
    ("auto", "cuda", BF16, T4, True, "sdpa"),  # flash attention needs sm80+
    ("auto", "cuda", BF16, H200, False, "sdpa"),  # torch before varlen_attn
    ("auto", "cpu", BF16, None, True, "sdpa"),
    ("auto", "cpu", F32, None, True, "sdpa"),
    ("sdpa", "cuda", BF16, H200, True, "sdpa"),
    ("varlen", "cuda", BF16, H200, True, "varlen"),
]


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "capability", "present", "kernel"),
    DISPATCH,
    ids=[f"{r}-{d}-{str(t)[6:]}-{c}-{'fn' if p else 'nofn'}" for r, d, t, c, p, _ in DISPATCH],
)
def test_choose_attention(requested, device, dtype, capability, present, kernel):
    fn = _varlen_stand_in if present else None
    assert m.choose_attention(requested, device, dtype, capability, fn) == kernel


def test_auto_takes_sdpa_for_large_images_on_cuda():
    """Measured on an H200: per-image SDPA beats varlen_attn once images are large."""
    below, at = m.VARLEN_BELOW_MEAN_PATCHES - 1, m.VARLEN_BELOW_MEAN_PATCHES
    assert m.choose_attention("auto", "cuda", BF16, H200, _varlen_stand_in, below) == "varlen"
    assert m.choose_attention("auto", "cuda", BF16, H200, _varlen_stand_in, at) == "sdpa"
    assert m.choose_attention("varlen", "cuda", BF16, H200, _varlen_stand_in, at) == "varlen"


def test_forced_varlen_where_it_cannot_run():
    with pytest.raises(
        ValueError, match=r"attention 'varlen' needs a CUDA device .* got device 'cpu'"
    ):
        m.choose_attention("varlen", "cpu", BF16, None, _varlen_stand_in)
    with pytest.raises(
        ValueError, match=r"dtype torch\.float32, varlen_attn present\. Use attention"
    ):
        m.choose_attention("varlen", "cuda", F32, H200, _varlen_stand_in)


def test_unknown_attention_choice():
    with pytest.raises(ValueError, match="Unknown attention 'flash'; allowed: auto, varlen, sdpa"):
        m.choose_attention("flash", "cuda", BF16, H200, _varlen_stand_in)


def test_segments_on_cpu():
    seg = m.Segments.of(GRIDS[:3], torch.device("cpu"), BF16, "auto")
    assert seg.kernel == "sdpa"
    assert seg.cu_seqlens is None
    assert seg.lengths == [96, 256, 48]
    assert seg.max_len == 256
    with pytest.raises(ValueError, match="attention 'varlen' needs a CUDA device"):
        m.Segments.of(GRIDS[:3], torch.device("cpu"), BF16, "varlen")


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
    """The first public signature (torch 2.10, less return_aux): no scale, no num_splits."""


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (_varlen_2_10, {}),
        (m.varlen_function(), {"scale": 128**-0.5, "num_splits": 1}),
    ],
    ids=["torch-2.10", "this-torch"],
)
def test_varlen_options(fn, expected):
    if fn is None:
        pytest.skip("this torch has no varlen_attn")
    params = inspect.signature(fn).parameters
    expected = {k: v for k, v in expected.items() if k in params}
    assert m.varlen_options(fn, 128) == expected


# ----------------------------------------------------------------------------- cached tables


def _position_reference(pos_emb: m.PositionEmbedding, grids, weight=None) -> torch.Tensor:
    """The uncached position embedding, as written before caching (of ``weight`` if given)."""
    weight = pos_emb.weight.detach() if weight is None else weight
    mode = pos_emb.mode
    out = []
    for t, h, w in grids:
        if (h, w) == tuple(weight.shape[:2]):
            pos = weight.flatten(0, 1)
        else:
            table = weight.permute(2, 0, 1).unsqueeze(0)
            pos = F.interpolate(table, size=(h, w), mode=mode, align_corners=False)
            pos = pos.squeeze(0).permute(1, 2, 0).flatten(0, 1)
        if t > 1:
            pos = (pos.unsqueeze(0) + pos_emb.time_weight[:t].to(pos.dtype)).flatten(0, 1)
        out.append(pos)
    return torch.cat(out)


def _rope_reference(grids, head_dim: int, theta: float) -> torch.Tensor:
    """The uncached rotary factors, as written before caching, as (cos, sin) pairs."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim))
    out = []
    for t, h, w in grids:
        ys = torch.arange(h).float().repeat_interleave(w)
        xs = torch.arange(w).float().repeat(h)
        angles = torch.stack([torch.outer(xs, freqs), torch.outer(ys, freqs)], dim=-1)
        cis = torch.polar(torch.ones_like(angles), angles).flatten(1)
        out.append(cis.repeat(t, 1))
    return torch.view_as_real(torch.cat(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_cached_position_embedding_is_bitwise_fresh(tiny_model, mode, dtype):
    pos = m.PositionEmbedding(
        m.VisionConfig(**{**TINY.__dict__, "pos_emb_interpolation_mode": mode})
    )
    with torch.no_grad():
        pos.weight.copy_(tiny_model.vision_tower.patch_embed.pos_emb.weight)
    pos = pos.to(dtype)
    want = _position_reference(pos, GRIDS)
    with torch.inference_mode():
        first = pos(GRIDS)  # misses (and one repeat grid: a hit)
        again = pos(GRIDS)  # hits
    assert len(pos.tables) == 5  # distinct (h, w) other than the table's own 16 x 16
    assert torch.equal(first, want)
    assert torch.equal(again, want)
    for single in ([(1, 8, 12)], [(2, 6, 4)], [(1, 16, 16)]):  # one image: no concatenation
        with torch.inference_mode():
            assert torch.equal(pos(single), _position_reference(pos, single)), single


def test_cached_rope_is_bitwise_fresh():
    rope = m.Rope2D(TINY.head_dim, TINY.rope_theta)
    want = _rope_reference(GRIDS, TINY.head_dim, TINY.rope_theta)
    first, again = rope(GRIDS, torch.device("cpu")), rope(GRIDS, torch.device("cpu"))
    assert len(rope.tables) == 6
    assert first.dtype == torch.float32
    assert first.shape[1:] == (TINY.head_dim // 2, 2)
    assert torch.equal(first, want)
    assert torch.equal(again, want)
    for single in ([(1, 8, 12)], [(3, 2, 6)]):  # one image: no concatenation
        got = rope(single, torch.device("cpu"))
        assert torch.equal(got, _rope_reference(single, TINY.head_dim, TINY.rope_theta)), single
    k3 = get_preset("k3").vision  # head_dim 128
    assert torch.equal(
        m.Rope2D(k3.head_dim, k3.rope_theta)(GRIDS, torch.device("cpu")),
        _rope_reference(GRIDS, k3.head_dim, k3.rope_theta),
    )


@pytest.mark.parametrize(
    "grids", [[(1, 4, 6), (1, 16, 16), (1, 2, 2), (1, 4, 6)], [(1, 4, 6)]], ids=["four", "one"]
)
def test_tower_with_warm_caches_is_bitwise_cold(tiny_model, grids):
    pixels = torch.randn(
        sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=torch.Generator().manual_seed(1)
    )
    tiny_model.vision_tower.patch_embed.pos_emb.tables.clear()
    tiny_model.vision_tower.rope.tables.clear()
    with torch.inference_mode():
        cold = tiny_model(pixels, grids)
        warm = tiny_model(pixels, grids)
    assert len(tiny_model.vision_tower.rope.tables) > 0
    assert torch.equal(cold, warm)


def _fresh_weight(seed: int) -> torch.Tensor:
    return random_state_dict(TINY, seed)["vision_tower.patch_embed.pos_emb.weight"]


def _in_place_copy(model, weight):
    with torch.no_grad():
        model.vision_tower.patch_embed.pos_emb.weight.copy_(weight)


def _load_state_dict(model, weight, assign=False):
    state = model.state_dict()
    state["vision_tower.patch_embed.pos_emb.weight"] = weight.clone()
    model.load_state_dict(state, assign=assign)


def _new_parameter(model, weight):
    model.vision_tower.patch_embed.pos_emb.weight = torch.nn.Parameter(weight.clone())


def _replace_data(model, weight):
    model.vision_tower.patch_embed.pos_emb.weight.data = weight.clone()


CHANGES = {
    "in-place-copy": _in_place_copy,
    "load-state-dict": _load_state_dict,
    "load-state-dict-assign": lambda model, w: _load_state_dict(model, w, assign=True),
    "new-parameter": _new_parameter,
    "replace-data": _replace_data,
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_position_cache_follows_weight_changes(change):
    model = random_model(TINY, seed=3, device="cpu", dtype=torch.float32)
    pos = model.vision_tower.patch_embed.pos_emb
    with torch.inference_mode():
        before = pos(GRIDS)
    assert len(pos.tables) > 0
    new = _fresh_weight(seed=11)
    change(model, new)
    with torch.inference_mode():
        after = pos(GRIDS)
    assert torch.equal(after, _position_reference(pos, GRIDS, weight=new))
    assert not torch.equal(after, before)


def test_position_cache_follows_dtype_round_trip():
    """half() then float() rounds the weight; the float32 tables must be recomputed."""
    model = random_model(TINY, seed=3, device="cpu", dtype=torch.float32)
    pos = model.vision_tower.patch_embed.pos_emb
    with torch.inference_mode():
        pos(GRIDS)
    model.half().float()
    with torch.inference_mode():
        got = pos(GRIDS)
    assert torch.equal(got, _position_reference(pos, GRIDS))  # the rounded weight's tables


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_start_with_empty_caches(tiny_model, how):
    pixels = torch.randn(24 + 4, 3, 14, 14, generator=torch.Generator().manual_seed(2))
    grids = [(1, 4, 6), (1, 2, 2)]
    with torch.inference_mode():
        want = tiny_model(pixels, grids)  # fills the original's caches
    if how == "deepcopy":
        twin = copy.deepcopy(tiny_model)
    else:
        twin = pickle.loads(pickle.dumps(tiny_model))
    assert len(twin.vision_tower.patch_embed.pos_emb.tables) == 0
    assert len(twin.vision_tower.rope.tables) == 0
    with torch.inference_mode():
        assert torch.equal(twin(pixels, grids), want)
    assert len(twin.vision_tower.rope.tables) == 2


def test_position_cache_stays_off_with_gradients():
    model = random_model(TINY, seed=3, device="cpu", dtype=torch.float32)
    pos = model.vision_tower.patch_embed.pos_emb
    out = pos(GRIDS)
    assert len(pos.tables) == 0
    out.sum().backward()
    assert pos.weight.grad is not None
    assert pos.weight.grad.abs().sum() > 0


def test_table_cache_is_a_bounded_lru():
    cache = m.TableCache(max_bytes=3 * 400)  # three 100-float tables

    def table(value: float, n: int = 100) -> torch.Tensor:
        return torch.full((n,), value)

    for key in "abc":
        cache.get(key, table, float(ord(key)))
    cache.get("a", table, -1.0)  # a hit: not recomputed, now most recent
    assert cache.get("a", table, -1.0)[0] == ord("a")
    cache.get("d", table, 4.0)  # evicts b, the least recently used
    assert list(cache._tables) == ["c", "a", "d"]
    assert cache.bytes == 1200
    big = cache.get("huge", table, 5.0, 1000)  # over the bound: returned, not kept
    assert big.numel() == 1000
    assert "huge" not in cache._tables
    assert cache.bytes == 1200
    cache.clear()
    assert len(cache) == 0
    assert cache.bytes == 0


def test_table_cache_keeps_at_most_max_entries_tables():
    cache = m.TableCache(max_bytes=1 << 20, max_entries=3)
    for key in range(10):  # tiny tables: far below the byte bound
        cache.get(key, torch.zeros, 4)
    assert list(cache._tables) == [7, 8, 9]
    assert cache.bytes == 3 * 16
    off = m.TableCache(max_bytes=1 << 20, max_entries=0)
    assert off.get("a", torch.zeros, 4).numel() == 4
    assert len(off) == 0


@pytest.mark.parametrize(("max_bytes", "max_entries"), [(-1, 4), (4, -1)], ids=["bytes", "entries"])
def test_table_cache_refuses_a_negative_bound(max_bytes, max_entries):
    with pytest.raises(ValueError, match=r"max_bytes >= 0 and max_entries >= 0, got"):
        m.TableCache(max_bytes, max_entries)


def test_a_tower_fed_many_grids_keeps_table_grids_tables_each():
    """Images of many shapes: one position-embedding and one rotary table per grid, at most
    ``TABLE_GRIDS`` of each kept, the latest grids'."""
    model = random_model(TINY, seed=3, device="cpu", dtype=torch.float32)
    pos = model.vision_tower.patch_embed.pos_emb
    rope = next(mod for mod in model.modules() if isinstance(mod, m.Rope2D))
    grids = [(1, 2 * h, 2 * w) for h in range(1, 13) for w in range(1, 13)]  # 144 grids
    assert len(grids) > 2 * m.TABLE_GRIDS
    with torch.no_grad():
        for grid in grids:
            pos([grid])
            rope([grid], torch.device("cpu"))
    for cache in (pos.tables, rope.tables):
        assert len(cache) == m.TABLE_GRIDS
        assert cache.bytes == sum(t.numel() * t.element_size() for t in cache._tables.values())
    resampled = [g[1:] for g in grids if g[1:] != tuple(pos.weight.shape[:2])]  # else: itself
    assert list(pos.tables._tables) == resampled[-m.TABLE_GRIDS :]


# ----------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _varlen_ready() -> bool:
    if not torch.cuda.is_available() or m.varlen_function() is None:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


def _qkv(lengths, heads=4, head_dim=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (sum(lengths), heads, head_dim)
    return [torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(3)]


def _segments(lengths, kernel):
    offsets, longest = m.cumulative_lengths(lengths)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda") if kernel == "varlen" else None
    return m.Segments(list(lengths), longest, kernel, cu)


@pytest.mark.cuda
@cuda
@pytest.mark.skipif(not _varlen_ready(), reason="needs varlen_attn on an sm80+ GPU")
def test_cuda_varlen_matches_per_image_sdpa():
    lengths = [64, 1024, 3, 256, 777]
    q, k, v = _qkv(lengths)
    varlen = m.attend(q, k, v, _segments(lengths, "varlen")).float()
    sdpa = m.attend(q, k, v, _segments(lengths, "sdpa")).float()
    # Both round to bf16 once; their float32 accumulations differ in order only.
    assert (varlen - sdpa).abs().max() <= 2**-6
    assert (varlen - sdpa).norm() / sdpa.norm() <= 2**-7


@pytest.mark.cuda
@cuda
@pytest.mark.skipif(not _varlen_ready(), reason="needs varlen_attn on an sm80+ GPU")
def test_cuda_varlen_is_batch_invariant():
    if "num_splits" not in m.varlen_options(m.varlen_function(), 64):
        pytest.skip("this torch's varlen_attn has no num_splits")
    lengths = [300, 4096, 17, 1024]
    q, k, v = _qkv(lengths, seed=1)
    batched = m.attend(q, k, v, _segments(lengths, "varlen"))
    start = sum(lengths[:2])
    alone = slice(start, start + lengths[2])
    single = m.attend(q[alone], k[alone], v[alone], _segments(lengths[2:3], "varlen"))
    assert torch.equal(batched[alone], single)


@pytest.mark.cuda
@cuda
def test_cuda_tower_picks_its_kernel():
    tower = random_model(TINY, seed=3, device="cuda", dtype=torch.bfloat16).vision_tower
    seg = m.Segments.of([(1, 4, 6), (1, 8, 8)], torch.device("cuda"), torch.bfloat16, "auto")
    assert seg.kernel == ("varlen" if _varlen_ready() else "sdpa")
    if seg.kernel == "varlen":
        assert seg.cu_seqlens.tolist() == [0, 24, 88]
        assert seg.cu_seqlens.dtype == torch.int32
    pixels = torch.randn(88, 3, 14, 14, device="cuda")
    with torch.inference_mode():
        auto = tower(pixels.bfloat16(), [(1, 4, 6), (1, 8, 8)]).float()
        tower.attention_kernel = "sdpa"
        sdpa = tower(pixels.bfloat16(), [(1, 4, 6), (1, 8, 8)]).float()
    assert (auto - sdpa).norm() / sdpa.norm() < 2e-2
