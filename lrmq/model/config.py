"""ModelConfig: one decoder, five families, differing only by these fields.

Read from Hugging Face `config.json` in both the transformers-4 style (`rope_theta`, `rope_scaling`,
`torch_dtype`) and the transformers-5 style (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from lrmq import paths
from lrmq.configlib import ConfigError  # noqa: F401  (raised below for config.json fields lrmq cannot honour)

FAMILIES = ("qwen3", "qwen2", "llama", "olmo3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# config.json `architectures` of each family (the transformers class); another one is refused
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


# config.json fields that must be positive integers when present
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                  "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "decoder_sparse_step")
# Qwen3-MoE's config.json fields with transformers' defaults (Qwen3MoeConfig), read when absent; the expert count
# and shapes have none: a checkpoint must say them
_MOE_DEFAULTS = dict(norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001)


def check_position_limit(cfg: "ModelConfig", positions: int, what: str) -> None:
    """Refuse `positions` (prompt + new tokens, a perplexity window, ...) past the model's
    `max_position_embeddings`: past it RoPE runs on untrained positions and the output is garbage
    without any error. `what` names the setting(s) in the message, e.g.
    ``check_position_limit(mcfg, r.max_prompt_len + r.max_new_tokens,
    "rollout.max_prompt_len + rollout.max_new_tokens")``. Raises ConfigError."""
    limit = cfg.max_position_embeddings
    if positions > limit:
        raise ConfigError(f"{what} = {positions} positions exceeds the model's max_position_embeddings "
                          f"{limit}")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"  # none | head (Qwen3: per head_dim) | full (Olmo: over all heads)
    norm_placement: str = "pre"  # pre (Llama/Qwen) | post (Olmo-2/3: norm the sublayer output)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: dict[str, RopeConfig] = field(default_factory=dict)  # per layer type
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # Mixture of experts (Qwen3-MoE); num_experts = 0 is a dense model. A layer is sparse when num_experts > 0, it
    # is not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0 (transformers' Qwen3MoeDecoderLayer);
    # the others keep the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0  # the checkpoint's load-balancing loss weight (kept and written back; an RL
    # run's weight is its own algo.router_aux_coef, off by default)
    # The original config.json, so that export writes back exactly what was read.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"model family {self.family!r} is not supported; supported: {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ConfigError(f"qk_norm={self.qk_norm!r} must be none|head|full")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ConfigError(f"layer_types entry {t!r} is not supported; supported: {LAYER_TYPES}")
            if t not in self.rope:
                raise ConfigError(f"no RoPE parameters for layer type {t!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        for name, r in self.rope.items():
            if r.type not in ROPE_TYPES:
                raise ConfigError(f"rope_type {r.type!r} (layer type {name}) is not supported; supported: {ROPE_TYPES}")
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in DTYPES:
                raise ConfigError(f"{f}={getattr(self, f)!r} is not supported; supported: {tuple(DTYPES)}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts < 0 or self.decoder_sparse_step < 1:
            raise ConfigError(f"num_experts={self.num_experts} must be >= 0 and decoder_sparse_step="
                              f"{self.decoder_sparse_step} >= 1")
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.moe_intermediate_size or self.mlp_only_layers:
                raise ConfigError("num_experts_per_tok / moe_intermediate_size / mlp_only_layers are set but "
                                  "num_experts is 0 (a dense model)")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                              f"{self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1 with experts")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {list(self.mlp_only_layers)}: layers {bad} are not in "
                              f"[0, {self.num_layers})")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer `i` has the mixture-of-experts block (else the dense MLP): transformers' rule."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers' indices, in order (a routing record's layer axis follows it)."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self, *, active: bool = False) -> int:
        """Parameters of the model (weights, norms; no biases). active: those one token computes with, each sparse
        layer counting its router and num_experts_per_tok experts (a dense model: all of them)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qk_norms = {"none": 0, "head": 2 * self.head_dim, "full": self.q_size + self.kv_size}[self.qk_norm]
        attn = d * self.q_size * 2 + d * self.kv_size * 2 + qk_norms
        experts = self.num_experts_per_tok if active else self.num_experts
        total = v * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_layers):
            mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size if self.is_moe_layer(i) \
                else 3 * d * f
            total += attn + mlp + 2 * d
        return total

    # ---------------------------------------------------------------- Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json", dtype: str | None = None,
                     param_dtype: str | None = None) -> "ModelConfig":
        hf = copy.deepcopy(hf)
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ConfigError(f"{source}: model_type {family!r} is not supported; supported: {FAMILIES}")
        archs = hf.get("architectures")
        if archs is not None:
            wrong = [a for a in (archs if isinstance(archs, list) else [archs]) if a != ARCHITECTURES[family]]
            if wrong:
                raise ConfigError(f"{source}: architectures {archs!r} disagrees with model_type {family!r} "
                                  f"(expected [{ARCHITECTURES[family]!r}])")

        def need(key):
            if key not in hf:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return hf[key]

        for key in _POSITIVE_INTS:  # a wrong type would fail later, deep in the model code, without the file
            v = hf.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{source}: {key} must be a positive integer, found {v!r}")
        for key in ("rms_norm_eps", "rope_theta"):
            v = hf.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"{source}: {key} must be a number, found {v!r}")

        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        for key in ("partial_rotary_factor",):
            if hf.get(key, 1.0) != 1.0:
                raise ConfigError(f"{source}: {key}={hf[key]} is not supported")
        n_layers = need("num_hidden_layers")
        n_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = hf.get("head_dim") or hidden // n_heads
        n_kv = hf.get("num_key_value_heads") or n_heads

        moe = _read_moe(hf, family, source, n_layers)
        layer_types = hf.get("layer_types")
        sliding_window = hf.get("sliding_window")
        if layer_types is None:
            if family in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
                mwl = hf.get("max_window_layers", n_layers)
                layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]
            elif family == "olmo3":
                layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
            else:
                layer_types = ["full_attention"] * n_layers
        if family in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
            layer_types = ["full_attention"] * n_layers  # transformers ignores the window unless enabled
        layer_types = tuple(layer_types)
        if "sliding_attention" not in layer_types:
            sliding_window = None

        rope = _read_rope(hf, family, source, set(layer_types))
        attn_bias = bool(hf.get("attention_bias", False))
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias, o_bias = attn_bias, attn_bias

        file_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if family == "olmo3" else 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmo3": "full"}.get(family, "none"),
            norm_placement="post" if family == "olmo3" else "pre",
            layer_types=layer_types,
            sliding_window=sliding_window,
            rope=rope,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            dtype=dtype or _norm_dtype(file_dtype, source),
            param_dtype=param_dtype or _norm_dtype(file_dtype, source),
            hf_config=hf,
            **moe,
        )

    @classmethod
    def from_hf_file(cls, path: str, **kw) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            hf = paths.read_json(path, what="model config")  # one line naming the file: bad JSON, not a mapping
        except paths.FileFormatError as e:
            raise ConfigError(str(e)) from None
        return cls.from_hf_dict(hf, source=path, **kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json to export: the original one when we have it (bit-exact round trips)."""
        if self.hf_config:
            return copy.deepcopy(self.hf_config)
        arch = ARCHITECTURES[self.family]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype": self.param_dtype,
        }
        if self.family != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.sliding_window:
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = list(self.layer_types)
            if self.family in ("qwen2", "qwen3"):
                d["use_sliding_window"] = True
        if self.num_experts:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef)
        if self.family == "olmo3":
            d["layer_types"] = list(self.layer_types)
            d["rope_parameters"] = {t: _rope_to_hf(r) for t, r in self.rope.items()}
        else:
            d["rope_parameters"] = _rope_to_hf(self.rope["full_attention"] if "full_attention" in self.rope
                                               else next(iter(self.rope.values())))
        return d


def _read_moe(hf: dict[str, Any], family: str, source: str, n_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a config.json: {} for the dense families. transformers 5 writes
    the expert count as `num_local_experts`, the published Qwen3-MoE configs (and transformers 4) as `num_experts`."""
    if family != "qwen3_moe":
        return {}
    if hf.get("use_sliding_window", False):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported for qwen3_moe")
    counts = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"{source}: num_experts={counts['num_experts']} and num_local_experts="
                          f"{counts['num_local_experts']} disagree")
    if not counts:
        raise ConfigError(f"{source}: required field 'num_experts' (or 'num_local_experts') is missing")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in hf:
            raise ConfigError(f"{source}: required field {key!r} is missing")
    get = lambda k: hf[k] if hf.get(k) is not None else _MOE_DEFAULTS[k]
    only = get("mlp_only_layers")
    if not isinstance(only, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, found {only!r}")
    if not isinstance(get("norm_topk_prob"), bool):
        raise ConfigError(f"{source}: norm_topk_prob must be true or false, found {hf['norm_topk_prob']!r}")
    coef = get("router_aux_loss_coef")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise ConfigError(f"{source}: router_aux_loss_coef must be a number, found {coef!r}")
    bad = [i for i in only if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"{source}: mlp_only_layers {list(only)}: layers {bad} are not in [0, {n_layers})")
    return dict(num_experts=next(iter(counts.values())), num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=get("norm_topk_prob"),
                decoder_sparse_step=get("decoder_sparse_step"), mlp_only_layers=tuple(only),
                router_aux_loss_coef=float(coef))


def _norm_dtype(s: str, source: str) -> str:
    s = str(s).replace("torch.", "")
    alias = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
    s = alias.get(s, s)
    if s not in DTYPES:
        raise ConfigError(f"{source}: dtype {s!r} is not supported; supported: {tuple(DTYPES)}")
    return s


def _rope_from_dict(d: dict[str, Any], *, theta_default: float, max_pos: int, where: str) -> RopeConfig:
    rtype = d.get("rope_type", d.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rtype!r} is not supported; supported: {ROPE_TYPES}")
    theta = float(d.get("rope_theta", theta_default))
    kw: dict[str, Any] = dict(theta=theta, type=rtype)
    if rtype != "default":
        if "factor" not in d and rtype != "yarn":
            raise ConfigError(f"{where}: rope_type {rtype!r} needs 'factor'")
        kw["factor"] = float(d.get("factor") or 1.0)
    if rtype == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in d:
                raise ConfigError(f"{where}: rope_type 'llama3' needs {k!r}")
        kw.update(low_freq_factor=float(d["low_freq_factor"]), high_freq_factor=float(d["high_freq_factor"]),
                  original_max_position_embeddings=int(d["original_max_position_embeddings"]))
    if rtype == "yarn":
        omp = d.get("original_max_position_embeddings", max_pos)
        factor = d.get("factor") or max_pos / omp
        kw.update(factor=float(factor), original_max_position_embeddings=int(omp),
                  beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                  attention_factor=d.get("attention_factor"), mscale=d.get("mscale"),
                  mscale_all_dim=d.get("mscale_all_dim"), truncate=bool(d.get("truncate", True)))
    return RopeConfig(**kw)


def _read_rope(hf: dict[str, Any], family: str, source: str, layer_types: set[str]) -> dict[str, RopeConfig]:
    default_theta = 500000.0 if family == "olmo3" else 10000.0
    theta = hf.get("rope_theta", default_theta)
    max_pos = int(hf.get("max_position_embeddings", 32768))
    params = hf.get("rope_parameters")
    if params is None:  # transformers-4 style
        scaling = hf.get("rope_scaling") or {}
        base = dict(scaling, rope_theta=theta)
        return {t: _rope_from_dict(base, theta_default=theta, max_pos=max_pos, where=f"{source} rope_scaling")
                for t in layer_types | {"full_attention"}}
    if all(t in LAYER_TYPES for t in params) and params:  # per-layer-type (Olmo-3)
        out = {}
        for t in layer_types | {"full_attention"}:
            p = params.get(t) or {}
            out[t] = _rope_from_dict(p, theta_default=theta, max_pos=max_pos, where=f"{source} rope_parameters.{t}")
        return out
    r = _rope_from_dict(params, theta_default=theta, max_pos=max_pos, where=f"{source} rope_parameters")
    return {t: r for t in layer_types | {"full_attention"}}


def _rope_to_hf(r: RopeConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type in ("linear", "llama3", "yarn"):
        d["factor"] = r.factor
    if r.type == "llama3":
        d.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                 original_max_position_embeddings=r.original_max_position_embeddings)
    if r.type == "yarn":
        d.update(original_max_position_embeddings=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                 beta_slow=r.beta_slow)
        if r.attention_factor is not None:
            d["attention_factor"] = r.attention_factor
    return d
