"""``streamscope serve`` on every block layout beside the Llama of ``test_serve.py``: a steered, harvesting request
over HTTP equals the in-process engine's bulk path on the same checkpoint, token for token and bit for bit.

The server's worker plans each step's edits and reads by the block's layout (a fused block's two halves, a whole
stream, transformers' own block inside vLLM's Transformers backend), so one family stands for each layout and for
each block kind with values of its own: GPT-2 (the whole stream), GPT-NeoX (the Transformers backend, a parallel
block), Gemma 2 (sandwich norms), Cohere (a parallel block returning a tuple), Granite (a scaled residual), Llama 4
(chunked attention and a mixture of experts) and Qwen3-Next (linear attention beside full attention, and experts).
The in-process engine is itself held to transformers on every family (``test_families.py``). One request, one
prompt: it runs alone in the server's engine, as in the in-process one, so the two compute the same rows with the
same kernels and agree bit for bit (a request batched with others agrees within float rounding: ``test_serve.py``).
Each server's log is kept in the test's folder.
"""

from __future__ import annotations

import pytest
import torch

import precision
from serve_process import KEY, running
import streamscope
from streamscope import Steer

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a server per family, each engine asking for vLLM's default "
                                "90% of the GPU beside the GPU suite's engines; the worker's plan is device-independent "
                                "Python, checked here, and a GPU server runs end to end in benchmarks/serve_load.py")

PROMPT = "Rome is in Italy, Berlin is in Germany"
STEPS = 5
#: Each family's second steered and harvested value: the stream between its sublayers where it has one, else the
#: stream entering the block (a parallel block has no stream between its sublayers).
SECOND = {"gpt2": "layer_mid", "gpt_neox": "layer_input", "gemma2": "layer_mid", "cohere": "layer_input",
          "granite": "layer_mid", "llama4_text": "layer_mid", "qwen3_next": "layer_mid"}
#: Qwen3-Next's CPU kernels run bfloat16 only (test_families.py); every other family runs float32.
DTYPES = {"qwen3_next": "bfloat16"}


@pytest.mark.parametrize("family", list(SECOND))
def test_a_steered_harvesting_request_equals_the_in_process_engine(family, checkpoints, tmp_path):
    path = checkpoints(family)
    dtype = DTYPES.get(family, "float32")
    second = SECOND[family]
    with running(path, tmp_path / "server.log", "--dtype", dtype) as url:
        client = streamscope.Client(url, api_key=KEY)
        info = client.info()
        hidden, last = info["hidden_size"], info["layers"] - 1
        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
        # the two clamps send one vector with one setting: the server's worker makes them one operation, which
        # each site still applies as its own kind (Granite's mlp_output is scaled by its residual_multiplier)
        steers = [Steer("layer_output", 1, vector, scale=4.0), Steer(second, 0, vector, mode="clamp", projection=2.0),
                  Steer("mlp_output", 1, vector, mode="clamp", projection=2.0)]
        harvest = {"values": ["layer_output", second], "layers": [0, last], "positions": "all"}
        served = client.generate([PROMPT], max_tokens=STEPS, temperature=0.0, steer=steers, harvest=harvest)
        plain = client.generate([PROMPT], max_tokens=STEPS, temperature=0.0, harvest=harvest)
    model = streamscope.load(path, engine="vllm", dtype=dtype)
    try:
        expected = model.generate([PROMPT], max_tokens=STEPS, temperature=0.0, steer=steers, harvest=harvest,
                                  progress=False)
    finally:
        model.close()
    assert served.tokens == expected.tokens
    # the steers reach the stream: the last block's differs from an unsteered request's
    assert not torch.equal(served.harvest["layer_output"][0][1], plain.harvest["layer_output"][0][1])
    for value in ("layer_output", second):
        got, want = served.harvest[value][0], expected.harvest[value][0]
        assert got.shape == want.shape == (2, len(want[0]), hidden)
        assert torch.equal(got, want), (value, float((got.float() - want.float()).abs().max()))
