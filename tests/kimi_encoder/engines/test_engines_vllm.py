"""vLLM encoder-cache files: layout, dtype, uuid checks, no half-written file ever visible,
and a rank writing them from its host tensors or from the object store."""

import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from deployments.rank import _write_entries
from deployments.sinks import EcFiles, Written
from kimi_encoder.engines.vllm import EC_FILENAME, EC_KEY, ec_cache_path, write_ec_cache
from kimi_encoder.features import from_numpy, to_numpy


def _header_dtype(path) -> str:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))[EC_KEY]["dtype"]


@pytest.mark.parametrize(
    ("dtype", "stored"), [(torch.float32, "F32"), (torch.bfloat16, "BF16")], ids=["f32", "bf16"]
)
def test_write_and_read_back(tmp_path, dtype, stored):
    features = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    entry = write_ec_cache(tmp_path, "img-7f3a", features)
    assert entry.path == tmp_path / "img-7f3a" / EC_FILENAME == ec_cache_path(tmp_path, "img-7f3a")
    assert (entry.uuid, entry.num_tokens, entry.hidden) == ("img-7f3a", 12, 16)
    assert entry.dtype == str(dtype).removeprefix("torch.")
    assert entry.nbytes == entry.path.stat().st_size
    assert _header_dtype(entry.path) == stored
    loaded = load_file(entry.path)
    assert list(loaded) == [EC_KEY]
    assert torch.equal(loaded[EC_KEY], features)
    assert sorted(p.name for p in entry.path.parent.iterdir()) == [EC_FILENAME]


def test_an_entry_is_replaced_whole(tmp_path):
    write_ec_cache(tmp_path, "u", torch.zeros(4, 8))
    write_ec_cache(tmp_path, "u", torch.ones(2, 8))
    assert torch.equal(load_file(ec_cache_path(tmp_path, "u"))[EC_KEY], torch.ones(2, 8))


@pytest.mark.parametrize("uuid", ["", ".", "..", "../x", "a/b", "a\\b", "a\0b", "a\nb", "x" * 256])
def test_uuid_must_be_one_path_component(tmp_path, uuid):
    with pytest.raises(ValueError, match="cannot name a cache directory"):
        write_ec_cache(tmp_path, uuid, torch.zeros(1, 4))


def test_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory; create it"):
        write_ec_cache(tmp_path / "missing", "u", torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"non-empty \(num_embeds, hidden\) tensor, got shape"):
        write_ec_cache(tmp_path, "u", torch.zeros(4))


def test_no_partial_file_is_ever_visible(tmp_path):
    """A reader polling the final path only ever finds complete files."""
    uuid = "big"
    path = ec_cache_path(tmp_path, uuid)
    versions = [torch.full((4096, 1024), float(i)) for i in range(4)]  # 16 MiB each
    done, first_read = threading.Event(), threading.Event()

    def poll():
        try:
            while not done.is_set():
                if path.exists():
                    value = load_file(path)[EC_KEY]  # a partial file fails to parse
                    first_read.set()
                    assert any(torch.equal(value, v) for v in versions), (
                        f"file holds a mix: first value {value[0, 0].item()}"
                    )
        finally:
            first_read.set()  # a failed reader does not hold the writer up; its error is below

    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(poll)
        try:
            for i, features in enumerate(versions):
                write_ec_cache(tmp_path, uuid, features)
                if i == 0:  # the later writes replace a file the reader is reading
                    assert first_read.wait(60), "the reader never found the file"
        finally:
            done.set()
        reader.result()  # raises what the reader met
    assert torch.equal(load_file(path)[EC_KEY], versions[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rank_writes_entries_from_host_tensors_and_stored_arrays(tmp_path, dtype):
    """A rank writes each image's entries from the tensor its features were copied to,
    or, for a cache hit, from the read-only storage array the object store holds (written
    from its buffer as it is); an image answered missing writes nothing."""
    rng = torch.Generator().manual_seed(3)
    host = torch.randn(5, 16, generator=rng).to(dtype)
    stored = to_numpy(torch.randn(3, 16, generator=rng).to(dtype)).copy()
    stored.flags.writeable = False  # as Ray's object store hands it out
    sink = EcFiles(str(tmp_path), (("a", "a-again"), ("b",), ("c",)))
    written = _write_entries(sink, [host, stored, None])
    name = str(dtype).removeprefix("torch.")
    assert written[2] is None
    for entry, uuids, want in zip(written[:2], sink.uuids[:2], [host, stored], strict=True):
        want = want if isinstance(want, torch.Tensor) else from_numpy(want, name)
        assert isinstance(entry, Written)
        assert (entry.shape, entry.dtype) == (tuple(want.shape), name)
        for uuid in uuids:
            path = ec_cache_path(tmp_path, uuid)
            assert entry.sizes[uuid] == path.stat().st_size
            assert torch.equal(load_file(path)[EC_KEY], want)  # safetensors' own reader
    assert not (tmp_path / "c").exists()
