"""An llmcompressor-written W4A16 checkpoint of the shipped tiny model and llmcompressor's own dequantized
logits: the fixture tests/test_quantized_checkpoints.py reads back with lrmq (no llmcompressor needed there).
Runs in a side venv with llmcompressor (never an lrmq dependency), e.g.

    python3.11 -m venv /tmp/llmcvenv
    /tmp/llmcvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/llmcvenv/bin/pip install llmcompressor==0.14.0.1
    /tmp/llmcvenv/bin/python tools/llmcompressor_w4a16_fixture.py --out tests/fixtures/llmc_w4a16

What it does: lrmq/assets/tiny in bfloat16 -> ``oneshot`` with llmcompressor's data-free
``QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])`` (symmetric int4, group 128, its
memoryless min-max observer) -> ``save_pretrained(OUT, save_compressed=True)`` (pack-quantized). Reference:
llmcompressor's own dequantized model -- OUT loaded back by transformers' compressed-tensors integration with
``CompressedTensorsConfig(dequantize=True)`` in float32 -- and its float32 logits of TOKENS
(``reference_logits.npy``); reference.json holds the tokens, the library versions, the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "lrmq", "assets", "tiny")
TOKENS = (np.arange(24)[None] * 7 % 320).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import compressed_tensors
    import llmcompressor
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    torch.manual_seed(0)
    toks = torch.tensor(TOKENS, dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])])
    model.save_pretrained(args.out, save_compressed=True)
    for name in ("generation_config.json",):  # the tokenizer is not needed: the test feeds token ids
        p = os.path.join(args.out, name)
        if os.path.exists(p):
            os.remove(p)
    reloaded_model = AutoModelForCausalLM.from_pretrained(
        args.out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.inference_mode():
        reloaded = reloaded_model(input_ids=toks).logits.float().numpy()
    ref = {
        "what": "llmcompressor W4A16 (scheme='W4A16', ignore=['lm_head'], data-free oneshot) of lrmq/assets/tiny "
                "in bfloat16; logits of `tokens` in float32",
        "tokens": TOKENS,
        "logits": "reference_logits.npy",
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "script": "tools/llmcompressor_w4a16_fixture.py",
    }
    np.save(os.path.join(args.out, "reference_logits.npy"), reloaded.astype(np.float32))
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(f"wrote {args.out}: logits {reloaded.shape}, max |logit| {np.abs(reloaded).max():.3g}")


if __name__ == "__main__":
    main()
