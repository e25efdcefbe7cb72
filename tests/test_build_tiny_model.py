"""tools/build_tiny_model.py's model shapes (--arch): the shipped asset's, and the larger study model's."""

import json
import os
import sys

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))


def _params(hf: dict) -> int:
    from flax import nnx

    from lrmq.model.config import ModelConfig
    from lrmq.model.decoder import Decoder

    model = nnx.eval_shape(lambda: Decoder(ModelConfig.from_hf_dict(hf), nnx.Rngs(0)))
    return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("arch, params", [("tiny", 434_944), ("small", 1_242_624)])
def test_arch_shapes(arch, params):
    import build_tiny_model as b

    hf = dict(b.BASE_CONFIG, **b.ARCHS[arch], vocab_size=320, eos_token_id=271)
    assert _params(hf) == params
    # quantized rollouts need a group size dividing every Linear's input: 128 (tiny), 64 (small: hidden 192)
    assert hf["hidden_size"] % (128 if arch == "tiny" else 64) == 0 == hf["intermediate_size"] % 64


def test_tiny_arch_is_the_shipped_asset():
    import build_tiny_model as b

    shipped = json.load(open(os.path.join(REPO, "lrmq", "assets", "tiny", "config.json")))
    for k, v in dict(b.BASE_CONFIG, **b.ARCHS["tiny"]).items():
        if k != "eos_token_id":
            assert shipped[k] == v, k


def test_unknown_arch_is_refused(capsys):
    import build_tiny_model as b

    with pytest.raises(SystemExit):
        b.main(["--arch", "huge", "--no-save"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err
