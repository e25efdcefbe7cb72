"""Runs in a side virtualenv with gptqmodel (transformers' AWQ path): loads an AutoAWQ GEMM export the way a
user would (`AutoModelForCausalLM.from_pretrained`, CPU), writes what the consumer computed to an .npz:

* ``w:<module>``: each AWQ Linear's weight as gptqmodel dequantizes it (``awq_weight_dequantize``:
  its ``unpack_awq`` + ``reverse_awq_order`` + ``(code - zero) * scale``), float16 [K, N], read before the
  first forward (gptqmodel's CPU kernel repacks the weights then);
* ``logits_dequant``: logits of TOKENS with every AWQ Linear on gptqmodel's dequantize-then-matmul path,
  model loaded in float32;
* ``logits_kernel``: logits of the same model on gptqmodel's default CPU kernel (``TorchAtenAwqLinear``:
  bf16 activations, aten int4pack matmul);
* ``kernel``: the AWQ Linear class transformers/gptqmodel selected.

    python awq_gptqmodel_worker.py EXPORT_DIR TOKENS.npy OUT.npz
"""

import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(export, tokens, out):
    toks = torch.from_numpy(np.load(tokens).astype(np.int64))
    res = {}
    for mode in ("dequant", "kernel"):
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, device_map="cpu").eval()
        for name, mod in model.named_modules():
            if hasattr(mod, "qweight"):
                if mode == "dequant":
                    res["w:" + name] = mod.awq_weight_dequantize("cpu", torch.float16).numpy()
                    mod.linear_mode = "train"  # gptqmodel's non-fused path: dequantize, then x @ W
                res["kernel"] = np.array(type(mod).__name__)
        with torch.inference_mode():
            res["logits_" + mode] = model(input_ids=toks).logits.float().numpy()
    np.savez(out, **res)


if __name__ == "__main__":
    main(*sys.argv[1:4])
