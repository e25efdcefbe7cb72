"""What a GRPO run starts from: its prompt datasets and its (possibly quantized) policy model."""

from __future__ import annotations

import os

from lrmq.checkpoint.load import load_model, resolve_checkpoint
from lrmq.checkpoint.quantized import refuse_quantized
from lrmq.configlib import ConfigError
from lrmq.data.prompts import load_prompt_dataset
from lrmq.data.synthetic import make_splits
from lrmq.model.config import ModelConfig
from lrmq.model.presets import preset_config
from lrmq.quant.training import prepare_for_training
from lrmq.rl.config import TrainConfig


def load_datasets(cfg: TrainConfig) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of {"problem", "answer", ...}: the configured files, or synthetic
    arithmetic with its own held-out split."""
    d = cfg.data
    if not d.train_files:
        train, held = make_splits(d.synthetic_train_size, d.synthetic_eval_size, seed=d.synthetic_seed)
        strip = lambda rows: [{"problem": r["problem"], "answer": str(r["answer"])} for r in rows]
        return strip(train), strip(held)

    kw = dict(problem_field=d.problem_field, answer_field=d.answer_field, solution_field=d.solution_field)
    train = load_prompt_dataset(d.train_files, option="data.train_files", **kw)
    if d.max_train_examples:
        train = train.select(range(min(d.max_train_examples, len(train))))
    train = [dict(r) for r in train]
    held = [dict(r) for r in load_prompt_dataset(d.eval_files, option="data.eval_files", **kw)] if d.eval_files else []
    return train, held


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The architecture: the checkpoint's config.json when it is here, else the `model.shapes` preset."""
    m = cfg.model
    path = resolve_checkpoint(m.checkpoint)
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelConfig.from_hf_file(path, dtype=m.dtype, param_dtype=m.param_dtype)
    if m.shapes:
        return preset_config(m.shapes, dtype=m.dtype, param_dtype=m.param_dtype)
    raise ConfigError(f"model.checkpoint={m.checkpoint!r} has no config.json here; set model.shapes to one of "
                      f"the presets in lrmq/model/presets.py to compile without the weights")


def build_model(cfg: TrainConfig, mesh):
    """The policy on `mesh`, prepared for the configured quant.mode (QAT dot_generals or a QLoRA base). A quantized
    model.checkpoint (lrmq packed, compressed-tensors, AutoAWQ) is a QLoRA base only: its packed Linears stay as
    they are (`pack_base` packs the float ones); any other mode is refused in one line naming its format."""
    path = resolve_checkpoint(cfg.model.checkpoint)
    if cfg.quant.mode != "qlora":
        refuse_quantized(path, f"model.checkpoint with quant.mode={cfg.quant.mode}",
                         "train QLoRA adapters on it (quant.mode=qlora), or start from its float checkpoint")
    model = load_model(path, mesh=mesh, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    if cfg.quant.mode != "none":
        model = prepare_for_training(model, cfg.quant, seed=cfg.run.seed, mesh=mesh)
    return model
