"""One rule for a QAT run's float policy (lrmq.ptq.qat_export.refuse_float_qat_policy): lrmq.evaluate, generate,
perplexity and quantize refuse RUN/final_policy of a QAT run in one line naming RUN/final_policy_quantized/packed
(quantize also names the scheme's own format and the lrmq.quantize command that writes it), before any model is
read; --float-qat-policy asks for the float weights by name. Runs the commands' main() in-process on a fake run
dir: nothing in it but config.yaml is read before the refusal."""

from __future__ import annotations

import os

import pytest

from lrmq.ptq.qat_export import FloatQATPolicyError, refuse_float_qat_policy

REFUSED = "float master weights of a QAT run"


def fake_run(tmp_path, scheme="int4", group_size=0, mode="qat"):
    run = tmp_path / "run"
    (run / "final_policy").mkdir(parents=True)  # empty: a command that gets past the rule fails to read it
    (run / "final_policy_quantized" / "packed").mkdir(parents=True)
    (run / "config.yaml").write_text(f"quant:\n  mode: {mode}\n  qat_scheme: {scheme}\n  qat_group_size: {group_size}\n")
    return run


def test_every_command_refuses_a_qat_runs_float_policy(cli, tmp_path):
    run = fake_run(tmp_path)
    fp, packed = str(run / "final_policy"), os.path.join(str(run), "final_policy_quantized", "packed")
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight\n")
    commands = {
        "evaluate": ["--checkpoint", fp, "--suite", "math500", "--limit", "1", "--out", str(tmp_path / "ev"),
                     "--data-dir", str(tmp_path / "no_data")],
        "generate": ["--checkpoint", fp, "--prompt", "1+1="],
        "perplexity": ["--checkpoint", fp, "--text-file", str(text)],
        "quantize": ["--checkpoint", fp, "--method", "rtn", "--out", str(tmp_path / "q")],
    }
    for name, argv in commands.items():
        r = cli(name, *argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (name, r.stderr)
        assert REFUSED in lines[0] and packed in lines[0] and "--float-qat-policy" in lines[0], (name, lines[0])
        if name != "quantize":
            assert f"the model it trained: --checkpoint {packed}" in lines[0], lines[0]
        else:  # the quantized policy, the scheme's own format, and the command that writes it
            assert f"the model it trained is already quantized: {packed}" in lines[0], lines[0]
            assert "int4 sym per-channel f32-scale (qat:int4)" in lines[0], lines[0]
            assert (f"python -m lrmq.quantize --checkpoint {fp} --method rtn --bits 4 --group-size -1 --symmetric "
                    f"--out OUT --float-qat-policy") in lines[0], lines[0]
        if name == "evaluate":  # past the rule it would read the benchmarks first: the rule alone
            from lrmq import evaluate
            evaluate.check_qat_policy(evaluate.build_config(evaluate.parse_args([*argv, "--float-qat-policy"])))
            continue
        # asked for by name: past the rule, to the (here empty) checkpoint's own error
        r = cli(name, *argv, "--float-qat-policy")
        assert r.returncode == 2 and REFUSED not in r.stderr and "final_policy" in r.stderr, (name, r.stderr)
    assert not (tmp_path / "ev").exists() and not (tmp_path / "q").exists()


def test_the_rule_reads_only_a_qat_runs_final_policy(tmp_path):
    run = fake_run(tmp_path, scheme="w8a8")
    with pytest.raises(FloatQATPolicyError, match="w8a8 quantizes activations at run time"):
        refuse_float_qat_policy(str(run / "final_policy"), action="generate with")
    refuse_float_qat_policy(str(run / "final_policy"), allowed=True)
    refuse_float_qat_policy(str(run / "final_policy_quantized" / "packed"))  # the quantized export itself
    other = fake_run(tmp_path / "b", mode="lora")  # a run trained without QAT: its final_policy is the model
    refuse_float_qat_policy(str(other / "final_policy"), action="quantize")
    refuse_float_qat_policy(None)


def test_the_train_done_line_names_the_quantized_policy(tmp_path):
    import dataclasses

    from lrmq.rl.config import TrainConfig
    from lrmq.train import quantized_policy_note

    run = fake_run(tmp_path)
    cfg = TrainConfig()
    assert quantized_policy_note(cfg, str(run)) == ""  # not a QAT run: final_policy is the model
    qat = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, mode="qat", qat_scheme="int4"))
    packed = os.path.join(str(run), "final_policy_quantized", "packed")
    assert quantized_policy_note(qat, str(run)) == f"; quantized policy (the model it trained) {packed}"
    w8a8 = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, mode="qat", qat_scheme="w8a8"))
    assert "no quantized policy written (quant.qat_scheme=w8a8)" in quantized_policy_note(w8a8, str(tmp_path))


def test_the_config_form_applies_the_rule(tmp_path):
    """`lrmq.quantize --config` (run_quantize) refuses a QAT run's float policy as the flag form does, naming its key;
    float_qat_policy=true gets past the rule (to the empty checkpoint's own error)."""
    from lrmq.ptq.config import load_quantize_config
    from lrmq.ptq.pipeline import run_quantize

    run = fake_run(tmp_path)
    base = [f"model={run / 'final_policy'}", "method=rtn", f"outputs.dir={tmp_path / 'q'}"]
    with pytest.raises(FloatQATPolicyError, match="float_qat_policy=true") as e:
        run_quantize(load_quantize_config(None, base))
    assert "final_policy_quantized" in str(e.value)
    with pytest.raises(Exception) as e:
        run_quantize(load_quantize_config(None, [*base, "float_qat_policy=true"]))
    assert not isinstance(e.value, FloatQATPolicyError) and "final_policy" in str(e.value)
    assert not (tmp_path / "q").exists()
