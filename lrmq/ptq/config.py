"""``QuantizeConfig``: the typed config (YAML schema) of an offline PTQ run.

    python -m lrmq.quantize --config configs/ptq/awq_w4_qwen3.yaml [dotted.key=value ...]

The flag form of ``lrmq.quantize`` builds the same config from its flags. ``method`` names an entry
of :data:`lrmq.ptq.methods.PTQ_METHODS`; :func:`lrmq.ptq.pipeline.run_quantize` executes a config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from lrmq.configlib import load_config
from lrmq.quant.transforms import DEFAULT_TARGETS


@dataclasses.dataclass
class CalibrationSection:
    source: Literal["text", "reasoning", "prompts"] = "text"
    path: Optional[str] = None  # jsonl/json/parquet/txt (text, reasoning) or a prompt dataset (prompts)
    text_field: str = "text"
    n_samples: int = 128
    block_size: int = 512
    max_doc_tokens: int = 512
    seed: Optional[int] = 42  # AWQ recipe shuffle; None keeps file order
    max_tokens: int = 262144  # reasoning: first 128*2048 tokens
    add_special_tokens: bool = True  # AWQ recipe: HF tokenizer.encode default
    template: str = "chat"  # prompts: lrmq.data.prompts template
    problem_field: str = "problem"
    answer_field: str = "answer"
    max_blocks: Optional[int] = None  # cap after cutting (quick runs)
    batch_size: int = 8  # blocks per forward chunk

    def validate(self):
        for f in ("n_samples", "block_size", "max_doc_tokens", "max_tokens", "batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"calibration.{f} must be >= 1")


@dataclasses.dataclass
class AWQSection:
    n_grid: int = 20
    normalize: bool = True
    scale: bool = True
    clip: bool = True
    max_shrink: float = 0.5
    n_sample_token: int = 512
    gqa_vo: Literal["skip", "downsample"] = "skip"
    propagate: Literal["fp", "quantized"] = "fp"
    oc_batch: int = 1024


@dataclasses.dataclass
class GPTQSection:
    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    propagate: Literal["fp", "quantized"] = "quantized"


@dataclasses.dataclass
class QuantLRMSection:
    base: Optional[str] = None  # pre-fine-tuning checkpoint (model = the fine-tuned one)
    run_dir: Optional[str] = None  # or a GRPO run dir: final_policy (model) + initial_policy (base)
    targets: Optional[list[str]] = None
    stats_targets: Optional[list[str]] = None
    mapping: Literal["u_shape", "inverted_u", "increasing", "decreasing", "constant"] = "u_shape"
    R: float = 10.0
    precision: Literal["fp16", "fp32"] = "fp16"
    zero_chunks: int = 1
    quantize: Literal["finetuned", "base"] = "finetuned"
    plot: bool = True
    # QuantLRM's AWQ differences (defaults = the reference)
    normalize: bool = False
    gqa_vo: Literal["skip", "downsample"] = "downsample"


@dataclasses.dataclass
class OutputsSection:
    dir: str = "ptq_out"
    formats: list[str] = dataclasses.field(default_factory=lambda: ["fake_quant"])
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"  # fake_quant / compressed-tensors scale dtype
    overwrite: bool = False

    def validate(self):
        from lrmq.ptq.exports import FORMATS

        bad = [f for f in self.formats if f not in FORMATS]
        if bad:
            raise ValueError(f"outputs.formats: unknown {bad}; known: {list(FORMATS)}")
        if not self.formats:
            raise ValueError("outputs.formats is empty")


@dataclasses.dataclass
class QuantizeConfig:
    model: Optional[str] = None  # checkpoint dir (HF or lrmq); "tiny" = the shipped tiny model
    method: str = "awq"  # a name in lrmq.ptq.methods.PTQ_METHODS: rtn, int8, nf4, awq, gptq, quantlrm
    bits: int = 4
    group_size: int = 128  # -1: per output channel (nf4: the block size)
    symmetric: bool = False
    targets: str = DEFAULT_TARGETS  # regex over Linear paths (rtn / int8 / nf4; the others do all projections)
    tokenizer: Optional[str] = None  # default: the model dir
    progress: bool = True
    calibration: CalibrationSection = dataclasses.field(default_factory=CalibrationSection)
    awq: AWQSection = dataclasses.field(default_factory=AWQSection)
    gptq: GPTQSection = dataclasses.field(default_factory=GPTQSection)
    quantlrm: QuantLRMSection = dataclasses.field(default_factory=QuantLRMSection)
    outputs: OutputsSection = dataclasses.field(default_factory=OutputsSection)

    def validate(self):
        from lrmq.ptq.methods import check_method_config

        if self.bits not in (3, 4, 8):
            raise ValueError(f"bits must be 3, 4 or 8, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")
        if self.method == "quantlrm" and not (self.quantlrm.run_dir or (self.model and self.quantlrm.base)):
            raise ValueError("method quantlrm needs quantlrm.run_dir, or model (fine-tuned) + quantlrm.base")
        if self.method != "quantlrm" and not self.model:
            raise ValueError("model (checkpoint directory) is required")
        check_method_config(self)
        if "autoawq" in self.outputs.formats and self.bits != 4:
            raise ValueError("outputs.formats autoawq is 4-bit only (AutoAWQ GEMM); use compressed_tensors for W3")


def load_quantize_config(path: str | None, overrides=()) -> QuantizeConfig:
    return load_config(QuantizeConfig, path, list(overrides))
