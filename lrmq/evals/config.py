"""`EvalConfig`: the typed config of `python -m lrmq.evaluate` (YAML `--config configs/eval/NAME.yaml` plus
dotted `key=value` overrides). A suite's protocol (`lrmq.evals.benchmarks.SUITES`) gives the generation
defaults; the YAML and the overrides go on top."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lrmq.configlib import ConfigError, apply_overrides, config_from_dict, opt
from lrmq.evals.benchmarks import EVAL_PROMPTS, resolve_suite
from lrmq.generation.engine import EngineConfig
from lrmq.generation.attention import DECODE_ATTENTION
from lrmq.generation.kv_format import KV_CACHE_FORMATS
from lrmq.generation.scheduler import check_kv_pages


@dataclass
class GenerationSection:
    max_new_tokens: int = opt(512, "new tokens per completion (capped by the model's positions, see length_policy)")
    temperature: float = opt(1.0, "sampling temperature (ignored when greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = opt(0, "top-k sampling (0 = off)")
    greedy: bool = opt(False, "argmax decoding (paper 1's STE-model protocol)")
    samples: int = opt(1, "K completions per problem: pass@1 is their mean, pass@k unbiased")
    batch_size: int = opt(32, "decode slots of the generation engine: sequences decoded at once, the next waiting "
                              "one taking a slot as soon as a sequence stops")
    page_size: int = opt(16, "tokens per page of the engine's paged KV cache")
    kv_pages: int = opt(0, "pages of the engine's KV pool (0 = what fits: generation.kv_memory_fraction of the "
                           "device's memory less the weights, at most the worst case (every slot at full length: "
                           "nothing preempted); the worst case where the device's memory is unknown (CPU). Fewer "
                           "pages hold less memory and recompute a preempted sequence later)")
    kv_memory_fraction: float = opt(0.9, "generation.kv_pages=0 on an accelerator (or a --compile-only TPU "
                                         "topology): the share of each device's memory the weights and the KV "
                                         "pool may take together, as vLLM's gpu_memory_utilization", gt=0, le=1)
    kv_cache: str = opt("auto", "format of the engine's KV cache pages: auto (the model's dtype), bf16, or "
                                "quantized with float32 scales: fp8_e4m3 / fp8_e5m2 (per layer and KV head, "
                                "calibrated on each call's first prefill) or int8 (per token and KV head); "
                                "docs/generation.md, 'Quantized KV cache'",
                        names=KV_CACHE_FORMATS, kind="KV cache format")
    decode_attention: str = opt("auto", "decode attention of the engine: auto (the compile target's kernel: JAX's "
                                        "ragged paged attention on TPU, Triton on GPU, where it takes the shapes; "
                                        "else xla), or xla / tpu / gpu given explicitly. xla runs fp8 KV pages at "
                                        "1 KV head per TPU chip, which auto refuses (docs/generation.md, "
                                        "'Quantized KV cache'; docs/tpu.md)",
                                names=("auto", *DECODE_ATTENTION), kind="decode attention")
    seed: int = opt(0, "sampling seed; sequence i (item x sample, in order) uses fold_in(key(seed), i), so "
                       "reruns and resumes repeat")
    max_positions: int = opt(0, "prompt + completion limit (0 = the model's max_position_embeddings)")
    length_policy: str = opt("cap", "when prompt + max_new_tokens passes max_positions: cap the new tokens "
                                    "(warning) or error", names=("cap", "error"), kind="length policy")

    def validate(self):
        if self.samples < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("samples, batch_size and max_new_tokens must be >= 1")
        if self.page_size < 1 or self.kv_pages < 0 or self.max_positions < 0:
            raise ValueError("page_size must be >= 1, kv_pages and max_positions >= 0")
        # the prompts are not tokenized yet: the pool must at least hold a one-token prompt and the completion
        # (the engine checks the longest prompt again before its first call)
        new = min(self.max_new_tokens, self.max_positions - 1) if self.max_positions > 1 else self.max_new_tokens
        check_kv_pages(self.kv_pages, "generation.kv_pages", prompt_tokens=1, max_new=new,
                       page_size=self.page_size, sync_steps=EngineConfig.sync_steps,
                       prompt_note=" (the shortest prompt)")

    def engine_config(self, pool_bytes: int = 0) -> EngineConfig:
        """The engine of these settings, whole: `pool_bytes` is the KV pool's budget per device when kv_pages is 0
        (`kv_pool.pool_budget`; 0 = the worst case)."""
        return EngineConfig(slots=self.batch_size, page_size=self.page_size, pages=self.kv_pages,
                            kv_cache=self.kv_cache, attention=self.decode_attention, pool_bytes=int(pool_bytes))


@dataclass
class EvalConfig:
    checkpoint: str = opt("", "HF or lrmq checkpoint directory (packed int4/int8/NF4 too); 'tiny' = the shipped model")
    adapter: str = opt("", "a PEFT LoRA adapter directory applied unmerged on top of the checkpoint (QLoRA)")
    float_qat_policy: bool = opt(False, "score a QAT run's float master weights (RUN/final_policy), which is refused "
                                        "otherwise: the run's model is RUN/final_policy_quantized/packed")
    suite: str = opt("paper1", "paper1, quantlrm, a benchmark name, or comma-separated benchmark names")
    benchmarks: list[str] = opt(help="run only these benchmarks of the suite (empty = all)", factory=list)
    limit: int = opt(0, "first N items of each benchmark (0 = all)")
    prompt: str = opt("", "render every item with this prompt instead of its benchmark's (empty = the paper's)",
                      names=EVAL_PROMPTS, empty_ok=True)
    data_dir: str = opt("", "local benchmark files (empty = $LRMQ_EVAL_DATA or ~/.cache/lrmq/evals)")
    out_dir: str = opt("", "run directory: completions.jsonl, results.json, results.md, tb/")
    dtype: Optional[str] = opt(None, "compute dtype override (float32 | bfloat16)")
    pass_k: list[int] = opt(help="report pass@k for these k <= samples (pass@samples always)", factory=lambda: [1])
    timeout_s: float = opt(1.0, "math-verify time bound per comparison")
    tensorboard: bool = opt(True, "write TensorBoard scalars to out_dir/tb")
    progress: bool = opt(True, "progress bar with ETA over sequences")
    generation: GenerationSection = opt(help="decoding protocol", factory=GenerationSection)

    def validate(self):
        resolve_suite(self.suite)
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k must be >= 1 (got {self.pass_k})")
        if self.limit < 0:
            raise ValueError("limit must be >= 0")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def eval_config(data: Optional[dict] = None, overrides: Sequence[str] = (), source: str = "<eval config>") -> EvalConfig:
    """EvalConfig from a raw YAML dict and dotted overrides, on top of the suite's protocol defaults."""
    data = dict(data or {})
    raw, _ = apply_overrides(EvalConfig, data, overrides)
    suite_name = raw.get("suite") or "paper1"
    try:
        suite, _ = resolve_suite(str(suite_name))
    except KeyError as e:
        raise ConfigError(f"{source}: suite: {e.args[0]}") from None
    base: dict[str, Any] = {"generation": dict(suite.generation)}
    return config_from_dict(EvalConfig, _deep_merge(base, raw), source)
