"""The prefill's side of the sglang interop tests: its real Kimi-K3 processor, built as
its CPU tests build it, and what its output must be for our features."""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from sglang.srt.configs.kimi_k3 import KimiK3Config
from sglang.srt.multimodal.processors.base_processor import MultimodalSpecialTokens
from sglang.srt.multimodal.processors.kimi_k3 import KimiK3ImageProcessor


def row_offsets(tokens: list[int]) -> list[int]:
    offsets = [0]
    for count in tokens:
        offsets.append(offsets[-1] + count)
    return offsets


class _Tokenizer:
    """The checkpoint's tokenizer is not shipped: control tokens get fixed ids, text its bytes."""

    SPECIAL: ClassVar[dict[str, int]] = {
        "<|media_begin|>": 1,
        "<|media_content|>": 2,
        "<|media_end|>": 3,
    }
    PATTERN = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL) + ")")

    def encode(self, text: str, allowed_special=None) -> list[int]:
        ids = []
        for piece in self.PATTERN.split(text):
            ids += (
                [self.SPECIAL[piece]]
                if piece in self.SPECIAL
                else [1000 + b for b in piece.encode()]
            )
        return ids


def kimi_processor() -> KimiK3ImageProcessor:
    """sglang's real Kimi-K3 processor, built as its CPU tests build it (no checkpoint)."""
    config = KimiK3Config()
    processor = KimiK3ImageProcessor.__new__(KimiK3ImageProcessor)
    processor.hf_config = config
    processor._tokenizer = _Tokenizer()
    processor.mm_tokens = MultimodalSpecialTokens(
        image_token="<|media_pad|>", image_token_id=config.media_placeholder_token_id
    )
    processor.processor_fingerprint = "interop"
    return processor


def prompt_ids(pad: int, images: int) -> list[int]:
    """What the chat template emits: text, then one pad per image."""
    ids = [10]
    for i in range(images):
        ids += [pad, 11 + i]
    return ids


def check_processor_output(output, spec, features, pad: int, exact: bool = True) -> None:
    """The prompt is framed with each image's original size and holds one pad per feature
    row; each image's embedding is its rows of ``features`` (equal, or within 1e-5 where
    the rows were encoded in other batches)."""
    tok = _Tokenizer()
    expected_ids = [10]
    for i, ((width, height), count) in enumerate(zip(spec["sizes"], spec["tokens"], strict=True)):
        expected_ids += tok.encode(f"<|media_begin|>image {width}x{height}<|media_content|>")
        expected_ids += [pad] * count + tok.encode("<|media_end|>") + [11 + i]
    assert list(output.input_ids) == expected_ids
    offsets = row_offsets(spec["tokens"])
    assert len(output.mm_items) == len(spec["tokens"])
    for i, item in enumerate(output.mm_items):
        (start, end), count = item.offsets[0], spec["tokens"][i]
        assert end - start + 1 == count
        assert output.input_ids[start : end + 1] == [pad] * count
        want = features[offsets[i] : offsets[i + 1]]
        got = item.precomputed_embeddings
        if exact:
            assert got.dtype == want.dtype
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
