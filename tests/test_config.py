"""The two run configs (TrainConfig, QuantizeConfig): registered names checked when the config is read,
a description for every option, --help-config and --print-config of both commands."""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from conftest import REPO_ROOT
from lrmq import quantize as qcli
from lrmq import train as tcli
from lrmq.config_help import NAMES, field_help, iter_options, strip_optional
from lrmq.configlib import ConfigError, config_from_dict, load_config
from lrmq.model.decoder import REMAT_POLICIES
from lrmq.ptq.config import QuantizeConfig, load_quantize_config
from lrmq.quant.qat import SCHEMES
from lrmq.quant.training import BASE_FORMATS
from lrmq.rl.config import TrainConfig

TINY_DEMO = os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml")
PTQ_BASE = ["model=tiny"]

# (dotted key, a typo): every field whose value is looked up by name (a registry, or a Literal that
# mirrors one) fails at load with the key in the message
TRAIN_NAMES = [
    ("algo.policy_loss", "grpoo"),
    ("algo.advantage", "gpro"),
    ("algo.loss_aggregation", "token_mean"),
    ("algo.kl_estimator", "k4"),
    ("algo.reward", "boxed-math"),
    ("data.template", "qwen-math"),
    ("model.shapes", "qwen3-9b"),
    ("model.remat", "dot"),
    ("quant.qat_scheme", "int3"),
    ("quant.base_format", "nf3"),
    ("quant.mode", "qlor"),
]
PTQ_NAMES = [
    ("method", "awg"),
    ("calibration.template", "chatt"),
    ("quantlrm.mapping", "ushape"),
    ("outputs.formats", "[packed, fakequant]"),
    ("calibration.source", "txt"),
    ("awq.gqa_vo", "down"),
    ("gptq.propagate", "float"),
]


@pytest.mark.parametrize("key,value", TRAIN_NAMES)
def test_train_names_fail_at_load(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, TINY_DEMO, [f"{key}={value}"])
    msg = str(e.value)
    assert f"override '{key}={value}': {key}" in msg and value in msg


@pytest.mark.parametrize("key,value", PTQ_NAMES)
def test_ptq_names_fail_at_load(key, value):
    with pytest.raises(ConfigError) as e:
        load_quantize_config(None, PTQ_BASE + [f"{key}={value}"])
    assert key in str(e.value) and value.strip("[]").split(", ")[-1] in str(e.value)


def test_policy_loss_typo_message():
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, TINY_DEMO, ["algo.policy_loss=grpoo"])
    assert ("override 'algo.policy_loss=grpoo': algo.policy_loss: unknown policy loss 'grpoo'; "
            "known: ['grpo', 'ppo-clip'] (did you mean 'grpo'?)") in str(e.value)


def test_bad_names_reported_together_and_blamed_on_the_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("algo:\n  policy_loss: grpoo\n  reward: nope\ndata:\n  template: chatt\nrun:\n  steps: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, p)
    msg = str(e.value)
    assert "4 config errors" in msg
    for key in ("algo.policy_loss", "algo.reward", "data.template", "run.steps"):
        assert f"{p}: {key}: " in msg
    # a list element names its index; several bad fields of the PTQ schema at once too
    with pytest.raises(ConfigError) as e:
        load_quantize_config(None, PTQ_BASE + ["method=bogus", "outputs.formats=[packed, nope]"])
    assert "2 config errors" in str(e.value) and "outputs.formats[1]: unknown output format 'nope'" in str(e.value)


def test_registered_names_and_empty_shapes_load():
    cfg = config_from_dict(TrainConfig, {"algo": {"policy_loss": "ppo-clip", "loss_aggregation": "drgrpo-constant",
                                                  "advantage": "rloo", "kl_estimator": "k1"},
                                         "model": {"shapes": "qwen3-8b"}, "data": {"template": "qwen_math"}})
    assert cfg.algo.policy_loss == "ppo-clip" and cfg.model.shapes == "qwen3-8b"
    assert config_from_dict(TrainConfig, {"model": {"shapes": ""}}).model.shapes == ""
    cfg = load_quantize_config(None, PTQ_BASE + ["method=rtn", "outputs.formats=[packed, compressed_tensors]",
                                                 "quantlrm.mapping=inverted_u"])
    assert cfg.outputs.formats == ["packed", "compressed_tensors"]


def test_literals_match_their_registries():
    hints = lambda cls: typing.get_type_hints(cls)
    from lrmq.rl.config import ModelSection, QuantSection

    assert set(typing.get_args(hints(ModelSection)["remat"])) == {"none", *REMAT_POLICIES}
    assert set(typing.get_args(hints(QuantSection)["qat_scheme"])) == set(SCHEMES)
    assert set(typing.get_args(hints(QuantSection)["base_format"])) == set(BASE_FORMATS)


@pytest.mark.parametrize("cls", [TrainConfig, QuantizeConfig])
def test_every_option_has_a_description(cls):
    missing = [key for key, _, f in iter_options(cls) if not field_help(f).strip()]
    assert not missing, f"fields without a description (configlib.opt(..., help)): {missing}"
    multi = [key for key, _, f in iter_options(cls) if "\n" in field_help(f)]
    assert not multi, f"descriptions are one line: {multi}"


def test_registry_fields_are_declared():
    """Every str field that names a registry entry carries the registry (so a typo fails at load)."""
    declared = {key for cls in (TrainConfig, QuantizeConfig) for key, _, f in iter_options(cls) if NAMES in f.metadata}
    assert declared == {"algo.advantage", "algo.loss_aggregation", "algo.policy_loss", "algo.kl_estimator",
                        "algo.reward", "data.template", "model.shapes", "method", "calibration.template",
                        "quantlrm.mapping", "outputs.formats"}


def test_train_help_config(capsys):
    with pytest.raises(SystemExit) as e:
        tcli.main(["--help-config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "  algo.policy_loss (str) = grpo\n" in out
    assert "known policy loss names: grpo, ppo-clip" in out
    assert "optim.lr (float) = 1.0e-06" in out and "peak learning rate" in out
    assert "model.dtype (float32|bfloat16) = float32" in out
    assert "data.train_files (list[str]) = []" in out
    for key, _, f in iter_options(TrainConfig):
        assert key in out and field_help(f) in out


def test_train_help_mentions_help_config(capsys):
    with pytest.raises(SystemExit):
        tcli.main(["--help"])
    assert "--help-config" in capsys.readouterr().out


def test_train_print_config_roundtrips_with_comments(capsys, tmp_path):
    assert tcli.main(["--config", TINY_DEMO, "--print-config", "algo.beta=0.1", "data.train_files=[a.jsonl]"]) == 0
    out = capsys.readouterr().out
    assert "# the importance ratio is clipped above at 1 + eps_high\n  eps_high: 0.2\n" in out
    assert "# advantages, policy loss, KL penalty and reward\nalgo:\n" in out
    p = tmp_path / "printed.yaml"
    p.write_text(out)
    assert load_config(TrainConfig, p) == load_config(TrainConfig, TINY_DEMO, ["algo.beta=0.1",
                                                                               "data.train_files=[a.jsonl]"])


def test_train_cli_policy_loss_typo_exits_2(capsys):
    assert tcli.main(["--config", TINY_DEMO, "algo.policy_loss=grpoo"]) == 2
    assert "algo.policy_loss: unknown policy loss 'grpoo'" in capsys.readouterr().err


def test_quantize_help_and_print_config(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        qcli.main(["--help-config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "known ptq method names: awq, gptq, int8, nf4, quantlrm, rtn" in out
    for key, _, f in iter_options(QuantizeConfig):
        assert key in out and field_help(f) in out
    cfg_file = os.path.join(REPO_ROOT, "configs", "ptq", "awq_w4_qwen3.yaml")
    assert qcli.main(["--config", cfg_file, "--print-config", "outputs.overwrite=true"]) == 0
    out = capsys.readouterr().out
    assert "# PTQ method\nmethod: awq\n" in out
    p = tmp_path / "printed.yaml"
    p.write_text(out)
    assert load_quantize_config(str(p)) == load_quantize_config(cfg_file, ["outputs.overwrite=true"])
    assert qcli.main(["--config", cfg_file, "method=awg"]) == 2
    assert "method: unknown ptq method 'awg'" in capsys.readouterr().err


def test_sections_are_described_dataclasses():
    for cls in (TrainConfig, QuantizeConfig):
        for key, tp, f in iter_options(cls):
            if dataclasses.is_dataclass(strip_optional(tp)):
                assert field_help(f), key


@pytest.mark.parametrize("how", ["yaml", "override"])
def test_removed_run_log_every_is_refused_by_name(tmp_path, how):
    """run.log_every did nothing and was removed: an old config that sets it fails naming the key and why."""
    if how == "yaml":
        p = tmp_path / "old.yaml"
        p.write_text("run:\n  steps: 3\n  log_every: 10\n")
        with pytest.raises(ConfigError) as e:
            load_config(TrainConfig, p)
        assert str(p) in str(e.value)
    else:
        with pytest.raises(ConfigError) as e:
            load_config(TrainConfig, None, ["run.log_every=5"])
    msg = str(e.value)
    assert "'run.log_every' was removed from lrmq" in msg and "delete it from the config" in msg
    assert "unknown key" not in msg


def test_no_option_is_documented_as_unused():
    from lrmq.evals.config import EvalConfig
    from lrmq.studies.config import StudyConfig

    for cls in (TrainConfig, QuantizeConfig, EvalConfig, StudyConfig):
        for key, _, f in iter_options(cls):
            text = field_help(f).lower()
            assert "not used" not in text and "kept so older configs" not in text, (cls.__name__, key)


@pytest.mark.parametrize("steps,iters,warmup_steps,ratio,want", [
    (100, 1, 1, 0.0, 1),     # the count alone (lrmq's default)
    (100, 1, 0, 0.1, 10),    # TRL's warmup_ratio: ceil(0.1 x 100)
    (30, 2, 1, 0.05, 3),     # of all optimizer updates: ceil(0.05 x 60)
    (100, 1, 20, 0.1, 20),   # the larger of the two
    (10, 1, 0, 1.0, 10),     # never past the last update
])
def test_warmup_ratio_schedule(steps, iters, warmup_steps, ratio, want):
    from lrmq.rl.step import make_optimizer

    cfg = load_config(TrainConfig, None, [f"run.steps={steps}", f"algo.num_iterations={iters}",
                                          f"optim.warmup_steps={warmup_steps}", f"optim.warmup_ratio={ratio}",
                                          "optim.lr=1.0", "optim.schedule=constant"])
    assert cfg.optim.warmup_updates(steps * iters) == want
    _, sched = make_optimizer(cfg)
    lrs = [float(sched(i)) for i in range(want + 2)]
    assert lrs[want] == pytest.approx(1.0) and lrs[want - 1] == pytest.approx((want - 1) / want)
    with pytest.raises(ConfigError, match="optim.warmup_ratio"):
        load_config(TrainConfig, None, ["optim.warmup_ratio=1.5"])
