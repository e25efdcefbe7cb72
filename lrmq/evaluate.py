"""`python -m lrmq.evaluate --checkpoint DIR --suite paper1|quantlrm|NAME [--samples K] [--greedy] [--limit N]
[--out DIR] [--config configs/eval/NAME.yaml] [key=value ...]`: benchmark scores with the papers' protocols.

Suites, data files, outputs and how lrmq's choices differ from the papers: docs/evaluate.md.
`--rescore` re-scores an existing run's completions.jsonl without generating.
"""

from __future__ import annotations

import json
import os
import sys

import jax
from flax import nnx

from lrmq import aot, cli, compile_cache, configlib, paths
from lrmq.checkpoint.load import check_checkpoint, load_model, resolve_checkpoint
from lrmq.checkpoint.peft import load_lora, read_adapter_config
from lrmq.checkpoint.quantized import quantized_format
from lrmq.config_help import to_plain
from lrmq.configlib import ConfigError
from lrmq.evals.benchmarks import BENCHMARKS, EvalDataError, default_data_dir, load_items, resolve_suite
from lrmq.evals.config import EvalConfig, eval_config
from lrmq.evals.runner import (COMPLETIONS, RESULTS, TABLE, EvalError, markdown_table, open_writer, read_records,
                               sampling_config,
                               run_suite, score_records, summarize_records)
from lrmq.atomic import atomic_write_text
from lrmq.generation.engine import Engine
from lrmq.generation.kv_pool import decode_fsdp, least_kv_heads, pool_budget
from lrmq.model.config import ModelConfig
from lrmq.model.presets import preset_config
from lrmq.ptq.qat_export import refuse_float_qat_policy
from lrmq.quant.lora import DEFAULT_TARGETS, apply_lora
from lrmq.sharding import MeshConfig, bytes_per_device, make_mesh
from lrmq.tokenizer import Tokenizer

RUN_CONFIG = "eval_config.yaml"
# Settings that change what a completion is: a run dir holding another value cannot be resumed.
# what --rescore needs of each record of completions.jsonl
_RECORD_KEYS = ("benchmark", "sample", "completion", "answer")
_RUN_KEYS = ("checkpoint", "adapter", "suite", "prompt", "dtype", "generation")


def parse_args(argv=None):
    ap = cli.ArgumentParser("evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="HF or lrmq checkpoint directory ('tiny' = the shipped model)")
    ap.add_argument("--suite", help="paper1, quantlrm, a benchmark name, or comma-separated benchmark names")
    ap.add_argument("--samples", type=cli.number(int, ge=1), help="K samples per problem (pass@1 = their mean)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding")
    ap.add_argument("--limit", type=cli.number(int, ge=0), help="first N items per benchmark")
    ap.add_argument("--out", help="run directory (default eval_runs/SUITE_CHECKPOINT)")
    ap.add_argument("--data-dir", help="local benchmark files (default $LRMQ_EVAL_DATA or ~/.cache/lrmq/evals)")
    ap.add_argument("--float-qat-policy", action="store_true", default=None,
                    help="score a QAT run's float master weights (RUN/final_policy); refused otherwise, the run's "
                         "model being its quantized export RUN/final_policy_quantized/packed")
    ap.add_argument("--rescore", action="store_true", help="re-score --out's completions.jsonl; no generation")
    ap.add_argument("--overwrite", action="store_true", help="discard --out's records of a different config")
    configlib.add_config_args(ap, EvalConfig)  # --config, key=value overrides, --help-config, --print-config
    aot_args = ap.add_argument_group("ahead-of-time compile (no weights are read or allocated)")
    aot_args.add_argument("--compile-only", action="store_true",
                          help="compile the suite's generation (its batch, prompt length and decode length) for "
                               "--topology and print per-device memory; exit 3 when it does not fit")
    aot_args.add_argument("--topology", default=None, help=aot.TOPOLOGY_HELP + " (default: this machine)")
    aot_args.add_argument("--platform", choices=["tpu", "gpu"], default="tpu", help=aot.PLATFORM_HELP)
    aot_args.add_argument("--shapes", default=None, help="architecture preset instead of --checkpoint's config.json")
    aot_args.add_argument("--prompt-len", type=cli.number(int, ge=1), default=512,
                          help="left-padded prompt length to compile for (prompts are bucketed to powers of two)")
    aot_args.add_argument("--pack", choices=["int4", "int8", "nf4"], default=None,
                          help="compile with every linear packed in this format (the Pallas kernels serve them)")
    return ap.parse_intermixed_args(argv)  # key=value overrides may sit between flags


def check_qat_policy(cfg: EvalConfig) -> None:
    """A QAT run's final_policy is its float master weights; the model the run trained is the quantized export
    beside it. Refused unless float_qat_policy (--float-qat-policy) asks for it (`refuse_float_qat_policy`)."""
    refuse_float_qat_policy(cfg.checkpoint, action="score", allowed=cfg.float_qat_policy)


def build_config(args) -> EvalConfig:
    data, source = {}, "<command line>"
    if args.config:
        source = args.config
        data = configlib.read_yaml_file(args.config) or {}  # one line naming the file (and line) when unreadable
        if not isinstance(data, dict):
            raise ConfigError(f"{args.config}: top level must be a mapping")
    flags = []
    for flag, key in (("checkpoint", "checkpoint"), ("suite", "suite"), ("samples", "generation.samples"),
                      ("limit", "limit"), ("out", "out_dir"), ("data_dir", "data_dir"),
                      ("float_qat_policy", "float_qat_policy")):
        v = getattr(args, flag)
        if v is not None:
            flags.append(f"{key}={v}")
    if args.greedy:
        flags.append("generation.greedy=true")
    cfg = eval_config(data, [*flags, *args.overrides], source)
    if not cfg.out_dir:
        name = os.path.basename(os.path.normpath(cfg.checkpoint)) if cfg.checkpoint else "model"
        cfg.out_dir = os.path.join("eval_runs", f"{cfg.suite.replace(',', '+')}_{name}")
    return cfg


def run_meta(cfg: EvalConfig, weight_format: str | None = None) -> dict:
    """results.json's header: the suite, the checkpoint, its weight format when given (`quantized_format`: e.g.
    ``lrmq packed int4 asym g128 f32-scale (rtn)``; "float" for a float model; shown above the table), the config."""
    plain = to_plain(cfg)
    for k in ("out_dir", "progress", "tensorboard", "data_dir"):
        plain.pop(k, None)
    return {"suite": cfg.suite, "checkpoint": cfg.checkpoint,
            **({"weight_format": weight_format} if weight_format else {}), "config": plain}


def check_run_dir(cfg: EvalConfig, overwrite: bool) -> None:
    """A run dir belongs to one config: resuming with another would mix completions."""
    paths.check_dir_path(cfg.out_dir, "run directory (--out)")
    path = os.path.join(cfg.out_dir, RUN_CONFIG)
    if os.path.exists(path):
        old = configlib.load_config(EvalConfig, path)
        diff = [k for k in _RUN_KEYS if to_plain(getattr(old, k)) != to_plain(getattr(cfg, k))]
        if diff and not overwrite:
            raise EvalError(f"{cfg.out_dir} holds a run with different {', '.join(diff)} (see {path}); use another "
                            "--out, or --overwrite to discard its records")
        if diff:
            for f in (COMPLETIONS, RESULTS, TABLE):
                if os.path.exists(os.path.join(cfg.out_dir, f)):
                    os.remove(os.path.join(cfg.out_dir, f))
    configlib.save_config(cfg, path)


def eval_mesh(devices, kv_heads: int, kv_cache: str, log=print):
    """The mesh an evaluation decodes on: data=1 x fsdp=all of `devices` (weights split the most ways), unless the
    KV format cannot decode there (fp8 pages on TPU need >= 2 KV heads per chip: `kv_pool.least_kv_heads`); then
    data x fsdp with fsdp the largest that splits the KV heads into shares it runs at (`kv_pool.decode_fsdp`),
    printed. A data axis splits the decode slots and the KV pool's pages (`kv_pool.kv_page_axes`)."""
    devices = list(devices if devices is not None else jax.devices())
    n, platform = len(devices), devices[0].platform
    fsdp = n if least_kv_heads(kv_cache, platform) == 1 else decode_fsdp(n, kv_heads, kv_cache, platform)
    mesh = make_mesh(MeshConfig(n // fsdp, fsdp, 1), devices=devices)
    if fsdp < n:
        log(f"mesh: data={n // fsdp} x fsdp={fsdp} ({kv_heads // fsdp} of the {kv_heads} KV heads per chip for "
            f"generation.kv_cache={kv_cache}; the decode slots and the KV pool's pages split over data)")
    return mesh


def load_eval_model(cfg: EvalConfig):
    """(model, tokenizer, mesh): with several devices the weights are sharded on `eval_mesh` and the engine splits
    its decode slots and KV pages over the data axis."""
    ckpt = resolve_checkpoint(cfg.checkpoint)
    mesh = None
    if jax.device_count() > 1:
        heads = ModelConfig.from_hf_file(ckpt, dtype=cfg.dtype).num_kv_heads
        mesh = eval_mesh(jax.devices(), heads, cfg.generation.kv_cache)
    model = load_model(ckpt, mesh=mesh, dtype=cfg.dtype)
    if cfg.adapter:
        rank, alpha = read_adapter_config(cfg.adapter)
        apply_lora(model, DEFAULT_TARGETS, rank=rank, alpha=alpha, mesh=mesh,
                   mode="off")
        load_lora(model, cfg.adapter)
    return model, Tokenizer.from_dir(ckpt), mesh


def rescore(cfg: EvalConfig) -> dict:
    """Re-score out_dir's completions.jsonl with the current scorers and rewrite the results; the run's own
    config (its eval_config.yaml) describes it, the command line only picks the dir and timeout_s."""
    saved_path = os.path.join(cfg.out_dir, RUN_CONFIG)
    if os.path.exists(saved_path):
        saved = configlib.load_config(EvalConfig, saved_path)
        saved.out_dir, saved.timeout_s = cfg.out_dir, cfg.timeout_s
        cfg = saved
    suite, names = resolve_suite(cfg.suite)
    names = [n for n in names if not cfg.benchmarks or n in cfg.benchmarks]
    path = os.path.join(cfg.out_dir, COMPLETIONS)
    records = read_records(path, repair=False)
    if not records:
        raise EvalError(f"--rescore: {path} has no records")
    for i, r in enumerate(records, 1):  # a file of another tool (or hand-edited): the record and field, not a KeyError
        missing = [k for k in _RECORD_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise EvalError(f"--rescore: {path} record {i} has no {missing[0]!r} field (the records of "
                            "lrmq.evaluate have " + ", ".join(_RECORD_KEYS) + ")")
        if r["benchmark"] not in BENCHMARKS:
            raise EvalError(f"--rescore: {path} record {i}: unknown benchmark {r['benchmark']!r}")
    records = score_records(records, timeout_s=cfg.timeout_s)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records))
    names = [n for n in names if any(r["benchmark"] == n for r in records)]
    k_max = 1 + max(int(r["sample"]) for r in records)
    results = summarize_records(records, suite, names, sorted({k for k in cfg.pass_k if k <= k_max} | {k_max}))
    atomic_write_text(os.path.join(cfg.out_dir, RESULTS),
                      json.dumps({**run_meta(cfg), **results}, indent=2, sort_keys=True) + "\n")
    atomic_write_text(os.path.join(cfg.out_dir, TABLE), markdown_table(results))
    return results


def compile_only(cfg: EvalConfig, args) -> int:
    """--compile-only: the generation engine's programs (the largest prefill and a decode call of
    generation.batch_size slots, --prompt-len + max_new_tokens capped by the model's positions) compiled for
    the target; a program that does not fit gets the verdict line, exit 3, and the slot count that fits."""
    if not (cfg.checkpoint or args.shapes):
        raise ConfigError("--compile-only needs --checkpoint or --shapes")
    mcfg = (preset_config(args.shapes, dtype=cfg.dtype) if args.shapes
            else ModelConfig.from_hf_file(resolve_checkpoint(cfg.checkpoint), dtype=cfg.dtype))
    g = cfg.generation
    positions = g.max_positions or mcfg.max_position_embeddings
    if args.prompt_len >= positions:
        raise ConfigError(f"--prompt-len {args.prompt_len} leaves no room for new tokens in the model's "
                          f"{positions} positions")
    new = min(g.max_new_tokens, positions - args.prompt_len)
    devices = aot.target_devices(args.topology, args.platform)
    mesh = eval_mesh(devices, mcfg.num_kv_heads, g.kv_cache)
    graphdef, state = aot.abstract_model(mcfg, mesh, pack=args.pack)
    axes = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"
    print(f"target: {args.topology or 'local devices'} ({mesh.devices.size} devices, {axes}); suite {cfg.suite}: "
          f"{g.batch_size} decode slots, prompt {args.prompt_len} + {new} new tokens; weights "
          f"{args.pack or mcfg.param_dtype}", flush=True)
    report, line = aot.check_generate(graphdef, state, mesh, model_cfg=mcfg, engine=g.engine_config(),
                                      requests=g.batch_size, prompt_len=args.prompt_len, max_new=new,
                                      sampling=sampling_config(g), slots_option="generation.batch_size",
                                      pages_option="generation.kv_pages", fraction=g.kv_memory_fraction,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
    print(report.table())
    print(aot.pool_line(report.pool, "generation.kv_pages"))
    note = aot.memory_note(report, devices)
    if note:
        print(note)
    print(line)
    return 0 if report.fits else 3


def main(argv=None) -> int:
    cli.select_platforms()  # before JAX starts a backend (lrmq.cli)
    args = parse_args(argv)
    compile_cache.enable()  # a rerun loads its compiled programs (lrmq.compile_cache)
    return cli.run_main("evaluate", lambda: _main(args))


def _main(args) -> int:
    cfg = build_config(args)
    if args.print_config:
        print(configlib.dump_config(cfg, comments=True), end="")
        return 0
    if args.rescore:
        print(markdown_table(rescore(cfg)), end="")
        return 0
    if args.compile_only:
        return compile_only(cfg, args)
    if not cfg.checkpoint:
        raise ConfigError("--checkpoint (or checkpoint: in --config) is required")
    check_qat_policy(cfg)  # a QAT run's float weights: refused before the benchmarks or the model are read
    suite, names = resolve_suite(cfg.suite)
    bad = [n for n in cfg.benchmarks if n not in names]
    if bad:
        raise ConfigError(f"benchmarks {bad} are not in suite {cfg.suite!r} ({names})")
    names = [n for n in names if not cfg.benchmarks or n in cfg.benchmarks]
    data_dir = os.path.expanduser(cfg.data_dir) if cfg.data_dir else default_data_dir()
    if paths.is_url(data_dir):  # benchmark files in a bucket: read from a per-process local copy
        data_dir = paths.local_copy(data_dir, "benchmark data directory", f"--data-dir {data_dir}")
    items, errors = [], []
    for n in names:
        try:
            items += load_items(BENCHMARKS[n], data_dir, cfg.limit, cfg.prompt)
        except EvalDataError as e:
            errors.append(str(e))
    if errors:
        raise EvalDataError("\n".join(errors))
    # a missing or broken checkpoint / adapter: said before the run dir is written
    check_checkpoint(cfg.checkpoint, "--checkpoint" if args.checkpoint else "checkpoint")
    if cfg.adapter:
        read_adapter_config(cfg.adapter)
    check_run_dir(cfg, args.overwrite)
    model, tok, mesh = load_eval_model(cfg)
    meta = run_meta(cfg, quantized_format(resolve_checkpoint(cfg.checkpoint)) or "float")
    budget = 0
    if not cfg.generation.kv_pages:  # the pool sized to the device: kv_memory_fraction of it less the weights
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        budget = pool_budget(aot.hbm_bytes(device), bytes_per_device(nnx.state(model)),
                             cfg.generation.kv_memory_fraction)
    engine = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id, config=cfg.generation.engine_config(budget),
                    mesh=mesh)
    writer = open_writer(cfg.out_dir) if cfg.tensorboard else None
    try:
        results = run_suite(model, tok, items, cfg.generation, suite=suite, engine=engine,
                            out_dir=cfg.out_dir, pass_k=cfg.pass_k,
                            timeout_s=cfg.timeout_s, progress=cfg.progress, writer=writer, meta=meta)
    finally:
        if writer is not None:
            writer.close()
    print(markdown_table({**meta, **results}), end="")
    t = results["timing"]
    where = f" on a mesh of {mesh.devices.size} devices" if mesh is not None else ""
    print(f"[lrmq.evaluate] {t['generated_sequences']} sequences, {t['new_tokens']} new tokens in {t['seconds']:.1f}s"
          f"{where}; "
          f"results in {os.path.join(cfg.out_dir, RESULTS)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.tune_gc()
    sys.exit(main())
