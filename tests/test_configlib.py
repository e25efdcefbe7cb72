from __future__ import annotations

import argparse
import dataclasses
from typing import Literal, Optional

import pytest

from lrmq.configlib import (
    ConfigError,
    add_config_args,
    config_from_args,
    config_from_dict,
    dump_config,
    load_config,
    save_config,
)


@dataclasses.dataclass(frozen=True)
class Model:
    hidden_size: int
    num_heads: int = 4
    dtype: Literal["float32", "bfloat16"] = "float32"
    name: str = "tiny"

    def validate(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")


@dataclasses.dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, ...] = (0.9, 0.999)
    warmup: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Run:
    model: Model
    optim: Optim = dataclasses.field(default_factory=Optim)
    steps: int = 10
    use_lora: bool = False
    layers: list[int] = dataclasses.field(default_factory=list)
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: Optional[Model] = None


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "model:\n  hidden_size: 64\noptim:\n  lr: 1e-6\n  betas: [0.8, 0.9]\nrewards: {fmt: 0.1}\n")
    cfg = load_config(Run, p, ["steps=5", "use_lora=true", "layers=[1,2]", "optim.warmup=null", "model.name=123",
                               "rewards.correct=1", "model.dtype=bfloat16"])
    assert cfg.model == Model(hidden_size=64, dtype="bfloat16", name="123")
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.9) and isinstance(cfg.optim.betas, tuple)
    assert cfg.optim.warmup is None
    assert cfg.steps == 5 and cfg.use_lora is True and cfg.layers == [1, 2]
    assert cfg.rewards == {"fmt": 0.1, "correct": 1.0}
    # override creates a nested Optional dataclass that the file left out
    cfg2 = load_config(Run, p, ["extra.hidden_size=8"])
    assert cfg2.extra == Model(hidden_size=8)


def test_int_accepted_for_float_but_not_bool_for_int():
    cfg = config_from_dict(Run, {"model": {"hidden_size": 8}, "optim": {"lr": 1}})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    with pytest.raises(ConfigError, match=r"steps: expected int, found bool True"):
        config_from_dict(Run, {"model": {"hidden_size": 8}, "steps": True})


def test_unknown_key_names_path_file_and_suggestion(tmp_path):
    p = write(tmp_path, "model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(Run, p)
    msg = str(e.value)
    assert "cfg.yaml" in msg and "'model.hiden_size'" in msg and "did you mean 'model.hidden_size'" in msg
    # also reports the missing required field in the same error
    assert "missing required field 'model.hidden_size'" in msg


def test_unknown_override_key():
    with pytest.raises(ConfigError, match=r"override 'optim.lrr=1'.*did you mean 'optim.lr'"):
        load_config(Run, None, ["model.hidden_size=8", "optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"'steps' is a int, it has no key 'x'"):
        load_config(Run, None, ["model.hidden_size=8", "steps.x=1"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(Run, None, ["steps"])


def test_wrong_type_and_literal(tmp_path):
    p = write(tmp_path, "model:\n  hidden_size: '64'\n  dtype: fp8\noptim:\n  betas: 0.9\n")
    with pytest.raises(ConfigError) as e:
        load_config(Run, p)
    msg = str(e.value)
    assert "3 config errors" in msg
    assert "model.hidden_size: expected int, found str '64'" in msg
    assert "model.dtype: expected one of ['float32', 'bfloat16'], found 'fp8'" in msg
    assert "optim.betas: expected a list" in msg


def test_wrong_type_from_override_blames_override(tmp_path):
    p = write(tmp_path, "model:\n  hidden_size: 64\n")
    with pytest.raises(ConfigError, match=r"override 'steps=abc': steps: expected int, found str 'abc'"):
        load_config(Run, p, ["steps=abc"])
    with pytest.raises(ConfigError, match=r"layers\[1\]: expected int"):
        load_config(Run, p, ["layers=[1, x]"])


def test_validate_runs_recursively():
    with pytest.raises(ConfigError, match=r"model: Model.validate: hidden_size 10 not divisible by num_heads 4"):
        config_from_dict(Run, {"model": {"hidden_size": 10}}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"x.yaml: extra: Model.validate"):
        config_from_dict(Run, {"model": {"hidden_size": 8}, "extra": {"hidden_size": 3}}, source="x.yaml")


def test_nothing_built_on_error(monkeypatch):
    built = []
    orig = Optim.__init__

    def spy(self, *a, **k):
        built.append(1)
        orig(self, *a, **k)

    monkeypatch.setattr(Optim, "__init__", spy)
    with pytest.raises(ConfigError):
        config_from_dict(Run, {"optim": {"lr": 0.1}, "model": {"hidden_size": 8}, "steps": "x"})
    assert built == []
    config_from_dict(Run, {"optim": {"lr": 0.1}, "model": {"hidden_size": 8}})
    assert built == [1]


def test_dump_save_roundtrip(tmp_path):
    cfg = load_config(Run, None, ["model.hidden_size=16", "optim.lr=1e-6", "rewards.a=0.5", "extra.hidden_size=4"])
    text = dump_config(cfg)
    assert "lr: 1.0e-06" in text
    path = tmp_path / "sub" / "saved.yaml"
    save_config(cfg, path)
    assert load_config(Run, path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["saved.yaml"]  # no temp file left behind


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(Run, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="bad.yaml: top level must be a mapping"):
        load_config(Run, write(tmp_path, "- 1\n", "bad.yaml"))


def test_argparse_helper(tmp_path):
    p = write(tmp_path, "model:\n  hidden_size: 32\n")
    parser = add_config_args(argparse.ArgumentParser())
    args = parser.parse_args(["--config", str(p), "steps=3", "optim.betas=[0.1, 0.2]"])
    cfg = config_from_args(Run, args)
    assert cfg.steps == 3 and cfg.model.hidden_size == 32 and cfg.optim.betas == (0.1, 0.2)
