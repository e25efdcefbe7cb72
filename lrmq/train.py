"""`python -m lrmq.train --config configs/NAME.yaml [dotted.key=value ...]`: GRPO / Dr.GRPO training.

Rerunning the same command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from lrmq import aot, cli, paths
from lrmq.atomic import atomic_write_text, disk_full_error, is_disk_full
from lrmq.configlib import ConfigError, add_config_args, config_from_args, dump_config
from lrmq.ptq.qat_export import QUANTIZED_POLICY
from lrmq.rl.config import TrainConfig
from lrmq.rl.run_lock import RunDirBusy
from lrmq.aot import PreflightError
from lrmq.rl.trainer import GRPOTrainer, TrainingStopped


def maybe_init_distributed() -> None:
    """Multi-process runs: set LRMQ_COORDINATOR, LRMQ_NUM_PROCESSES, LRMQ_PROCESS_ID (see launch/), or run on
    a TPU pod slice where jax discovers its peers itself (LRMQ_DISTRIBUTED=auto)."""
    import jax

    if os.environ.get("LRMQ_COORDINATOR"):
        jax.distributed.initialize(coordinator_address=os.environ["LRMQ_COORDINATOR"],
                                   num_processes=int(os.environ["LRMQ_NUM_PROCESSES"]),
                                   process_id=int(os.environ["LRMQ_PROCESS_ID"]))
    elif os.environ.get("LRMQ_DISTRIBUTED") == "auto":
        jax.distributed.initialize()


def main(argv=None) -> int:
    cli.select_platforms()  # before JAX starts a backend (lrmq.cli)
    ap = argparse.ArgumentParser(prog="python -m lrmq.train", description=__doc__.splitlines()[0])
    add_config_args(ap, TrainConfig)  # also --help-config (every option, described) and --print-config
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the train step and the rollout for the recipe's hardware without allocating "
                         "weights; print per-device memory, FLOPs and compile times; exit 3 if it does not fit")
    ap.add_argument("--topology", default=None,
                    help=aot.TOPOLOGY_HELP + " (default: mesh.topology of the config, else this machine's devices)")
    ap.add_argument("--platform", choices=["tpu", "gpu"], default="tpu", help=aot.PLATFORM_HELP)
    ap.add_argument("--report", default=None, help="with --compile-only: also write the report as JSON here")
    ap.add_argument("--stop-after", type=cli.number(int, ge=0), default=0,
                    help="run at most this many steps in this invocation, then save and exit (resume later)")
    args = ap.parse_args(argv)
    # force: an imported library has already given the root logger a WARNING handler
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes at INFO
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

    try:
        cfg = config_from_args(TrainConfig, args)
    except ConfigError as e:
        cli.print_error("train", f"config: {e}")
        return 2
    if args.print_config:
        print(dump_config(cfg, comments=True))
        return 0
    if args.compile_only:
        # mesh.topology names the recipe's TPU slice: a GPU target is named on the command line
        topology = args.topology or (cfg.mesh.topology if args.platform == "tpu" else None)
        return compile_only(cfg, topology, args.report, args.platform)
    maybe_init_distributed()

    # Until the training loop installs its own handlers (finish the step, save, exit), SIGTERM during
    # start-up (loading, resuming, the preflight compile, the first export and evaluation) ends the
    # command with a message; every output is written atomically, so nothing half-written is left.
    def startup_signal(signum, frame):
        raise _StartupInterrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, startup_signal)
    try:
        trainer = GRPOTrainer(cfg, preflight_programs=aot.rollout_memory)
        final = trainer.train(stop_after=args.stop_after or None)
    except _StartupInterrupted as e:
        cli.print_error("train", f"interrupted by {e} during start-up, before the first step; nothing to resume "
                                 "from was lost: rerun the same command")
        return 143 if str(e) == "SIGTERM" else 130
    except PreflightError as e:  # the memory check: exit 3
        cli.print_error("train", e)
        return 3
    except TrainingStopped as e:
        cli.print_error("train", e)
        return 1
    except (RunDirBusy, *cli.USER_ERRORS) as e:
        cli.print_error("train", e)
        return 2
    except Exception as e:  # a full disk while saving a checkpoint or an export (orbax wraps the OSError)
        if not is_disk_full(e):
            raise
        cli.print_error("train", disk_full_error(cfg.run.out_dir))
        return 2
    if trainer._stop_signal is not None:
        print(f"interrupted at step {trainer.step}; checkpoint saved in {trainer.ckpt.directory}; "
              "rerun the same command to resume", file=sys.stderr)
        return 0
    keys = [k for k in ("eval/sampled_accuracy", "eval/greedy_accuracy", "reward/mean", "reward/accuracy")
            if k in final]
    print(f"done: step {trainer.step}, " + ", ".join(f"{k}={final[k]:.4f}" for k in keys) +
          f"; run dir {trainer.run_dir}" + quantized_policy_note(cfg, trainer.run_dir))
    return 0


def quantized_policy_note(cfg, run_dir: str) -> str:
    """The done line's pointer, in a QAT run, to the model it trained: RUN/final_policy_quantized/packed (its
    final_policy is the float master weights, which lrmq's commands refuse unless --float-qat-policy)."""
    if cfg.quant.mode != "qat":
        return ""
    packed = paths.join(run_dir, QUANTIZED_POLICY, "packed")
    if paths.epath_of(packed).exists():
        return f"; quantized policy (the model it trained) {packed}"
    return f"; no quantized policy written (quant.qat_scheme={cfg.quant.qat_scheme}): final_policy is float"


class _StartupInterrupted(BaseException):
    """SIGTERM / SIGINT before the training loop took over the signals."""


def compile_only(cfg, topology: str, report_path: str | None, platform: str = "tpu") -> int:
    """--compile-only: 0 when the step and the rollout fit, 3 when they do not, 2 on a config error."""
    import json

    try:
        if report_path:  # a directory there: say so before the compile, not after it
            paths.check_file_path(report_path, "--report")
        devices = aot.target_devices(topology, platform)
        report = aot.check_fit(cfg, devices, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ConfigError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        cli.print_error("train", e)
        return 2
    target = topology or "local devices"
    p = report.placement
    where = (f"mesh {_axes(p['learner'])}" if p["placement"] == "colocated" else
             f"split: learner {_axes(p['learner'])} ({p['learner_chips']} chips), sampler {_axes(p['sampler'])} "
             f"({p['sampler_chips']} chips)")
    print(f"target: {target}; {where}; mode {cfg.quant.mode}; micro-batch {cfg.optim.micro_batch_size or 'whole batch'}")
    print(report.table())
    if report.pool is not None:
        print(aot.pool_line(report.pool, "rollout.kv_pages"))
    a2a = aot.all_to_all_line(report)
    if a2a:
        print(a2a)
    note = aot.memory_note(report, devices)
    if note:
        print(note)
    if report.estimate is not None:
        e = report.estimate
        print(f"step time, a roofline estimate (not measured): rollout {e['rollout_s']:.3g} s, update "
              f"{e['update_s']:.3g} s -> {e['step_s']:.3g} s per step ({e['how'].split('; ')[-1]})")
    print(aot.verdict(report, cfg))
    if report_path:
        atomic_write_text(report_path, json.dumps(aot.report_dict(report, cfg, target), indent=1) + "\n")
    return 0 if report.fits else 3


def _axes(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


if __name__ == "__main__":
    cli.tune_gc()
    sys.exit(main())
