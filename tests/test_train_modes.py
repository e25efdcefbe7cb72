"""GRPO in every train mode (float / QAT schemes / QLoRA): short runs without NaN, and 8-device sharded steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_adam_step_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ASSET = os.path.join(REPO, "lrmq", "assets", "tiny")

# A smaller scratch model than the shipped asset (fast compiles); untrained, so rewards are ~0.
SCRATCH_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def build_scratch_checkpoint(out: str) -> str:
    """An HF checkpoint + the tiny model's tokenizer with random weights (like tools/build_tiny_model.py)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import build_tiny_model as b
    from flax import nnx

    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.model.config import ModelConfig
    from lrmq.model.decoder import Decoder

    tok = b.build_tokenizer()
    vocab = int(math.ceil(tok.get_vocab_size() / 64) * 64)
    cfg = ModelConfig.from_hf_dict(dict(b.BASE_CONFIG, **SCRATCH_CONFIG, vocab_size=vocab))
    save_hf_model(Decoder(cfg, nnx.Rngs(0)), out, overwrite=True)
    b.write_tokenizer_files(tok, out, 256)
    return out


@pytest.fixture(scope="session")
def scratch_ckpt(tmp_path_factory):
    return build_scratch_checkpoint(str(tmp_path_factory.mktemp("scratch_tiny") / "ckpt"))


def grpo_config(ckpt: str, out_dir: str, *, mode="none", steps=2, lr=1e-5, mesh=(1, -1, 1), prompts=2, **quant):
    from lrmq.rl.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.checkpoint = ckpt
    cfg.data.synthetic_train_size, cfg.data.synthetic_eval_size = 64, 4
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = 2, prompts
    cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens = 64, 8
    cfg.rollout.update_shapes = 1  # one packed update shape: one compile per trainer (shapes: test_precompile.py)
    cfg.optim.lr, cfg.optim.schedule, cfg.optim.warmup_steps = lr, "constant", 0
    cfg.quant.mode = mode
    for k, v in quant.items():
        setattr(cfg.quant, k, v)
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
    cfg.run.out_dir, cfg.run.steps, cfg.run.save_every = out_dir, steps, 10**6
    cfg.run.eval_size, cfg.run.export_hf, cfg.run.progress = 4, False, False
    cfg.validate()
    return cfg


def make_trainer(cfg):
    from lrmq.rl.trainer import GRPOTrainer, NullWriter

    return GRPOTrainer(cfg, writer_factory=lambda path: NullWriter())


def digit_reward(texts, answers, reward_name="", *, timeout_s=1.0, **_):
    """Dense stand-in reward (share of digits + a length term): an untrained model's samples differ in it,
    so advantages and gradients are non-zero (boxed_math gives an untrained model 0 everywhere)."""
    r = np.asarray([sum(c.isdigit() for c in t) / max(len(t), 1) + 0.01 * (len(t) % 5) for t in texts], np.float32)
    return r, {"correct": [False] * len(texts), "formatted": [False] * len(texts)}


def run_steps(trainer, n: int, *, dense_reward: bool = True) -> list[dict]:
    """n rollout+update steps without the trainer's eval/export bookkeeping."""
    import lrmq.rl.sampler as trainer_mod

    out = []
    key = jax.random.key(trainer.cfg.run.seed)
    orig = trainer_mod.score_completions
    if dense_reward:
        trainer_mod.score_completions = digit_reward
    try:
        for _ in range(n):
            ro = trainer.rollout(next(trainer.pipeline), jax.random.fold_in(key, trainer.step))
            m = trainer.learner.update(ro.batch)
            trainer.step += 1
            out.append({**ro.stats, **m})
    finally:
        trainer_mod.score_completions = orig
    return out


def _finite_tree(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating))


QAT_CASES = [dict(qat_scheme="paper_int8"), dict(qat_scheme="int8"), dict(qat_scheme="int4", qat_group_size=32),
             dict(qat_scheme="w8a8", qat_stochastic_rounding=True)]


@pytest.mark.slow(reason="two GRPO steps per QAT scheme, then its quantized export loaded and compared (~15-35 s)")
@pytest.mark.parametrize("quant", QAT_CASES, ids=lambda q: "-".join(str(v) for v in q.values()))
def test_grpo_qat_runs_without_nan(scratch_ckpt, tmp_path, quant):
    from lrmq.quant.qat import is_qat
    from lrmq.quant.transforms import iter_linears
    from flax import nnx

    tr = make_trainer(grpo_config(scratch_ckpt, str(tmp_path), mode="qat", lr=1e-3, **quant))
    model = nnx.merge(tr.learner.graphdef, tr.learner.trainable, tr.learner.rest)
    assert all(is_qat(lin) for _, lin in iter_linears(model))  # rollouts merge this same graphdef
    before = jax.tree.map(np.asarray, tr.learner.trainable)
    ms = run_steps(tr, 2)
    for m in ms:
        assert np.isfinite(m["train/loss"]) and np.isfinite(m["train/grad_norm"]), m
    assert any(m["train/grad_norm"] > 0 for m in ms)
    assert _finite_tree(tr.learner.trainable)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), tr.learner.trainable, before))
    assert max(moved) > 0  # float master weights are updated
    check_quantized_policy(tr, tmp_path, quant["qat_scheme"])


def check_quantized_policy(tr, tmp_path, scheme: str):
    """The trained QAT policy's quantized export (lrmq.ptq.qat_export): loaded as a packed lrmq checkpoint, its
    logits equal the trainer's QAT forward of the same (trained) weights and differ from the float policy's;
    lrmq.evaluate refuses the run's float final_policy, naming the export, unless asked for the float weights."""
    import json

    from flax import nnx

    from lrmq import evaluate
    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.checkpoint.load import load_model
    from lrmq.configlib import save_config
    from lrmq.quant.qkernel import QuantizedKernel
    from lrmq.quant.qat import remove_qat
    from lrmq.quant.transforms import iter_linears

    tokens = (jnp.arange(24).reshape(2, 12) * 7) % 200
    forward = lambda m: np.asarray(nnx.jit(lambda m, t: m(t))(m, tokens))  # one compiled program, not op by op
    qat_logits = forward(nnx.merge(tr.learner.graphdef, tr.learner.trainable, tr.learner.rest))
    float_model = nnx.merge(tr.learner.graphdef, tr.learner.trainable, tr.learner.rest)
    remove_qat(float_model)
    float_logits = forward(float_model)
    run = tmp_path / "run"
    out = tr.export_quantized_policy(str(run / "final_policy_quantized"))
    if scheme == "w8a8":  # activations quantized at run time: no weight-only export
        assert out is None and not (run / "final_policy_quantized").exists()
    else:
        packed = load_model(os.path.join(out, "packed"))
        assert all(isinstance(lin.kernel, QuantizedKernel) for _, lin in iter_linears(packed))
        y = forward(packed)
        np.testing.assert_allclose(y, qat_logits, atol=2e-5, rtol=1e-5, err_msg=scheme)
        assert np.abs(y - float_logits).max() > 1e-4, scheme
        qc = json.load(open(os.path.join(out, "compressed_tensors", "config.json")))["quantization_config"]
        w = qc["config_groups"]["group_0"]["weights"]
        assert (w["num_bits"], w["symmetric"]) == (4 if scheme == "int4" else 8, True), w
        assert json.load(open(os.path.join(out, "qat_policy.json")))["qat_scheme"] == scheme
    # the run's float policy is refused by lrmq.evaluate before any work, naming what to use
    save_config(tr.cfg, str(run / "config.yaml"))
    save_hf_model(float_model, str(run / "final_policy"))
    argv = ["--checkpoint", str(run / "final_policy"), "--suite", "math500", "--limit", "1",
            "--out", str(tmp_path / "eval"), "--data-dir", str(tmp_path / "no_data")]
    with pytest.raises(Exception) as e:
        evaluate.check_qat_policy(evaluate.build_config(evaluate.parse_args(argv)))
    assert "float master weights of a QAT run" in str(e.value) and "--float-qat-policy" in str(e.value)
    if scheme != "w8a8":
        assert os.path.join("final_policy_quantized", "packed") in str(e.value)
    evaluate.check_qat_policy(evaluate.build_config(evaluate.parse_args([*argv, "--float-qat-policy"])))


def test_grpo_qlora_updates_only_adapters(scratch_ckpt, tmp_path):
    from flax import nnx
    from lrmq.quant.qkernel import QuantizedKernel

    tr = make_trainer(grpo_config(scratch_ckpt, str(tmp_path), mode="qlora", lr=1e-3))
    rest_before = jax.tree.map(np.asarray, tr.learner.rest)
    b_before = [np.asarray(v) for p, v in nnx.to_flat_state(tr.learner.trainable) if p[-1] == "b"]
    assert b_before and all((b == 0).all() for b in b_before)
    ms = run_steps(tr, 2)
    assert all(np.isfinite(m["train/loss"]) for m in ms)
    # everything but the adapters is bit-identical (packed codes included); the B matrices have moved
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), tr.learner.rest, rest_before)
    assert all(jax.tree.leaves(same))
    packed = [v for _, v in nnx.to_flat_state(tr.learner.rest) if isinstance(v, QuantizedKernel)]
    assert len(packed) == 7 * 2
    b_after = [np.asarray(v) for p, v in nnx.to_flat_state(tr.learner.trainable) if p[-1] == "b"]
    assert any(m["train/grad_norm"] > 0 for m in ms)
    assert any(np.abs(b).max() > 0 for b in b_after)
    assert _finite_tree(tr.learner.trainable)


def flat_arrays(state) -> dict[str, np.ndarray]:
    """Every array leaf of an nnx.State (packed QuantizedKernel codes/scales included), gathered to host."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(state):
        for i, leaf in enumerate(jax.tree.leaves(var.get_value())):
            if hasattr(leaf, "dtype") and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                out[".".join(map(str, path)) + f"#{i}"] = np.asarray(leaf)
    return out


# name -> (quant.mode, 8-device mesh (data, fsdp, tensor), quant options). QLoRA without dropout: its masks
# are keyed on the bits of each layer's input, and with lora_dropout=0.05 the (2, 2, 2) step's gradient norm
# differs from the 1-device one by 0.6% (0.4376 vs 0.4401; bit-equal at 0), so only dropout-free steps can be
# compared exactly. Dropout itself is tested in test_qlora.py.
SHARDED_MODES = {"float": ("none", (1, 8, 1), {}),
                 "qat": ("qat", (2, 2, 2), {"qat_scheme": "int8"}),
                 "qlora": ("qlora", (2, 2, 2), {"lora_dropout": 0.0})}
# Compared with a 1-device step here; float is compared on a (2, 2, 2) mesh, over two steps, by
# test_train_loop.py::test_sharded_step_matches_single_device.
COMPARED_MODES = ("qat", "qlora")


def one_step(ckpt: str, out: str, name: str, mesh=None) -> tuple[dict, dict, dict]:
    """One GRPO step of SHARDED_MODES[name] (on `mesh`, default its 8-device mesh): (metrics, trainable, rest)."""
    mode, mesh8, q = SHARDED_MODES[name]
    tr = make_trainer(grpo_config(ckpt, out, mode=mode, mesh=mesh or mesh8, lr=1e-3, prompts=4, **q))
    m = run_steps(tr, 1)[0]
    return m, tr.learner.trainable, tr.learner.rest


SHARDED_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
import jax, numpy as np
from test_train_modes import SHARDED_MODES, flat_arrays, one_step
assert jax.device_count() == 8, jax.device_count()
ckpt, out = sys.argv[1], sys.argv[2]
res = {}
for name in SHARDED_MODES:
    m, trainable, rest = one_step(ckpt, f"{out}/{name}", name)
    leaves = jax.tree.leaves(trainable)
    sharded = sum(1 for x in leaves if not x.sharding.is_fully_replicated)
    rest_sharded = sum(1 for x in jax.tree.leaves(rest) if hasattr(x, "sharding") and not x.sharding.is_fully_replicated)
    np.savez(f"{out}/{name}.npz", **flat_arrays(trainable))
    np.savez(f"{out}/{name}_rest.npz", **flat_arrays(rest))
    res[name] = {"metrics": {k: float(v) for k, v in m.items() if np.ndim(v) == 0 and not k.startswith("perf/")},
                 "sharded": sharded, "rest_sharded": rest_sharded, "n": len(leaves)}
    print(name, res[name], flush=True)
print("RESULT " + json.dumps(res))
"""


@pytest.mark.slow(reason="one GRPO step per train mode on 8 CPU devices in a subprocess, compared with the single-device step")
def test_train_modes_sharded_8_devices(scratch_ckpt, tmp_path):
    """One GRPO step per train mode on 8 devices; QAT and QLoRA equal the same step on this process's single
    device: the same rollouts (rewards), loss and gradient norm, and the same parameters afterwards (QLoRA: the
    packed base too)."""
    script = tmp_path / "sharded_modes.py"
    script.write_text(SHARDED_SCRIPT)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    runs = tmp_path / "runs"
    # The 8-device run goes in the background while this (1-device) process computes the reference steps.
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        p = subprocess.Popen([sys.executable, str(script), scratch_ckpt, str(runs), os.path.join(REPO, "tests")],
                             env=env, cwd=REPO, stdout=out, stderr=err)
        try:
            assert jax.device_count() == 1
            single = {name: one_step(scratch_ckpt, str(tmp_path / "single" / name), name, mesh=(1, -1, 1))
                      for name in COMPARED_MODES}
            p.wait(timeout=900)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert p.returncode == 0, stdout[-3000:] + stderr[-6000:]
    line = [l for l in stdout.splitlines() if l.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    assert sorted(res) == sorted(SHARDED_MODES)
    for name, r in res.items():
        m8 = r["metrics"]
        assert np.isfinite(m8["train/loss"]) and np.isfinite(m8["train/grad_norm"]) and m8["train/grad_norm"] > 0, \
            (name, m8)
        assert r["sharded"] > 0, (name, r)  # parameters really are split over the mesh
    assert res["qlora"]["rest_sharded"] > 0  # packed base (and frozen float params) sharded too
    for name in COMPARED_MODES:
        m1, trainable1, rest1 = single[name]
        m8 = res[name]["metrics"]
        for k, v in m8.items():
            if k.startswith("reward/"):  # same sampled completions: rollouts do not depend on the mesh
                assert v == float(m1[k]), (name, k, v, m1[k])
        for k in ("train/loss", "train/grad_norm"):
            np.testing.assert_allclose(m8[k], float(m1[k]), rtol=1e-4, atol=1e-7, err_msg=f"{name} {k}")
        for what, tree in (("trainable", trainable1), ("rest", rest1)):
            a, b = flat_arrays(tree), np.load(runs / (f"{name}.npz" if what == "trainable" else f"{name}_rest.npz"))
            assert sorted(a) == sorted(b.files), (name, what)
            for k in a:
                if what == "rest" or not np.issubdtype(a[k].dtype, np.floating):
                    np.testing.assert_array_equal(b[k], a[k], err_msg=f"{name} {what} {k}")  # frozen: bit-equal
                else:  # one Adam step of lr = 1e-3 (QAT: a float-noise gradient can flip a rounding)
                    assert_adam_step_close(b[k], a[k], lr=1e-3, atol=2e-5, err_msg=f"{name} {what} {k}")
