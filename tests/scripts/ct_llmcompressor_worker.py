"""compressed-tensors checkpoints of lrmq's quantized values written by the reference writers, and loaded by
transformers. Runs in lrmq's venv (``ct-write``, ``load``, :func:`compare_dirs`, :func:`lrmq_values`) or in a
side virtualenv with llmcompressor (``write``, ``load``; llmcompressor is never an lrmq dependency:
llmcompressor 0.14.0.1 pins compressed-tensors 0.19.0 and transformers <= 5.17). Commands:

``write MODEL_DIR VALUES.npz OUT_DIR``: llmcompressor's own output for given quantized values. ``oneshot``
applies a data-free ``QuantizationModifier`` (the scheme in VALUES.npz: ``bits``, ``symmetric``,
``group_size`` (-1: channel), ``dtype``) to MODEL_DIR, then every quantized Linear's ``weight``,
``weight_scale`` and ``weight_zero_point`` are overwritten with the values lrmq computed (``w:<module>`` the
dequantized weight ``[N, K]``, ``s:<module>`` the scales ``[N, K/g]``, ``z:<module>`` the signed zero points
``z - 2^(b-1)`` int8 ``[N, K/g]``), and ``model.save_pretrained(OUT_DIR, save_compressed=True)`` writes the
checkpoint (llmcompressor's wrapper: compressed-tensors' ``ModelCompressor`` packs weights and zero points
with its ``PackedQuantizationCompressor``, then ``update_config`` writes ``quantization_config``).

``ct-write MODEL_DIR VALUES.npz OUT_DIR``: the same without llmcompressor, with compressed-tensors alone
(``apply_quantization_config``, the values, ``ModelCompressor.compress_model``, ``save_pretrained``,
``update_config``: the steps of llmcompressor's save wrapper).

``gptq MODEL_DIR TOKENS.npy OUT_DIR GROUP_SIZE [IGNORE,...]``: llmcompressor's own GPTQ of MODEL_DIR (``oneshot`` with
``GPTQModifier(scheme="W4A16", targets=["Linear"], ignore=IGNORE)``, its defaults otherwise: actorder static,
block 128, dampening 0.01, the sequential pipeline, ``moe_calibrate_all_experts=True``; ``scheme`` spelled out
when GROUP_SIZE is not 128) on the calibration blocks TOKENS.npy (int [n, T], in order), saved compressed. Default
IGNORE: ``lm_head`` and ``re:.*mlp.gate$`` (llmcompressor's Qwen3-MoE example). Also writes
``OUT_DIR/values.npz``: every quantized Linear's dequantized weight, scale and zero point before compression, and
``OUT_DIR/hessians.npz``: the normalized Hessian GPTQ used for each Linear of the first decoder layer (recorded
as ``GPTQModifier.compress_module_list`` is entered; read only, the run is unchanged).

``hessians MODEL_DIR TOKENS.npy OUT.npz``: the first decoder layer's GPTQ Hessians (``2 x sum x x^T / blocks``)
of a Qwen3-MoE computed from transformers' own forward of each block, as llmcompressor's all-experts calibration
defines them (every expert's gate/up on every token's ``post_attention_layernorm`` output, its down_proj on
``silu(gate) * up`` of every token), twice: with the model's causal attention (``causal:<module>``) and with no
attention mask at all (``nomask:<module>``, ``create_causal_mask`` returning None).

``load TOKENS.npy OUT.json DIR...``: loads each DIR with this venv's transformers, both ways
(``CompressedTensorsConfig(dequantize=True)`` and ``dequantize=False``), and records per directory and
mode either the logits of TOKENS (``OUT.json`` + ``OUT.json.<i>.<mode>.npy``) or the error.
"""

import json
import os
import sys

import numpy as np
import torch


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def compare_dirs(a, b):
    """Tensor by tensor (names, shapes, dtypes, raw bytes) and ``quantization_config`` key by key (nested keys
    dotted) of checkpoint dirs ``a`` and ``b``."""
    from safetensors.numpy import load_file

    ta, tb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    bad = []
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append(f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif x.tobytes() != y.tobytes():
            bad.append(f"{k}: values differ")
    qa, qb = (_flat(json.load(open(os.path.join(d, "config.json")))["quantization_config"]) for d in (a, b))
    return {"n_tensors": len(set(ta) | set(tb)), "only_in_a": sorted(set(ta) - set(tb)),
            "only_in_b": sorted(set(tb) - set(ta)), "mismatched": bad,
            "tensors_identical": not bad and set(ta) == set(tb),
            "shapes": {k: [str(v.dtype), list(v.shape)] for k, v in ta.items() if ".layers.0.self_attn.q_proj." in k},
            "config_only_in_a": {k: qa[k] for k in sorted(set(qa) - set(qb))},
            "config_only_in_b": {k: qb[k] for k in sorted(set(qb) - set(qa))},
            "config_differ": {k: [qa[k], qb[k]] for k in sorted(set(qa) & set(qb)) if qa[k] != qb[k]}}


def lrmq_values(model, result, dtype="float32"):
    """(lrmq venv) VALUES.npz contents for ``write`` / ``ct-write`` from an lrmq model after PTQ and its
    ``PTQResult``: per HF module ``w:`` the dequantized weight [N, K] (``dtype``), ``s:`` scales [N, K/g]
    float32, ``z:`` signed zero points int8 [N, K/g] (0 when symmetric); and the scheme."""
    from lrmq.ptq import export_formats as ef
    from lrmq.ptq.exports import _hf_prefixes, _unpacked

    pre = _hf_prefixes(model)
    qw0 = next(iter(result.packed.values()))
    channel = all(np.shape(qw.scales)[0] == 1 for qw in result.packed.values())
    vals = {"bits": qw0.bits, "symmetric": bool(qw0.symmetric), "group_size": -1 if channel else qw0.group_size,
            "dtype": dtype}
    for path, qw in result.packed.items():
        codes, scales, zeros = _unpacked(qw)
        vals["w:" + pre[path]] = np.ascontiguousarray(ef.dequantize(codes, scales, zeros, dtype=dtype).T)
        vals["s:" + pre[path]] = np.ascontiguousarray(scales.T.astype(np.float32))
        vals["z:" + pre[path]] = np.ascontiguousarray((zeros.astype(np.int16) - (1 << (qw.bits - 1))).astype(np.int8).T)
    return vals


def _scheme(v):
    bits, sym, group = int(v["bits"]), bool(v["symmetric"]), int(v["group_size"])
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group"}
    if group != -1:
        weights["group_size"] = group
    return weights


def _inject(model, v):
    """Overwrite every quantized Linear's weight, weight_scale, weight_zero_point with VALUES."""
    names = sorted(k[2:] for k in v.files if k.startswith("w:"))
    done = []
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not hasattr(mod, "weight_scale"):
                continue
            assert name in names, f"the reference writer quantized {name}, lrmq did not"
            mod.weight.copy_(torch.from_numpy(v["w:" + name]))
            mod.weight_scale.copy_(torch.from_numpy(v["s:" + name]).reshape(mod.weight_scale.shape))
            mod.weight_zero_point.copy_(torch.from_numpy(v["z:" + name]).reshape(mod.weight_zero_point.shape))
            done.append(name)
    assert sorted(done) == names, (done, names)


def _versions(out, **extra):
    import compressed_tensors
    import transformers

    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({**extra, "compressed_tensors": compressed_tensors.__version__,
                   "transformers": transformers.__version__, "torch": torch.__version__}, f)


def write(model_dir, values, out):
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    v = np.load(values)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, str(v["dtype"])))
    oneshot(model=model, recipe=[QuantizationModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": _scheme(v)}}, ignore=["lm_head"])])
    _inject(model, v)
    model.save_pretrained(out, save_compressed=True)
    _versions(out, llmcompressor=llmcompressor.__version__)


def ct_write(model_dir, values, out):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config)
    from transformers import AutoModelForCausalLM

    v = np.load(values)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, str(v["dtype"])))
    qc = QuantizationConfig.model_validate({"config_groups": {"group_0": {"targets": ["Linear"], "weights": _scheme(v)}},
                                            "ignore": ["lm_head"]})
    apply_quantization_config(model, qc)
    _inject(model, v)
    for mod in model.modules():
        if hasattr(mod, "quantization_scheme"):
            mod.quantization_status = QuantizationStatus.FROZEN
    mc = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    mc.compress_model(model)
    model.save_pretrained(out)
    mc.update_config(out)
    _versions(out)


def gptq(model_dir, tokens, out, group_size, ignore="lm_head,re:.*mlp.gate$"):
    import shutil

    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    hessians = {}
    compress = GPTQModifier.compress_module_list

    def recording(self, module_list):  # the first layer's Hessians (2 x sum x x^T / samples), as GPTQ reads them
        for m in module_list:
            name = self._module_names[m]
            if name.startswith("model.layers.0."):
                hessians[name] = (self._hessians[m] / self._num_samples[m]).float().numpy()
        return compress(self, module_list)

    GPTQModifier.compress_module_list = recording
    toks = np.load(tokens)
    ds = Dataset.from_dict({"input_ids": toks.tolist(), "attention_mask": np.ones_like(toks).tolist()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    group, ignore = int(group_size), ignore.split(",")
    kw = dict(scheme="W4A16") if group == 128 else dict(config_groups={"group_0": {
        "targets": ["Linear"], "weights": _scheme({"bits": 4, "symmetric": True, "group_size": group})}})
    oneshot(model=model, dataset=ds, recipe=[GPTQModifier(targets=["Linear"], ignore=ignore, **kw)],
            num_calibration_samples=len(toks), max_seq_length=toks.shape[1], shuffle_calibration_samples=False,
            pipeline="sequential")
    vals = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_scale"):
            vals["w:" + name] = mod.weight.detach().float().numpy()
            vals["s:" + name] = mod.weight_scale.detach().float().numpy()
            vals["z:" + name] = mod.weight_zero_point.detach().numpy().astype(np.int8)
    model.save_pretrained(out, save_compressed=True)
    np.savez(os.path.join(out, "values.npz"), **vals)
    np.savez(os.path.join(out, "hessians.npz"), **hessians)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), out)
    _versions(out, llmcompressor=llmcompressor.__version__)


def hessians(model_dir, tokens, out):
    import transformers.models.qwen3_moe.modeling_qwen3_moe as mq
    from transformers import AutoModelForCausalLM

    toks = np.load(tokens)
    res = {}
    for mode in ("causal", "nomask"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
        layer, seen = model.model.layers[0], {}

        def hook(name):
            def f(mod, args, output):
                x = (output if name == "mlp_in" else args[0]).reshape(-1, args[0].shape[-1]).double()
                seen.setdefault(name, []).append(x)
            return f

        layer.self_attn.q_proj.register_forward_hook(hook("attn_in"))
        layer.self_attn.o_proj.register_forward_hook(hook("o_in"))
        layer.post_attention_layernorm.register_forward_hook(hook("mlp_in"))
        orig = mq.create_causal_mask
        if mode == "nomask":
            mq.create_causal_mask = lambda *a, **k: None
        try:
            with torch.no_grad():
                for b in toks:
                    model(input_ids=torch.from_numpy(b[None]))
        finally:
            mq.create_causal_mask = orig
        x = {k: torch.cat(v) for k, v in seen.items()}
        h = lambda a: (2 * a.T @ a / len(toks)).float().numpy()  # noqa: E731
        pre = "model.layers.0."
        for name in ("q_proj", "k_proj", "v_proj"):
            res[f"{mode}:{pre}self_attn.{name}"] = h(x["attn_in"])
        res[f"{mode}:{pre}self_attn.o_proj"] = h(x["o_in"])
        experts = layer.mlp.experts
        inter = experts.down_proj.shape[-1]
        for e in range(experts.num_experts):
            gu = experts.gate_up_proj[e].detach().double()  # [2F, D]: gate rows then up rows
            hid = torch.nn.functional.silu(x["mlp_in"] @ gu[:inter].T) * (x["mlp_in"] @ gu[inter:].T)
            for name in ("gate_proj", "up_proj"):
                res[f"{mode}:{pre}mlp.experts.{e}.{name}"] = h(x["mlp_in"])
            res[f"{mode}:{pre}mlp.experts.{e}.down_proj"] = h(hid)
    np.savez(out, **res)


def load(tokens, out, *dirs):
    import compressed_tensors
    import transformers
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    toks = torch.from_numpy(np.load(tokens).astype(np.int64))
    res = {"versions": {"compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__}, "loads": {}}
    for i, d in enumerate(dirs):
        for dequantize in (True, False):
            mode = "dequantize" if dequantize else "compressed"
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    d, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=dequantize)).eval()
                with torch.inference_mode():
                    logits = model(input_ids=toks).logits.float().numpy()
                np.save(f"{out}.{i}.{mode}.npy", logits)
                res["loads"].setdefault(d, {})[mode] = {"ok": True, "logits": f"{out}.{i}.{mode}.npy"}
            except Exception as e:  # noqa: BLE001 -- the error is the result
                res["loads"].setdefault(d, {})[mode] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    {"write": write, "ct-write": ct_write, "gptq": gptq, "hessians": hessians, "load": load}[sys.argv[1]](*sys.argv[2:])
