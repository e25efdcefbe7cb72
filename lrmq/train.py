"""`python -m lrmq.train --config configs/NAME.yaml [dotted.key=value ...]`: GRPO / Dr.GRPO training.

Rerunning the same command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


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
    from lrmq.configlib import ConfigError, add_config_args, config_from_args, dump_config

    ap = argparse.ArgumentParser(prog="python -m lrmq.train", description=__doc__.splitlines()[0])
    add_config_args(ap)
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="run at most this many steps in this invocation, then save and exit (resume later)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes at INFO
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from lrmq.rl.config import TrainConfig

    try:
        cfg = config_from_args(TrainConfig, args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg))
        return 0
    maybe_init_distributed()
    from lrmq.rl.trainer import GRPOTrainer

    try:
        trainer = GRPOTrainer(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    final = trainer.train(stop_after=args.stop_after or None)
    if trainer._stop_signal is not None:
        print(f"interrupted at step {trainer.step}; checkpoint saved in {trainer.ckpt.directory}; "
              "rerun the same command to resume", file=sys.stderr)
        return 0
    keys = [k for k in ("eval/sampled_accuracy", "eval/greedy_accuracy", "reward/mean", "reward/accuracy")
            if k in final]
    print(f"done: step {trainer.step}, " + ", ".join(f"{k}={final[k]:.4f}" for k in keys) +
          f"; run dir {trainer.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
