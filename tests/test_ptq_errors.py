"""Bad PTQ inputs: clear errors and no output directory."""

from __future__ import annotations

import os

import pytest

from test_quantlrm_model import qcfg, setup  # noqa: F401 (fixture)


def _fails(cfg, match):
    from lrmq.ptq.pipeline import run_quantize

    with pytest.raises(Exception, match=match):
        run_quantize(cfg)
    assert not os.path.exists(cfg.outputs.dir)
    parent = os.path.dirname(os.path.abspath(cfg.outputs.dir))
    assert not [n for n in os.listdir(parent) if ".tmp-" in n]


def test_mismatched_architectures(setup, hf_checkpoint, tmp_path):
    other, _ = hf_checkpoint("llama3")  # head_dim 16 instead of 24: q/k/v/o shapes differ
    _fails(qcfg(setup, str(tmp_path / "o"), **{"quantlrm.base": other}),
           r"different architectures[\s\S]*model.layers.0.self_attn.q_proj.weight: fine-tuned shape \(96, 64\) != "
           r"base shape \(64, 64\)")


def test_identical_checkpoints(setup, tmp_path):
    _fails(qcfg(setup, str(tmp_path / "o"), **{"quantlrm.base": setup["ft"]}), "identical")


def test_missing_calibration_file(setup, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    _fails(qcfg(setup, str(tmp_path / "o"), **{"calibration.path": missing, "method": "awq"}), "nope.jsonl")


def test_bad_calibration_field_and_missing_pair(setup, tmp_path):
    _fails(qcfg(setup, str(tmp_path / "o"), **{"calibration.text_field": "body", "method": "awq"}),
           "no field 'body'")
    _fails(qcfg(setup, str(tmp_path / "o"), **{"quantlrm.run_dir": str(tmp_path)}), "final_policy")


def test_existing_output_dir_untouched(setup, tmp_path):
    from lrmq.ptq.pipeline import run_quantize

    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        run_quantize(qcfg(setup, str(out)))
    assert (out / "keep").read_text() == "x"
