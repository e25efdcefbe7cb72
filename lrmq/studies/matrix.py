"""The arms of a study: the paper presets expanded, explicit arms added, dependencies checked.

Paper 1 (arXiv 2511.15694), for each RL algorithm A (GRPO, Dr.GRPO):

    A                      full-precision RL
    A-ptq-M-wB             PTQ of A's policy with M at B bits (rtn/awq/gptq/quantlrm at each of `bits`, g=group_size;
                           nf4 at 4 bits (block 64, double quant); int8 at 8 bits per channel)
    A-qat-S                QAT inside RL with scheme S (paper_int8 = the paper's per-tensor int8 STE, int8 / int4 AQT,
                           int4_asym / int8_asym: min-max with zero points, lrmq.quantize's RTN format)
    A-ptq-rtn-wB-F         the same-format pair of a QAT arm (`same_format_ptq`): RTN of A's policy in exactly the
                           QAT scheme's weight format F (pt = per tensor, pc = per channel, gN; -sym), unless an arm
                           above already has that format (A-ptq-rtn-wB, A-ptq-int8-w8)
    A-qlora-F              QLoRA on a packed F (nf4 / int4) base
    base                   the starting checkpoint without RL (the floor)

Paper 2 (QuantLRM, arXiv 2602.02581), on the RL policy P (the A run above, or its own) with the pre-RL
checkpoint (P's initial_policy) as "before":

    P-ptq-M-wB             M in quantlrm / awq / gptq / rtn at each of `bits`
    P-quantlrm-MAP-wB      the importance-mapping ablation (u_shape is the main arm)
    P-quantlrm-pft-wB      QuantLRM with pseudo-fine-tuning "before" weights (as when no pre-RL checkpoint exists)
"""

from __future__ import annotations

import dataclasses

from lrmq.configlib import ConfigError, load_config
from lrmq.quant.formats import PER_CHANNEL, PER_TENSOR, WeightFormat
from lrmq.quant.qat import qat_weight_format, scheme_bits
from lrmq.rl.config import TrainConfig
from lrmq.studies.config import ArmSpec, StudyConfig

# (bits, group) that a method always uses, whatever the matrix says
FIXED_WIDTH = {"nf4": (4, 64), "int8": (8, -1)}
FLOAT_BITS = {"float32": 32.0, "bfloat16": 16.0}


def _ptq(name: str, source: str, method: str, bits: int, group_size: int, **kw) -> ArmSpec:
    kw.setdefault("group", "PTQ")
    return ArmSpec(name=name, kind="ptq", source=source, method=method, bits=bits, group_size=group_size, **kw)


def ptq_widths(methods, bits_list, group: int) -> list[tuple[str, int, int]]:
    """(method, bits, group) of each PTQ arm: fixed-width methods once, the others at every width."""
    out = []
    for m in methods:
        if m in FIXED_WIDTH:
            b, g = FIXED_WIDTH[m]
            out.append((m, b, g))
        else:
            out += [(m, b, group) for b in bits_list]
    return out


def _override(overrides, key: str, default=None):
    out = default
    for o in overrides:
        k, _, v = o.partition("=")
        if k.strip() == key:
            out = v.strip()
    return out


def qat_arm_format(cfg: StudyConfig, train: list[str]) -> WeightFormat | None:
    """The weight format a train arm's QAT scheme trains in (the study's train config with the arm's overrides);
    None for a train arm without QAT."""
    if _override([*cfg.train.overrides, *train], "quant.mode") != "qat":
        return None
    q = load_config(TrainConfig, cfg.train.config, [*cfg.train.overrides, *train]).quant
    return qat_weight_format(q.qat_scheme, q.qat_group_size)


def ptq_arm_format(cfg: StudyConfig, a: ArmSpec) -> WeightFormat:
    """The weight format a ptq arm writes (from its recipe: method, bits, group size, symmetric)."""
    if a.method == "nf4":
        return WeightFormat(bits=4, group_size=a.group_size, symmetric=True, scheme="nf4", kind="nf4",
                            double_quant=True)
    sym = a.method == "int8" or str(_override([*cfg.quantize.overrides, *a.quantize], "symmetric", "false")).lower() \
        in ("true", "1", "yes")
    return WeightFormat(bits=a.bits, group_size=a.group_size, symmetric=sym, scheme=a.method)


def _format_tag(f: WeightFormat, default_group: int) -> str:
    """`rtn-wB` for the matrix's own RTN format (asymmetric, `group_size`), else `rtn-wB-<pt|pc|gN>[-sym]`."""
    if f.group_size == default_group and not f.symmetric:
        return f"rtn-w{f.bits}"
    g = {PER_TENSOR: "pt", PER_CHANNEL: "pc"}.get(f.group_size, f"g{f.group_size}")
    return f"rtn-w{f.bits}-{g}" + ("-sym" if f.symmetric else "")


def paper1_arms(cfg: StudyConfig) -> list[ArmSpec]:
    p = cfg.paper1
    arms = [ArmSpec(name="base", kind="base", group="base (no RL)")] if p.base else []
    for alg, overrides in p.algorithms.items():
        label = alg.upper().replace("DRGRPO", "Dr.GRPO")
        arms.append(ArmSpec(name=alg, kind="train", group=f"{label} FP", train=list(overrides),
                            baseline="base" if p.base else ""))
        ptq = [_ptq(f"{alg}-ptq-{m}-w{b}", alg, m, b, g, group=f"{label} + PTQ")
               for m, b, g in ptq_widths(p.ptq_methods, p.bits, p.group_size)]
        qat, matched = [], []
        for s in p.qat_schemes:
            g = [f"quant.qat_group_size={p.qat_group_size[s]}"] if s in p.qat_group_size else []
            arm = ArmSpec(name=f"{alg}-qat-{s}", kind="train", group=f"{label} QAT", baseline=alg,
                          train=[*overrides, "quant.mode=qat", f"quant.qat_scheme={s}", *g, *p.qat_overrides])
            qat.append(arm)
            if p.same_format_ptq and s != "w8a8":  # w8a8 also quantizes activations: no weight-only PTQ twin
                fmt = qat_arm_format(cfg, arm.train)
                twin = next((a for a in ptq + matched if a.method in ("rtn", "int8")
                             and ptq_arm_format(cfg, a).same_format(fmt)), None)
                if twin is None:
                    twin = _ptq(f"{alg}-ptq-{_format_tag(fmt, p.group_size)}", alg, "rtn", fmt.bits, fmt.group_size,
                                group=f"{label} + PTQ", quantize=["symmetric=true"] if fmt.symmetric else [])
                    matched.append(twin)
                arm.compare["same format"] = twin.name
            if s in p.paper_pairs:
                arm.compare["paper 1 pairing"] = f"{alg}-ptq-{p.paper_pairs[s]}"
        arms += ptq + matched + qat
        for f in p.qlora_bases:
            arms.append(ArmSpec(name=f"{alg}-qlora-{f}", kind="train", group=f"{label} QLoRA", baseline=alg,
                                train=[*overrides, "quant.mode=qlora", f"quant.base_format={f}",
                                       *p.qlora_overrides]))
    return arms


def paper2_arms(cfg: StudyConfig) -> list[ArmSpec]:
    p = cfg.paper2
    src = p.algorithm
    arms = []
    if not (cfg.paper1.enabled and src in cfg.paper1.algorithms):
        arms.append(ArmSpec(name=src, kind="train", group="RL policy (FP)", train=list(p.algorithm_overrides)))
    for m, b, g in ptq_widths(p.methods, p.bits, p.group_size):
        arms.append(_ptq(f"{src}-ptq-{m}-w{b}", src, m, b, g, group=f"{m}"))
    main = f"{src}-ptq-quantlrm-w{p.ablation_bits}"  # the ablations compare with the paper's u_shape arm
    main = main if any(a.name == main for a in arms) else ""
    for mp in p.mappings:
        if mp == "u_shape":
            continue
        arms.append(_ptq(f"{src}-quantlrm-{mp}-w{p.ablation_bits}", src, "quantlrm", p.ablation_bits,
                         p.group_size, group="quantlrm mapping ablation", quantize=[f"quantlrm.mapping={mp}"],
                         baseline=main))
    if p.pseudo_ft:
        arms.append(_ptq(f"{src}-quantlrm-pft-w{p.ablation_bits}", src, "quantlrm", p.ablation_bits, p.group_size,
                         group="quantlrm pseudo-FT", before="pseudo_ft", baseline=main))
    return arms


def _recipe(a: ArmSpec) -> tuple:
    return (a.kind, tuple(a.train), a.source, a.method, a.bits, a.group_size, tuple(a.quantize), a.before)


def expand(cfg: StudyConfig) -> list[ArmSpec]:
    """Every arm of the study in run order (an arm after its source), `only` applied; ConfigError on a
    duplicate name, an unknown or cyclic source, or a ptq arm whose source cannot give a 'before'."""
    arms: dict[str, ArmSpec] = {}
    for a in (paper1_arms(cfg) if cfg.paper1.enabled else []) + (paper2_arms(cfg) if cfg.paper2.enabled else []):
        if a.name in arms:  # paper 2 shares paper 1's arms of the same recipe (the first keeps its labels)
            if _recipe(a) != _recipe(arms[a.name]):
                raise ConfigError(f"the presets define arm {a.name!r} twice, differently")
            continue
        arms[a.name] = a
    seen = set()
    for a in cfg.arms:
        if a.name in seen:
            raise ConfigError(f"arms: {a.name!r} is listed twice")
        seen.add(a.name)
        arms[a.name] = a
    if not arms:
        raise ConfigError("the study has no arms: enable paper1 / paper2 or list arms")
    for a in arms.values():
        if a.baseline and a.baseline not in arms:
            raise ConfigError(f"arm {a.name}: baseline {a.baseline!r} is not an arm of the study")
        for label, other in a.compare.items():
            if a.kind != "train":
                raise ConfigError(f"arm {a.name}: compare is for train arms (a QAT arm against PTQ arms)")
            if other not in arms or arms[other].kind != "ptq":
                raise ConfigError(f"arm {a.name}: compare {label!r}: {other!r} is not a ptq arm of the study")
        if a.kind == "ptq":
            if a.source not in arms:
                raise ConfigError(f"arm {a.name}: source {a.source!r} is not an arm of the study; arms: "
                                  f"{sorted(arms)}")
            s = arms[a.source]
            if s.kind == "ptq":
                raise ConfigError(f"arm {a.name}: source {a.source!r} is a ptq arm (quantize a float model)")
            if a.method == "quantlrm" and a.before == "run" and s.kind != "train":
                raise ConfigError(f"arm {a.name}: quantlrm with before=run needs a train arm as source (its "
                                  f"initial_policy is the 'before'); {a.source!r} is {s.kind} (use before: pseudo_ft)")
            if a.before == "pseudo_ft" and (a.method != "quantlrm" or s.kind != "train"):
                raise ConfigError(f"arm {a.name}: before=pseudo_ft is for quantlrm with a train arm as source (its "
                                  "correct rollouts are the fine-tuning traces)")
            if s.kind == "train" and any(o.startswith("quant.mode=") and not o.endswith("=none") for o in s.train):
                raise ConfigError(f"arm {a.name}: source {a.source!r} trains with QAT/QLoRA; PTQ quantizes "
                                  "full-precision policies")
    order = [a for a in arms.values() if a.kind != "ptq"] + [a for a in arms.values() if a.kind == "ptq"]
    if cfg.only:
        unknown = [n for n in cfg.only if n not in arms]
        if unknown:
            raise ConfigError(f"only: unknown arms {unknown}; arms: {sorted(arms)}")
        keep = set(cfg.only) | {arms[n].source for n in cfg.only if arms[n].kind == "ptq"}
        order = [a for a in order if a.name in keep]
    return order


def nominal_bits(arm: ArmSpec, arms: dict[str, ArmSpec], float_bits: float) -> float:
    """Bits per linear weight of the model an arm deploys (the accuracy-vs-bits x axis)."""
    if arm.nominal_bits:
        return arm.nominal_bits
    if arm.kind == "ptq":
        return float(arm.bits)
    if arm.kind == "train":
        mode = scheme = fmt = None
        for o in arm.train:
            k, _, v = o.partition("=")
            if k == "quant.mode":
                mode = v
            elif k == "quant.qat_scheme":
                scheme = v
            elif k == "quant.base_format":
                fmt = v
        if mode == "qat":
            return float(scheme_bits(scheme or "paper_int8"))
        if mode == "qlora":
            return 4.0 if fmt in ("nf4", "int4", None) else float_bits
    return float_bits


def arm_format(cfg: StudyConfig, arm: ArmSpec) -> WeightFormat | None:
    """The weight format of the model an arm evaluates: a ptq arm's, a QAT arm's scheme's; None for float models
    and QLoRA (a float policy with adapters, evaluated merged)."""
    if arm.kind == "ptq":
        return ptq_arm_format(cfg, arm)
    if arm.kind == "train":
        return qat_arm_format(cfg, arm.train)
    return None


def arm_table(arms: list[ArmSpec]) -> list[dict]:
    return [dataclasses.asdict(a) for a in arms]
