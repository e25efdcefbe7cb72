"""tools/build_tiny_model.py's model shapes (--arch): the shipped assets' (tiny, tiny-moe), and the larger study
model's; the shipped Qwen3-MoE asset loads by its alias and decodes what its build recorded."""

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


@pytest.mark.parametrize("arch, params", [("tiny", 434_944), ("small", 1_242_624), ("moe", 683_072)])
def test_arch_shapes(arch, params):
    import build_tiny_model as b

    hf = dict(b.BASE_CONFIG, **b.ARCHS[arch], vocab_size=320, eos_token_id=271)
    assert _params(hf) == params
    # quantized rollouts need a group size dividing every Linear's input: 128 (tiny), 64 (small: hidden 192)
    assert hf["hidden_size"] % (128 if arch == "tiny" else 64) == 0 == hf["intermediate_size"] % 64


@pytest.mark.parametrize("arch, asset", [("tiny", "tiny"), ("moe", "tiny-moe")])
def test_arch_is_the_shipped_asset(arch, asset):
    import build_tiny_model as b

    shipped = json.load(open(os.path.join(REPO, "lrmq", "assets", asset, "config.json")))
    for k, v in dict(b.BASE_CONFIG, **b.ARCHS[arch]).items():
        if k not in ("eos_token_id", "num_experts"):  # transformers 5 names the expert count num_local_experts
            assert shipped[k] == v, k
    assert shipped.get("num_experts", shipped.get("num_local_experts")) == b.ARCHS[arch].get("num_experts")


def test_tiny_moe_loads_by_its_alias_and_greedy_decodes_its_recorded_completion():
    """`tiny-moe` resolves like `tiny`; it is a Qwen3-MoE with a dense layer between sparse ones (both feed-forward
    paths), trained (its recorded held-out accuracy is far from a random model's 0), and a plain greedy decode
    (the full forward, no engine) of each held-out problem its build recorded gives the completion the build
    decoded with the paged engine (a zeroed router or permuted experts change them)."""
    import jax.numpy as jnp

    from lrmq.checkpoint.load import TINY_MOE_DIR, load_model, load_tokenizer, resolve_checkpoint
    from lrmq.data.prompts import format_prompt
    from lrmq.model.moe import MoE

    assert resolve_checkpoint("tiny-moe") == TINY_MOE_DIR
    model, tok = load_model("tiny-moe"), load_tokenizer("tiny-moe")
    cfg = model.cfg
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [True, False, True]
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [True, False, True]
    info = json.load(open(os.path.join(TINY_MOE_DIR, "build_info.json")))
    assert info["model"]["num_params"] == 683_072 and info["eval"]["greedy"]["accuracy"] >= 0.2
    forward = jax.jit(lambda t: model(t))
    for ex in info["eval"]["greedy"]["examples"]:  # 4 held-out problems, 1 to 3 operations
        ids = tok.encode(format_prompt("arith", ex["problem"], tok))
        n, width = len(ids), 96  # one shape, one compile
        buf = np.full((1, width), tok.pad_id, np.int32)
        buf[0, :n] = ids
        for i in range(n, width):  # causal: the padding after position i does not change its logits
            nxt = int(jnp.argmax(forward(jnp.asarray(buf))[0, i - 1]))
            buf[0, i] = nxt
            if nxt in tok.eos_ids:
                break
        out = [int(t) for t in buf[0, n:i + 1]]
        assert out[-1] in tok.eos_ids and tok.decode(out[:-1]) == ex["completion"], (ex, tok.decode(out))


def test_unknown_arch_is_refused(capsys):
    import build_tiny_model as b

    with pytest.raises(SystemExit):
        b.main(["--arch", "huge", "--no-save"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # only the shipped archs have a default --out (never the shipped tiny's)
        b.main(["--arch", "small"])
    assert "--arch small is not shipped: give --out" in capsys.readouterr().err
