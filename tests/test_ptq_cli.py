"""End to end on the shipped tiny model: GRPO run -> QuantLRM / AWQ through `python -m lrmq.quantize` -> generate."""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO_ROOT, TINY_MODEL_DIR


@pytest.fixture
def cli_main(cli):
    """cli_main(module, *argv) -> stdout of a command that must succeed, run as its main() in this process
    (conftest's cli: the tests are about what the commands write, not about process start-up)."""

    def call(module: str, *argv: str) -> str:
        r = cli(module, *argv)
        assert r.returncode == 0, (module, argv, r.stdout[-2000:], r.stderr[-4000:])
        return r.stdout

    return call


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    from lrmq.data.synthetic import make_splits, write_jsonl

    d = tmp_path_factory.mktemp("calib")
    train, _ = make_splits(64, 8, seed=5)
    path = d / "train.jsonl"
    write_jsonl(path, [{"text": f"{r['problem']} Answer: {r['solution']}", **r} for r in train])
    return str(path)


def test_awq_flag_form_then_generate(tmp_path, calib_file, cli_main):
    out = tmp_path / "awq_w4"
    cli_main("quantize", "--checkpoint", TINY_MODEL_DIR, "--method", "awq", "--bits", "4", "--group-size", "128",
             "--calibration", calib_file, "--out", str(out))
    stdout = cli_main("generate", "--checkpoint", str(out), "--prompt", "Compute 3+4. Answer:", "--greedy",
                      "--max-new-tokens", "16", "--json")
    row = json.loads(stdout.splitlines()[0])
    assert row["token_ids"] and len(row["logprobs"]) == len(row["token_ids"])


@pytest.mark.slow(reason="lrmq.train makes a run dir (two GRPO steps, both HF exports), then QuantLRM reads it")
def test_quantlrm_on_a_grpo_run_dir(tmp_path, calib_file, cli_main):
    """lrmq.train makes the run dir, then the QuantLRM quantize command reads its initial and final policies. No
    held-out evaluation in the run: QuantLRM reads only the two exports. Both commands run as their main() in
    this process (cli_main puts back the signal handlers and logging lrmq.train sets)."""
    run = tmp_path / "run"
    cli_main("train", "--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), f"run.out_dir={run}",
             "run.steps=2", "run.eval_size=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
             "data.synthetic_train_size=64", "data.synthetic_eval_size=8", "optim.lr=1e-3", "run.progress=false",
             "rollout.update_shapes=1")
    assert (run / "initial_policy" / "model.safetensors").exists() and (run / "final_policy" / "config.json").exists()
    out = tmp_path / "qlrm"
    cli_main("quantize", "--config", os.path.join(REPO_ROOT, "configs", "ptq", "quantlrm_tiny_grpo_run.yaml"),
             f"quantlrm.run_dir={run}", f"calibration.path={calib_file}", f"outputs.dir={out}", "progress=false")
    produced = sorted(os.listdir(out))
    assert any(p.startswith("packed") or p == "packed" for p in produced), produced
    npz = [os.path.join(dp, f) for dp, _, fs in os.walk(out) for f in fs if f.endswith(".npz")]
    assert npz, "importance vectors were not saved"
