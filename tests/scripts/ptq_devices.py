"""PTQ on 1, 4 and 8 forced CPU devices of one process: the same codes, scales, zeros, weights and exported bytes.

Run by tests/test_ptq_shard.py through conftest.run_with_devices (8 devices). Prints one JSON line.
"""

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

from lrmq.checkpoint.load import load_model
from lrmq.ptq.awq import AWQOptions, awq_quantize_model
from lrmq.ptq.exports import write_outputs
from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
from lrmq.ptq.layer_fn import get_layer_params
from lrmq.ptq.shard import ptq_mesh


def digest(model, result, out: str) -> dict:
    """Hashes of every packed array, every layer weight and every exported file."""
    h = {}
    for path, qw in sorted(result.packed.items()):
        for f in ("codes", "scales", "zeros"):
            h[f"{path}.{f}"] = hashlib.sha256(np.asarray(getattr(qw, f)).tobytes()).hexdigest()
    for i, layer in enumerate(model.layers):
        for k, v in sorted(get_layer_params(layer).items()):
            h[f"layers.{i}.{k}"] = hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
    write_outputs(model, result, out, formats=("compressed_tensors",))
    for root, _, files in os.walk(out):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h[os.path.relpath(os.path.join(root, name), out)] = hashlib.sha256(f.read()).hexdigest()
    return h


def main(tmp: str) -> None:
    # 6 blocks in units of 2: 3 units, so 4 and 8 devices both run one step with padded slots
    tokens = np.random.default_rng(0).integers(0, 256, (6, 32))
    runs = {"awq": lambda m, mesh: awq_quantize_model(m, tokens, AWQOptions(bits=3, group_size=32, batch_size=2,
                                                                            oc_batch=48), mesh=mesh, progress=False),
            "gptq": lambda m, mesh: gptq_quantize_model(m, tokens, GPTQOptions(bits=3, group_size=32, batch_size=2),
                                                        mesh=mesh, progress=False)}
    report = {}
    for name, run in runs.items():
        digests = {}
        for n in (1, 4, 8):
            model = load_model("tiny")
            result = run(model, ptq_mesh(n))
            digests[n] = digest(model, result, os.path.join(tmp, f"{name}{n}"))
        report[name] = {"items": len(digests[1]),
                        "differ": {n: sorted(k for k in digests[1] if digests[n].get(k) != digests[1][k])[:5]
                                   for n in (4, 8)}}
    print(json.dumps(report))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        main(sys.argv[1] if len(sys.argv) > 1 else d)
