"""A served app whose ranks run the compiled tower (model.execution 'compiled') against the
eager in-process encoder, over real HTTP; each rank's mode in /v1/info."""

from __future__ import annotations

import numpy as np
import requests
from serve_helpers import b64, decode_features, encode, one_thread


def test_compiled_ranks_answer_the_eager_features(deploy, images, reference):
    url = deploy(1, "compiled", model={"execution": "compiled"})
    with one_thread():
        want = reference.encode([reference.plan(b) for b in images[:5]])
    response = encode(url, [{"type": "image", "image": b64(b)} for b in images[:5]])
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    for item, ref in zip(items, want, strict=True):
        got = decode_features(item)
        assert got.shape == tuple(ref.shape)
        np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-4)
    (rank,) = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
    assert rank["state"] == "live"
    assert rank["execution"]["mode"] == "compiled"
    assert rank["execution"]["requested"] == "compiled"
    assert rank["execution"]["build_s"] > 0
