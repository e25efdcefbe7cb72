"""``QuantizeConfig``: the typed config (YAML schema) of an offline PTQ run.

    python -m lrmq.quantize --config configs/ptq/awq_w4_qwen3.yaml [dotted.key=value ...]

The flag form of ``lrmq.quantize`` builds the same config from its flags. ``method`` names an entry
of :data:`lrmq.ptq.methods.PTQ_METHODS`; :func:`lrmq.ptq.pipeline.run_quantize` executes a config.
Every field is an ``opt`` with its description (``python -m lrmq.quantize --help-config``); the
registry-backed ones (method, templates, mapping, output formats) are checked when the config is read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Optional

from lrmq.configlib import load_config, opt
from lrmq.data.prompts import PROMPT_TEMPLATES
from lrmq.ptq.exports import FORMATS
from lrmq.ptq.importance import MAPPINGS
from lrmq.ptq.methods import PTQ_METHODS, check_method_config
from lrmq.quant.transforms import DEFAULT_TARGETS


@dataclasses.dataclass
class CalibrationSection:
    source: Literal["text", "reasoning", "prompts"] = opt(
        "text", "recipe: text (AWQ: shuffled documents, the first n_samples, cut into blocks), reasoning "
                "(QuantLRM: documents joined in file order, the first max_tokens), prompts (problems of a prompt "
                "dataset rendered with template)")
    path: Optional[str] = opt(None, "calibration file: jsonl/json/parquet/txt documents (text, reasoning) or a "
                                    "prompt dataset (prompts); required by awq, gptq and quantlrm")
    text_field: str = opt("text", "text, reasoning: column of the document text (a .txt file has one document "
                                  "per line)")
    n_samples: int = opt(128, "text, prompts: documents kept before they are cut into blocks", ge=1)
    block_size: int = opt(512, "tokens per calibration block", ge=2)
    max_doc_tokens: int = opt(512, "text, prompts: longer documents are skipped", ge=1)
    seed: Optional[int] = opt(42, "text: shuffle seed of the documents (the AWQ recipe's); null keeps file order")
    max_tokens: int = opt(262144, "reasoning: tokens kept from the start (the QuantLRM recipe: 128 x 2048)", ge=1)
    add_special_tokens: bool = opt(True, "text: encode with the tokenizer's special tokens (AWQ recipe: HF "
                                         "tokenizer.encode default)")
    template: str = opt("chat", "prompts: prompt template of each problem (chat = the model's chat template)",
                        names=PROMPT_TEMPLATES)
    problem_field: str = opt("problem", "prompts: dataset column of the problem")
    answer_field: str = opt("answer", "prompts: dataset column of the answer (the dataset loader requires an "
                                      "answer or a solution column)")
    max_blocks: Optional[int] = opt(None, "keep at most this many blocks after cutting (null = all; quick runs)", ge=1)
    batch_size: int = opt(8, "calibration blocks per forward chunk", ge=1)
    moe_experts: Literal["all", "routed"] = opt(
        "all", "mixture-of-experts models (gptq, awq, quantlrm): the tokens each expert's statistics sum over: every calibration "
               "token through every expert (all: llmcompressor's moe_calibrate_all_experts; the layer's output "
               "still uses only the routed experts) or only the tokens routed to it (routed)")

    def validate(self):
        for f in ("n_samples", "block_size", "max_doc_tokens", "max_tokens", "batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"calibration.{f} must be >= 1")


@dataclasses.dataclass
class AWQSection:
    n_grid: int = opt(20, "grid size of the scale search (alpha = i / n_grid) and of the clip search", ge=1)
    normalize: bool = opt(True, "divide the scales by sqrt(max(s) * min(s)) (AWQ)")
    scale: bool = opt(True, "search per-channel scales (false: clip + quantize only)")
    clip: bool = opt(True, "search a clipping range per group and output column (not for q/k)")
    max_shrink: float = opt(0.5, "clip search: shrink the weight range by at most this fraction", ge=0, lt=1)
    n_sample_token: int = opt(512, "clip search: calibration tokens sampled (evenly strided)", ge=1)
    gqa_vo: Literal["skip", "downsample"] = opt("skip", "v_proj -> o_proj scaling when their shapes differ "
                                                        "(GQA): skip (llm-awq) or downsample (QuantLRM)")
    propagate: Literal["fp", "quantized"] = opt("fp", "next layer's input: the float layer's output (fp, "
                                                      "llm-awq) or the quantized layer's")
    oc_batch: int = opt(1024, "clip search: output columns per chunk (bounds memory)", ge=1)


@dataclasses.dataclass
class GPTQSection:
    block_size: int = opt(128, "input rows per lazy-update block", ge=1)
    percdamp: float = opt(0.01, "Hessian damping: percdamp x mean(diag H) added to the diagonal", ge=0, lt=1e6)
    act_order: bool = opt(False, "quantize input rows in order of decreasing Hessian diagonal")
    static_groups: bool = opt(False, "with act_order: group parameters from the unpermuted weights "
                                     "(consecutive groups, as fast GPTQ kernels need)")
    true_sequential: bool = opt(True, "quantize each layer in four stages (k,v,q / o / up,gate / down), each "
                                      "on the outputs of the stages before; false: one float forward")
    propagate: Literal["fp", "quantized"] = opt("quantized", "next layer's input: the quantized layer's output "
                                                             "(the reference) or the float layer's (fp)")


@dataclasses.dataclass
class QuantLRMSection:
    base: Optional[str] = opt(None, "pre-fine-tuning checkpoint (model = the fine-tuned one)")
    run_dir: Optional[str] = opt(None, "or a GRPO run dir: final_policy (fine-tuned) + initial_policy (base)")
    targets: Optional[list[str]] = opt(None, "projections that get fine-tuning importance (null: q/o/gate/down "
                                             "proj; Olmo-3: o/down)")
    stats_targets: Optional[list[str]] = opt(None, "projections whose |dW| give the global stats (null: all "
                                                   "seven; Olmo-3: = targets)")
    mapping: str = opt("u_shape", "importance mapping q(|dW|) (u_shape = the paper)",
                       names=MAPPINGS)
    R: float = opt(10.0, "top weight of the mapping (u_shape: R at the extremes of |dW|, 1 at the median)",
                   gt=0, lt=float("inf"))
    precision: Literal["fp16", "fp32"] = opt("fp16", "fp16 replicates the reference's float16 rounding of the "
                                                     "importance; fp32 keeps float32")
    zero_chunks: int = opt(1, "output-dim chunks of the zero-count term (the reference's 32B/70B variant: 5)", ge=1)
    quantize: Literal["finetuned", "base"] = opt("finetuned", "the checkpoint that is quantized, with the "
                                                              "importance of the pair")
    plot: bool = opt(True, "also write importance.png (|dW| histogram with the mapping, channel importances)")
    normalize: bool = opt(False, "AWQ scale normalisation (QuantLRM reference: off); replaces awq.normalize")
    gqa_vo: Literal["skip", "downsample"] = opt("downsample", "v_proj -> o_proj scaling for GQA (QuantLRM: "
                                                              "downsample); replaces awq.gqa_vo")


@dataclasses.dataclass
class OutputsSection:
    dir: str = opt("ptq_out", "output directory, written atomically: report.json, quantize_config.yaml and a "
                              "subdirectory per format")
    formats: list[str] = opt(help="export formats: packed (lrmq checkpoint), fake_quant (HF, dequantized), "
                                  "autoawq (4-bit), compressed_tensors", factory=lambda: ["fake_quant"],
                             names=FORMATS, kind="output format")
    dtype: Literal["float16", "bfloat16", "float32"] = opt(
        "float16", "dtype of the fake_quant weights and of compressed_tensors' scales and float tensors "
                   "(float32 -> bfloat16 there)")
    overwrite: bool = opt(False, "replace an existing outputs.dir")
    max_shard_bytes: int = opt(5 * 10**9, "the largest safetensors shard of each format (every format, every "
                                          "method); more shards get an index (transformers' 5 GB)", ge=1)

    def validate(self):
        if not self.formats:
            raise ValueError("outputs.formats is empty")


@dataclasses.dataclass
class MeshSection:
    devices: Optional[int] = opt(None, "local devices (chips) the calibration passes are spread over, one unit of "
                                       "calibration.batch_size blocks per chip per step (null: all of this host's); "
                                       "the result is the same bytes for any count", ge=1)


@dataclasses.dataclass
class QuantizeConfig:
    model: Optional[str] = opt(None, 'checkpoint to quantize (HF or lrmq directory; "tiny" = the shipped tiny '
                                     "model); quantlrm: the fine-tuned one")
    method: str = opt("awq", "PTQ method", names=PTQ_METHODS)
    bits: int = opt(4, "weight bits, 2..8 (method int8: 8; nf4: 4; outputs autoawq: 4; the others take any width)",
                    ge=2, le=8)
    group_size: int = opt(128, "input rows per quantization group (-1 = per output channel; 0 = per tensor, rtn and "
                               "int8 only; nf4: the block size)", ge=1, also=(-1, 0))
    symmetric: bool = opt(False, "symmetric quantization (no zero point)")
    targets: str = opt(DEFAULT_TARGETS, "regex over Linear paths (rtn, int8, nf4; the others quantize all seven "
                                        "projections)")
    tokenizer: Optional[str] = opt(None, "tokenizer directory (null: the model's)")
    progress: bool = opt(True, "show progress bars")
    float_qat_policy: bool = opt(False, "quantize a QAT run's float master weights (RUN/final_policy); refused "
                                        "otherwise, naming the run's quantized export (lrmq.ptq.qat_export)")
    calibration: CalibrationSection = opt(help="calibration data (awq, gptq, quantlrm)", factory=CalibrationSection)
    awq: AWQSection = opt(help="AWQ scale and clip search (awq, quantlrm)", factory=AWQSection)
    gptq: GPTQSection = opt(help="GPTQ", factory=GPTQSection)
    quantlrm: QuantLRMSection = opt(help="QuantLRM: the fine-tuning pair and its importance", factory=QuantLRMSection)
    outputs: OutputsSection = opt(help="what is written", factory=OutputsSection)
    mesh: MeshSection = opt(help="the PTQ mesh: awq, gptq and quantlrm run over the host's chips", factory=MeshSection)

    def validate(self):
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ValueError(f"targets {self.targets!r} is not a regular expression ({e})") from None
        if self.bits not in range(2, 9):  # what the quantizers, lrmq's packing and compressed_tensors support
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size < -1:
            raise ValueError(f"group_size must be -1, 0 or positive, got {self.group_size}")
        if self.method == "quantlrm" and not (self.quantlrm.run_dir or (self.model and self.quantlrm.base)):
            raise ValueError("method quantlrm needs quantlrm.run_dir, or model (fine-tuned) + quantlrm.base")
        if self.method != "quantlrm" and not self.model:
            raise ValueError("model (checkpoint directory) is required")
        check_method_config(self)
        if "autoawq" in self.outputs.formats and self.bits != 4:
            raise ValueError("outputs.formats autoawq is 4-bit only (AutoAWQ GEMM); use compressed_tensors for W3")


def load_quantize_config(path: str | None, overrides=()) -> QuantizeConfig:
    return load_config(QuantizeConfig, path, list(overrides))
