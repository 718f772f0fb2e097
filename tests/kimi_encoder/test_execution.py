"""Execution modes of the tower (kimi_encoder/execution.py) against eager, the slow reference.

On CPU: compiled features within 1e-4 of eager (float32) on every oracle image and a
bfloat16 cosine of at least 0.9999; no graph break in a compiled piece and no compilation
after the first batch, whatever its size; 'auto', its budget running out before, during
and after a build (a clock the compile moves), and every config error (the graphs
mode's buckets and padding, run without capture: tests/kimi_encoder/test_buckets.py). On CUDA
(``pytest -m cuda``): captured graphs and compiled pieces against eager at Kimi-K3's full
size, and 'auto' measuring on the device.
"""

from __future__ import annotations

import functools

import pytest
import torch
from images import image_bytes
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from benchmarks.device import device_random_model, seeded_pixels
from kimi_encoder import buckets
from kimi_encoder import compiled as cp
from kimi_encoder import execution as ex
from kimi_encoder import model as m
from kimi_encoder.cli import main
from kimi_encoder.config import get_preset
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.weights import random_model

TINY = get_preset("tiny").vision
CUDA = torch.cuda.is_available()
on_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
ORACLE_IMAGES = ["0_odd_100x37.png", "1_large_900x700.jpg", "2_rgba_alpha_600x500.png"]


def pixels_of(grids, seed: int = 0, patch: int = 14) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, patch, patch, generator=torch.Generator().manual_seed(seed))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["tiny", "k3"])  # head_dim 24 and 128
def test_real_rotation_equals_complex_within_rounding(preset, dtype):
    """The compiled path's real formula against eager's complex multiplication: the same
    products and sums, apart from where a kernel fuses a multiply-add (one rounding)."""
    cfg = get_preset(preset).vision
    grids = [(1, 6, 10), (1, 2, 2), (2, 4, 4)]
    rope = m.Rope2D(cfg.head_dim, cfg.rope_theta)(grids, torch.device("cpu"))
    n = rope.shape[0]
    gen = torch.Generator().manual_seed(0)
    qkv = (3 * torch.randn(n, 3, cfg.num_heads, cfg.head_dim, generator=gen)).to(dtype)
    q = qkv.unbind(1)[0]  # strided, as in the block
    eager, real = m.apply_rope(q, rope), m.rotate_pairs(q, rope)
    assert real.dtype == eager.dtype == dtype
    bound = 4 * torch.finfo(dtype).eps * q.float().abs().max().item()
    torch.testing.assert_close(real.float(), eager.float(), atol=bound, rtol=0)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("budget", "buckets"),
    [
        (16384, (512, 1024, 2048, 4096, 8192, 16384)),
        (65536, (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)),
        (1 << 20, tuple(1 << k for k in range(13, 21))),  # at most 8
        (3000, (750, 1500, 3000)),
        (1000, (1000,)),
        (100, (100,)),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else None,
)
def test_default_buckets(budget, buckets):
    assert ex.default_buckets(budget) == buckets


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"mode": "fast"},
            r"Unknown execution 'fast'; allowed: eager, compiled, graphs, auto \('auto': eager "
            "on CPU, the fastest measured at start on CUDA\\)",
        ),
        (
            {"graph_buckets": (2, 64)},
            r"graph_buckets must be patch counts of at least 4 .*\[2, 64\]",
        ),
        ({"graph_buckets": ()}, r"graph_buckets must be patch counts of at least 4 .*\[\]"),
        ({"graph_max_images": 0}, "graph_max_images must be at least 1, got 0"),
        ({"auto_budget_s": -1}, r"auto_budget_s must be >= 0, got -1"),
    ],
    ids=["mode", "small-bucket", "no-bucket", "images", "budget"],
)
def test_bad_execution_config(fields, match):
    with pytest.raises(ValueError, match=match):
        ex.ExecutionConfig(**fields)


def test_buckets_are_sorted_and_unique():
    assert ex.ExecutionConfig(graph_buckets=(64, 16, 64)).graph_buckets == (16, 64)


GRAPHS_ON_CPU = (
    r"execution 'graphs' cannot run here: CUDA graphs need a CUDA device, got device 'cpu'\. "
    r"Use execution 'compiled', 'eager' or 'auto' \(which measures what this device can run\)"
)


def test_graphs_on_cpu_fail_before_weights_load(tmp_path):
    """The mode is checked before the checkpoint is even read (it does not exist here)."""
    with pytest.raises(ValueError, match=GRAPHS_ON_CPU):
        VisionEncoder.from_pretrained(tmp_path / "missing", device="cpu", execution="graphs")
    with pytest.raises(ValueError, match="Unknown execution 'fast'"):
        VisionEncoder.from_pretrained(tmp_path / "missing", device="cpu", execution="fast")


def test_cli_execution(oracle_dir, tmp_path, capsys):
    image = str(oracle_dir / "images" / ORACLE_IMAGES[0])
    out = str(tmp_path / "f.safetensors")
    common = ["encode", "--checkpoint", str(oracle_dir / "checkpoint"), "--device", "cpu"]
    assert main([*common, "--execution", "graphs", "--out", out, image]) == 2
    assert "execution 'graphs' cannot run here: CUDA graphs need a CUDA device" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # argparse names the choices
        main([*common, "--execution", "fast", "--out", out, image])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    assert main([*common, "--execution", "eager", "--out", out, image]) == 0
    want = load_file(str(oracle_dir / "expected.safetensors"))["features.0"]
    torch.testing.assert_close(load_file(out)["features.0"], want, atol=1e-4, rtol=0)


def test_auto_on_cpu_is_eager():
    info = VisionEncoder.from_pretrained("tiny", device="cpu").info()["execution"]
    assert info == {"mode": "eager", "requested": "auto", "reason": ex.CPU_RULE}


# ----------------------------------------------------------------------------- compiled


def _pieces(model: m.KimiVisionModel, grids):
    """(name, eager piece, its inputs) of every compiled piece, on real activations."""
    tower, block = model.vision_tower, model.vision_tower.encoder.blocks[0]
    pixels = pixels_of(grids)
    pos, rope = tower.patch_embed.pos_emb(grids), tower.rope(grids, pixels.device)
    x = tower.patch_embed(pixels, pos)
    q, k, v = block.pre_attention(x, rope)
    attended = m.attend(q, k, v, m.Segments.of(grids, pixels.device, torch.float32, "sdpa"))
    hidden = tower.encoder(x, rope, m.Segments.of(grids, x.device, x.dtype, "sdpa"))
    merged = m.merge_patches(hidden, grids, tower.cfg.merge_kernel_size)
    return [
        ("patch embedding", tower.patch_embed.forward, (pixels, pos)),
        ("pre-attention", block.pre_attention, (x, rope)),
        ("post-attention", block.post_attention, (x, attended)),
        ("projector", model.mm_projector.forward, (merged,)),
    ]


def test_no_graph_break_in_a_compiled_piece():
    model = random_model(TINY, seed=1, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        for name, piece, args in _pieces(model, [(1, 6, 4), (1, 2, 2)]):
            explained = torch._dynamo.explain(piece)(*args)
            assert explained.graph_break_count == 0, (name, explained.break_reasons)
            assert explained.graph_count == 1, name


# Sizes after the warm-up: one 2x2 image (one token), the position table's own 16 x 16
# (its table is the weight itself), several images, a tall one, the patch limit.
SIZES = [
    [(1, 2, 2)],
    [(1, 16, 16)],
    [(1, 4, 6), (1, 30, 22), (1, 2, 2)],
    [(1, 64, 2)],
    [(1, 32, 32)],
]


def test_compiled_pieces_compile_once_for_every_size(encoder_in, oracle_dir):
    compiled = encoder_in(oracle_dir / "checkpoint", "compiled")
    eager = encoder_in(oracle_dir / "checkpoint", "eager")
    assert compiled.info()["execution"]["mode"] == "compiled"
    assert compiled.graphs_compiled <= 4  # one per piece (none if this session had them)
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for seed, grids in enumerate(SIZES):
            pixels = pixels_of(grids, seed)
            got, want = compiled.execution(pixels, grids), eager.model(pixels, grids)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert counters["stats"]["unique_graphs"] == before


@pytest.fixture(scope="module")
def oracle_items(oracle_dir, oracle_encoder):
    return [oracle_encoder.plan((oracle_dir / "images" / n).read_bytes()) for n in ORACLE_IMAGES]


def test_compiled_matches_eager_on_every_oracle_image(encoder_in, oracle_dir, oracle_items):
    compiled = encoder_in(oracle_dir / "checkpoint", "compiled")
    eager = encoder_in(oracle_dir / "checkpoint", "eager")
    expected = load_file(str(oracle_dir / "expected.safetensors"))
    batched = compiled.encode(oracle_items)
    for i, item in enumerate(oracle_items):
        (alone,) = compiled.encode([item])
        (reference,) = eager.encode([item])
        for got in (alone, batched[i]):
            assert (got - reference).abs().max() <= 1e-4, ORACLE_IMAGES[i]
            torch.testing.assert_close(got, expected[f"features.{i}"], atol=1e-4, rtol=0)


def test_compiled_bfloat16_stays_with_eager(encoder_in, oracle_dir, oracle_items):
    compiled = encoder_in(oracle_dir / "checkpoint", "compiled", "bfloat16")
    eager = encoder_in(oracle_dir / "checkpoint", "eager", "bfloat16")
    assert compiled.dtype == torch.bfloat16
    for i, (got, want) in enumerate(
        zip(compiled.encode(oracle_items), eager.encode(oracle_items), strict=True)
    ):
        assert cosine(got, want) >= 0.9999, ORACLE_IMAGES[i]


# ----------------------------------------------------------------------------- every mode


MODES = ["eager", "compiled", "padded"]


@pytest.mark.parametrize("mode", MODES)
def test_backends_give_the_same_features_in_every_mode(encoder_in, oracle_dir, mode):
    """The gpu backend's pixels are the cpu backend's (tests/kimi_encoder/test_backends.py),
    so every mode encodes them to the same features, bit for bit."""
    encoder = encoder_in(oracle_dir / "checkpoint", mode)
    kinds = [("RGBA", (300, 200)), ("P", (90, 60))]
    data = [image_bytes(kind, size, seed=3) for kind, size in kinds]
    cpu = encoder.encode([encoder.plan(d, backend="cpu") for d in data])
    gpu = encoder.encode([encoder.plan(d, backend="gpu") for d in data])
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- auto


def test_auto_keeps_the_fastest_and_names_what_it_skipped():
    """On CPU, with the measurement CUDA ranks run: graphs cannot be captured here (skipped,
    with its error), eager and compiled are timed, the faster kept, the other undone."""
    model = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(2048,))
    with torch.inference_mode():
        chosen = ex.choose_fastest(model, config, ["eager", "graphs", "compiled"], {})
        info = chosen.info()
        assert set(info["measured_ms"]) == {"eager", "compiled"}
        assert chosen.mode == min(info["measured_ms"], key=info["measured_ms"].get)
        assert info["skipped"]["graphs"].startswith("RuntimeError")
        assert info["probe_patches"] == [1024, 2048]
        block = model.vision_tower.encoder.blocks[0]
        assert ("pre_attention" in block.__dict__) == (chosen.mode == "compiled")
        grids = [(1, 4, 6)]
        torch.testing.assert_close(
            chosen(pixels_of(grids), grids),
            random_model(TINY, seed=4, device="cpu", dtype=torch.float32)(pixels_of(grids), grids),
            atol=1e-4,
            rtol=0,
        )


def test_the_probe_has_batches_that_do_not_fill_a_bucket():
    """Besides one image and a full largest bucket: half of it plus one image and about
    half of it in mixed sizes; the probe times each as the rank's batcher cuts it (in the
    graphs mode: the bucket's worth first, then the image left over)."""
    model = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    config = ex.ExecutionConfig(graph_buckets=ex.default_buckets(4096), graph_max_images=8)
    batches = ex.probe_batches(model, config)
    patches = [sum(t * h * w for t, h, w in grids) for _, grids in batches]
    assert patches[:3] == [1024, 4096, 3072]
    assert 2048 <= patches[3] < 2048 + 1024
    assert len({h * w for _, grids in batches[3:] for _, h, w in grids}) == 3
    runner = ex.BucketRunner(model, config.graph_buckets, 8, capture=False)
    cut = ex.parts([1024] * 3, ex.take_for(runner, 4096))
    assert cut == [[0, 1], [2]]  # 2048 and 1024 rows, not 4096
    assert ex.parts([1024] * 3, ex.take_for(model, 4096)) == [[0, 1, 2]]


def test_auto_stops_when_its_budget_is_spent():
    model = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(1024,), auto_budget_s=0)
    with torch.inference_mode():
        chosen = ex.choose_fastest(model, config, ["eager", "compiled"], {})
    assert chosen.mode == "eager"
    assert chosen.info()["skipped"] == {"compiled": "auto_budget_s (0 s) spent before it started"}
    assert "pre_attention" not in model.vision_tower.encoder.blocks[0].__dict__


class Clock:
    """A clock that moves only when told: the budget runs out where a test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def piece_clock(monkeypatch) -> Clock:
    """A clock that moves 10 s as each compiled piece finishes compiling (a real compile)."""
    clock, compile_piece = Clock(), cp.warm_up

    def compile_and_tick(model):
        compile_piece(model)
        clock.now += 10.0

    monkeypatch.setattr(cp, "warm_up", compile_and_tick)
    return clock


def compiled_in(model: m.KimiVisionModel) -> list[str]:
    """Which of the model's methods have a compiled piece in their place."""
    return [
        f"{name}.{method}"
        for name, owner in model.named_modules()
        for method in ("forward", "pre_attention", "post_attention")
        if method in owner.__dict__
    ]


def test_auto_budget_spent_mid_compile_undoes_and_skips_compiled(piece_clock):
    """The budget (15 s) runs out after the second of the four pieces has compiled: the
    other two are not compiled, the two that were are taken out, eager is kept and runs
    as the reference does."""
    clock = piece_clock
    model = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(1024,), auto_budget_s=15)
    with torch.inference_mode():
        chosen = ex.choose_fastest(model, config, ["eager", "compiled"], {}, clock=clock)
        grids = [(1, 4, 6)]
        got = chosen(pixels_of(grids), grids)
    assert clock.now == 20.0  # two pieces compiled, not four
    assert chosen.mode == "eager"
    assert chosen.info()["skipped"] == {
        "compiled": "auto_budget_s (15 s) spent after 2 of 4 pieces compiled; undone"
    }
    assert set(chosen.info()["measured_ms"]) == {"eager"}
    assert compiled_in(model) == []
    reference = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(got, reference(pixels_of(grids), grids), atol=0, rtol=0)


def test_auto_budget_spent_once_built_skips_timing(piece_clock):
    """The budget (35 s) runs out with the last piece: the candidate is undone, not timed."""
    clock = piece_clock
    model = random_model(TINY, seed=4, device="cpu", dtype=torch.float32)
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(1024,), auto_budget_s=35)
    with torch.inference_mode():
        chosen = ex.choose_fastest(model, config, ["eager", "compiled"], {}, clock=clock)
    assert chosen.info()["skipped"] == {
        "compiled": "auto_budget_s (35 s) spent once built, before it was timed; undone"
    }
    assert compiled_in(model) == []


# ----------------------------------------------------------------------------- CUDA


@functools.cache
def k3_graphs() -> tuple[m.KimiVisionModel, ex.BucketRunner]:
    """K3 at full size in bfloat16 (weights drawn on the GPU), its eager attention forced to
    varlen, the kernel its graphs capture, and graphs of two buckets; built once."""
    model = device_random_model(get_preset("k3").vision, 0, "cuda", torch.bfloat16)
    model.vision_tower.attention_kernel = "varlen"
    return model, ex.BucketRunner(model, (1024, 4096), 8, capture=True)


@pytest.mark.parametrize(
    ("grids", "bucket"),
    [
        ([(1, 32, 32)], 1024),  # fills the bucket
        ([(1, 16, 24), (1, 8, 8), (1, 2, 2)], 1024),  # several images, padding
        ([(1, 32, 32), (1, 2, 2)], 4096),  # over the first bucket
        ([(1, 64, 80)], None),  # over the largest: eager
    ],
    ids=["fills", "several", "over", "eager"],
)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graphs_match_eager(grids, bucket):
    """Replays against the eager tower with the same attention kernel, bfloat16, K3: the
    matmuls may pick other kernels for another row count (the bounds of an image alone
    and in a batch, tests/kimi_encoder/test_cuda_checks.py)."""
    model, runner = k3_graphs()
    pixels = seeded_pixels(grids, model.cfg.patch_size, "cuda")
    other = [(1, 30, 30)]
    before = dict(runner.bucket_batches), runner.eager_batches
    with torch.inference_mode():
        want = model(pixels, grids).float()
        got = runner(pixels, grids).float()
        runner(seeded_pixels(other, 14, "cuda", seed=1), other)  # another batch between
        again = runner(pixels, grids).float()
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) <= 1e-2
    assert cosine(got, want) >= 0.999
    assert torch.equal(got, again)  # a replay depends on nothing but its own batch
    ran = runner.bucket_batches[bucket] - before[0].get(bucket, 0) if bucket else 0
    assert (ran, runner.eager_batches - before[1]) == ((2, 0) if bucket else (0, 2))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_compiled_matches_eager():
    """The tiny tower in bfloat16: compiling K3's pieces, or a float32 tower besides, would
    take the GPU check's correctness section past its deadline; 'auto' below reuses these
    compiled pieces (same shapes and dtype)."""
    model = device_random_model(TINY, 0, "cuda", torch.bfloat16)
    grids = [(1, 16, 24), (1, 8, 8), (1, 2, 2)]
    pixels = seeded_pixels(grids, model.cfg.patch_size, "cuda")
    with torch.inference_mode():
        want = model(pixels, grids).float()
        got = ex.prepare(model, "compiled")(pixels, grids).float()
    assert cosine(got, want) >= 0.9999


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graphs_refuse_float32():
    with pytest.raises(ValueError, match=r"which needs a CUDA device of compute capability 8\.0\+"):
        VisionEncoder.from_pretrained("tiny", device="cuda", dtype="float32", execution="graphs")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_auto_measures_and_reports():
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(1024, 4096), auto_budget_s=300)
    encoder = VisionEncoder.from_pretrained("tiny", device="cuda", execution=config)
    info = encoder.info()["execution"]
    assert info["requested"] == "auto"
    assert set(info["measured_ms"]) | set(info["skipped"]) == {"eager", "graphs", "compiled"}
    assert info["mode"] == min(info["measured_ms"], key=info["measured_ms"].get)
    assert info["probe_patches"] == [1024, 4096]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_auto_budget_spent_mid_capture(monkeypatch):
    """The budget (5 s) runs out after the first of two buckets is captured (each capture
    moves the clock 10 s): graphs is undone and skipped, compiled never starts."""
    clock, capture = Clock(), buckets.Bucket.capture

    def capture_and_tick(bucket, model, pool):
        capture(bucket, model, pool)
        clock.now += 10.0

    monkeypatch.setattr(buckets.Bucket, "capture", capture_and_tick)
    model = device_random_model(TINY, 0, "cuda", torch.bfloat16)
    config = ex.ExecutionConfig(mode="auto", graph_buckets=(1024, 4096), auto_budget_s=5)
    with torch.inference_mode():
        chosen = ex.choose_fastest(model, config, ["eager", "graphs", "compiled"], {}, clock)
    assert chosen.mode == "eager"
    assert chosen.info()["skipped"] == {
        "graphs": "auto_budget_s (5 s) spent after 1 of 2 buckets captured; undone",
        "compiled": "auto_budget_s (5 s) spent before it started",
    }
