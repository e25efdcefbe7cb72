"""rollout.decode_attention / generation.decode_attention / `lrmq.generate --decode-attention`: the engine's
decode attention (`attention.DECODE_ATTENTION`, "auto" by default) as a setting of every command, so the fp8
refusal's advice (`attention.fp8_heads_message`: the XLA path given explicitly) can be followed. Nothing compiles:
the Engine is replaced by a recorder that stops the call once it has seen its `impl`."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import pytest

from conftest import REPO_ROOT
from lrmq import aot
from lrmq.checkpoint.load import TINY_MODEL_DIR, read_model_config
from lrmq.config_help import NAMES
from lrmq.configlib import ConfigError, load_config
from lrmq.evals.config import GenerationSection, eval_config
from lrmq.generation.attention import DECODE_ATTENTION
from lrmq.rl.config import RolloutSection, TrainConfig

TINY_DEMO = os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml")
NAMES_OFFERED = ("auto", *DECODE_ATTENTION)


class Seen(Exception):
    """Raised by the recording Engine: the call got as far as building its engine."""


def recorder(seen: list, stop: bool = True):
    def engine(*args, config=None, **kw):
        impl = config.attention
        seen.append(impl)
        if stop:
            raise Seen(impl)
        return types.SimpleNamespace(impl=impl)
    return engine


def test_the_settings_offer_the_engines_names():
    """"auto" and attention.DECODE_ATTENTION, taken from the engine (an implementation added there is offered)."""
    assert typing.get_args(typing.get_type_hints(RolloutSection)["decode_attention"]) == NAMES_OFFERED
    field = {f.name: f for f in dataclasses.fields(GenerationSection)}["decode_attention"]
    assert tuple(field.metadata[NAMES]) == NAMES_OFFERED
    assert RolloutSection().decode_attention == GenerationSection().decode_attention == "auto"


def test_an_unknown_name_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.decode_attention.*pallas"):
        load_config(TrainConfig, TINY_DEMO, ["rollout.decode_attention=pallas"])
    with pytest.raises(ConfigError, match=r"generation\.decode_attention.*pallas"):
        eval_config(None, ["checkpoint=tiny", "generation.decode_attention=pallas"])


def test_the_samplers_engines_take_rollout_decode_attention(monkeypatch):
    """Both engines the Sampler builds (the policy's, which also evaluates, and the rollout copy's), from the one
    EngineConfig the config gives."""
    from lrmq.rl import sampler

    seen = []
    monkeypatch.setattr(sampler, "Engine", recorder(seen, stop=False))
    cfg = load_config(TrainConfig, TINY_DEMO, ["rollout.decode_attention=xla"])
    s = sampler.Sampler(cfg, types.SimpleNamespace(eos_ids=(0,), pad_id=0), policy_graphdef=object(),
                        rollout_graphdef=object(), model_cfg=None, mesh=None, engine=cfg.rollout.engine_config())
    assert seen == ["xla", "xla"] and s.engine.impl == s.rollout_engine.impl == "xla"


def test_the_compile_only_engines_take_the_setting(monkeypatch):
    """The trainer's preflight / lrmq.train --compile-only (aot._rollout_programs), lrmq.evaluate --compile-only
    and lrmq.generate --compile-only all reach aot.compile_generate's Engine with the setting."""
    from lrmq import evaluate, generate

    seen = []
    monkeypatch.setattr(aot, "Engine", recorder(seen))
    cfg = load_config(TrainConfig, TINY_DEMO, ["rollout.decode_attention=xla"])
    with pytest.raises(Seen):
        aot._rollout_programs(cfg, None, None, None, read_model_config(TINY_MODEL_DIR))
    ecfg = eval_config(None, ["checkpoint=tiny", "generation.decode_attention=xla"])
    with pytest.raises(Seen):
        evaluate.compile_only(ecfg, types.SimpleNamespace(shapes=None, prompt_len=16, topology=None, platform="tpu",
                                                         pack=None))
    args = generate.parse_args(["--compile-only", "--checkpoint", "tiny", "--prompt-len", "16",
                                "--decode-attention", "xla"])
    with pytest.raises(Seen):
        generate.compile_only(args)
    assert seen == ["xla", "xla", "xla"]


def test_the_generate_and_evaluate_engines_take_the_setting(monkeypatch):
    """lrmq.generate's engine (tiny model) and run_suite's own engine (generation.decode_attention)."""
    from flax import nnx

    from lrmq import generate
    from lrmq.evals import runner

    seen = []
    monkeypatch.setattr(generate, "Engine", recorder(seen))
    with pytest.raises(Seen):
        generate.generate(generate.parse_args(["--checkpoint", "tiny", "--prompt", "1 + 1 =",
                                               "--decode-attention", "xla"]))
    monkeypatch.setattr(runner, "Engine", recorder(seen))
    gen = eval_config(None, ["generation.decode_attention=xla"]).generation
    with pytest.raises(Seen):
        runner.run_suite(nnx.Module(), types.SimpleNamespace(eos_ids=(0,), pad_id=0), [], gen)
    assert seen == ["xla", "xla"]


def test_generate_flag_parses():
    from lrmq import generate

    base = ["--checkpoint", "tiny", "--prompt", "x"]
    assert generate.parse_args(base).decode_attention == "auto"
    for name in DECODE_ATTENTION:
        assert generate.parse_args([*base, "--decode-attention", name]).decode_attention == name
    with pytest.raises(SystemExit):
        generate.parse_args([*base, "--decode-attention", "pallas"])
