"""Every paper-1 recipe trains what the paper trained: its steps x prompts per step are the epochs of data it states,
over the batch its header claims, and its mesh is the hardware its comments name.

A recipe states its budget on one header line, checked here against the loaded config (not the comment alone):
    # Budget: 32 prompts x 8 completions per step, 312 steps = 9,984 prompts: one epoch of the first 10,000 (...)
"""

from __future__ import annotations

import glob
import math
import os
import re

import pytest

from lrmq.configlib import load_config
from lrmq.rl.config import TrainConfig

from conftest import REPO_ROOT

RECIPES = sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "paper1", "*.yaml")))
BUDGET = re.compile(r"^# Budget: (?P<prompts>\d+) prompts x (?P<completions>\d+) completions per step, "
                    r"(?P<steps>[\d,]+) steps = (?P<used>[\d,]+) prompts: (?P<epochs>one|two|three|\d+) epochs? "
                    r"of the first (?P<data>[\d,]+)", re.M)
WORDS = {"one": 1, "two": 2, "three": 3}
# Paper 1 (docs: ../shared/reference/papers.md): 10k MATH prompts, one epoch, 32 prompts x 8 completions per step.
PAPER = {"prompts": 32, "completions": 8, "epochs": 1, "data": 10_000}
# Chips and hosts of the TPU slices the recipes name (a v5p chip: 4 per host; v5e/v6e 8-chip slices: one host).
SLICES = {"v5p:2x4x4": (32, 8), "v5e:2x4": (8, 1), "v6e:2x4": (8, 1)}


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def budget_of(text: str, path: str) -> dict[str, int]:
    m = BUDGET.search(text)
    assert m, f"{path}: no '# Budget: P prompts x G completions per step, S steps = N prompts: E epoch(s) of the first D' line"
    d = m.groupdict()
    return {"prompts": _num(d["prompts"]), "completions": _num(d["completions"]), "steps": _num(d["steps"]),
            "used": _num(d["used"]), "epochs": WORDS.get(d["epochs"]) or int(d["epochs"]), "data": _num(d["data"])}


def check_recipe(path: str) -> None:
    """Raises AssertionError naming the recipe and the number that disagrees."""
    text = open(path).read()
    cfg = load_config(TrainConfig, path)
    b = budget_of(text, path)
    name = os.path.relpath(path, REPO_ROOT)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (b["prompts"], b["completions"]), \
        f"{name}: rollout is {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} per step, " \
        f"its Budget line says {b['prompts']} x {b['completions']}"
    assert cfg.run.steps == b["steps"], f"{name}: run.steps={cfg.run.steps}, its Budget line says {b['steps']}"
    assert cfg.data.max_train_examples == b["data"], \
        f"{name}: data.max_train_examples={cfg.data.max_train_examples}, its Budget line says {b['data']}"
    used = cfg.run.steps * cfg.rollout.prompts_per_step
    assert used == b["used"], f"{name}: {cfg.run.steps} steps x {cfg.rollout.prompts_per_step} = {used} prompts, " \
                              f"its Budget line says {b['used']}"
    # The stated epochs: every prompt of them but less than one step's worth is trained on, none twice more.
    available = b["epochs"] * cfg.data.max_train_examples
    assert available - cfg.rollout.prompts_per_step < used <= available, \
        f"{name}: {used} prompts trained is not {b['epochs']} epoch(s) of {cfg.data.max_train_examples}"
    assert math.floor(available / cfg.rollout.prompts_per_step) == cfg.run.steps, name
    # The mesh covers the slice the recipe names, and its comments count that slice's chips and hosts.
    chips, hosts = SLICES[cfg.mesh.topology]
    mesh_devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.expert
    assert mesh_devices == chips, f"{name}: mesh {mesh_devices} devices on {cfg.mesh.topology} ({chips} chips)"
    for line in text.splitlines():
        for m in re.finditer(r"(?<!of )\b(\d+) chips", line):  # a line naming the v5p-64 pod speaks of that slice
            want = SLICES["v5p:2x4x4"][0] if "v5p-64" in line else chips
            assert int(m.group(1)) == want, f"{name}: a comment says {m.group(0)}; expected {want}: {line.strip()}"
    for m in re.finditer(r"(\d+) hosts", text):
        assert int(m.group(1)) == hosts, f"{name}: a comment says {m.group(0)}; {cfg.mesh.topology} has {hosts}"


def test_there_are_seventeen_paper1_recipes():
    """Qwen3 0.6B-8B, GRPO and Dr.GRPO, on 8 chips and on the v5p-64 pod; Qwen3-30B-A3B GRPO on the pod."""
    assert len(RECIPES) == 17, RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_trains_the_papers_budget(path):
    check_recipe(path)
    b = budget_of(open(path).read(), path)
    assert {k: b[k] for k in PAPER} == PAPER, f"{path}: departs from the paper's batch or data without saying why"


def test_the_check_catches_four_epochs_at_four_times_the_batch(tmp_path):
    """The pod recipes before the fix: 128 prompts per step, 312 steps (39,936 prompts of 10,000)."""
    src = open(os.path.join(REPO_ROOT, "configs", "paper1", "pod_v5p64_0.6b_grpo.yaml")).read()
    bad = tmp_path / "pod.yaml"
    bad.write_text(src.replace("prompts_per_step: 32 ", "prompts_per_step: 128"))
    with pytest.raises(AssertionError, match="128 prompts x 8 per step"):
        check_recipe(str(bad))
    bad.write_text(src.replace("8 hosts of 4 chips", "4 hosts of 8 chips"))
    with pytest.raises(AssertionError, match="says 4 hosts"):
        check_recipe(str(bad))
    bad.write_text(src.replace("steps: 312 ", "steps: 624 ").replace("312 steps = 9,984", "624 steps = 19,968"))
    with pytest.raises(AssertionError, match="is not 1 epoch"):
        check_recipe(str(bad))


PTQ_RECIPES = sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "ptq", "*.yaml")))


@pytest.mark.parametrize("path", PTQ_RECIPES, ids=os.path.basename)
def test_ptq_recipes_name_local_paths_not_hub_ids(path):
    """configs/ptq name checkpoints as /path/to/... placeholders or lrmq run dirs: lrmq reads no hub ids."""
    from lrmq.ptq.config import load_quantize_config

    cfg = load_quantize_config(path)
    for key, value in (("model", cfg.model), ("quantlrm.base", cfg.quantlrm.base)):
        if value:
            assert value.startswith(("/path/to/", "runs/")), f"{path}: {key}: {value}"
    text = open(path).read()
    if cfg.bits not in (4, 8) and "compressed_tensors" in cfg.outputs.formats:
        assert "NOT vLLM" in text, f"{path}: W{cfg.bits} compressed_tensors must say it is not for vLLM"


def test_a_hub_id_that_is_not_a_directory_says_how_to_get_one(monkeypatch):
    from lrmq.checkpoint.load import checkpoint_kind

    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(FileNotFoundError, match="huggingface-cli download Qwen/Qwen3-8B --local-dir DIR"):
        checkpoint_kind("Qwen/Qwen3-8B")
    for local in ("lrmq/none_such", os.path.join(REPO_ROOT, "none_such")):  # a local dir's child, an absolute path
        with pytest.raises(FileNotFoundError) as e:
            checkpoint_kind(local)
        assert "hub" not in str(e.value)
