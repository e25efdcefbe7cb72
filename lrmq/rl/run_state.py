"""Run state in the run dir: checkpoints (orbax, sharded) with JSON metadata, and the logs.

The run dir is a local path or a URL (see lrmq.paths). Orbax reads and writes `gs://` itself (through
tensorstore's GCS driver, committing with a marker file instead of a rename); the logs of a URL run
dir are written to a local staging dir and mirrored up (object stores cannot append).
"""

from __future__ import annotations

import json
import logging
import os

import jax
import orbax.checkpoint as ocp

from lrmq import paths
from lrmq.atomic import atomic_write_text

log = logging.getLogger("lrmq.train")

# Orbax writes array data through tensorstore, whose remote kvstore driver it picks for gs:// only;
# any other URL would reach tensorstore's file driver and fail there, after the first training step.
CHECKPOINT_URL_SCHEMES = ("gs",)


class RunCheckpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = paths.resolve(directory)
        if paths.is_url(self.directory) and self.directory.split("://")[0] not in CHECKPOINT_URL_SCHEMES:
            raise ValueError(f"{self.directory}: checkpoints (orbax) can be written to local paths and "
                             + ", ".join(f"{s}://" for s in CHECKPOINT_URL_SCHEMES) + " URLs only")
        self.manager = ocp.CheckpointManager(
            paths.epath_of(self.directory), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, tree, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, target):
        """Restore onto `target`'s structure, shapes, dtypes and shardings."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if hasattr(x, "sharding") else x, target)
        r = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               meta=ocp.args.JsonRestore()))
        return r.state, r.meta


class RunLogs:
    """metrics.jsonl and tb/ of a run dir, written by one process (`enabled`; the others get no-ops).

    Local run dir: written in place, metrics.jsonl appended one line per call (as before). URL run dir:
    written to a local staging dir (`local_dir`, under $TMPDIR) that is copied up at most every
    `sync_s` seconds and on `sync(force=True)` (the trainer forces one at each checkpoint and at the
    end of `train`); a resumed run first pulls the existing metrics.jsonl so it keeps appending to it.
    """

    METRICS = "metrics.jsonl"
    COMPLETIONS = "completions.jsonl"

    def __init__(self, run_dir: str, *, enabled: bool = True, sync_s: float = 30.0):
        self.enabled = enabled
        self._mirror = None
        self.local_dir = run_dir
        if enabled and paths.is_url(run_dir):
            self.local_dir = paths.process_temp_dir("run-logs")  # removed when the process exits
            self._mirror = paths.Mirror(self.local_dir, run_dir, interval_s=sync_s)
            self._mirror.pull(self.METRICS)
            self._mirror.pull(self.COMPLETIONS)
            log.info("logs of %s are written to %s and copied up", run_dir, self.local_dir)
        self.metrics_path = os.path.join(self.local_dir, self.METRICS)
        self.completions_path = os.path.join(self.local_dir, self.COMPLETIONS)
        self.tb_dir = os.path.join(self.local_dir, "tb")

    def append(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.sync()

    def append_completions(self, rows: list[dict]) -> None:
        """Sampled completions, one JSON object per line (prompt, completion, reward parts, advantage)."""
        if not self.enabled or not rows:
            return
        with open(self.completions_path, "a") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def truncate_after(self, step: int) -> None:
        """A resumed run: drop the log lines of steps after `step` (the checkpoint it resumes from), which
        the killed run wrote before it could save, so a reader never sees a step twice."""
        if not self.enabled:
            return
        for path in (self.metrics_path, self.completions_path):
            if not os.path.exists(path):
                continue
            with open(path) as f:
                lines = f.readlines()
            keep = []
            for line in lines:
                try:
                    if int(json.loads(line).get("step", 0)) > step:
                        continue
                except (ValueError, AttributeError):
                    continue  # a line cut by the kill
                keep.append(line if line.endswith("\n") else line + "\n")
            if len(keep) != len(lines):
                atomic_write_text(path, "".join(keep))
        self.sync(force=True)

    def reset(self) -> None:
        """A fresh run: drop the metrics of an earlier run in the same dir."""
        if not self.enabled:
            return
        for name, path in ((self.METRICS, self.metrics_path), (self.COMPLETIONS, self.completions_path)):
            if self._mirror is not None:
                self._mirror.delete(name)
            elif os.path.exists(path):
                os.remove(path)

    def sync(self, force: bool = False) -> None:
        if self._mirror is None:
            return
        try:
            self._mirror.sync(force)
        except Exception as e:  # a failed log upload must not end a run (nor hang the other processes)
            log.warning("could not copy the logs in %s up to %s (%s: %s); the next sync retries",
                        self.local_dir, self._mirror.url, type(e).__name__, e)


# ----------------------------------------------------------------------------- writers


class NullWriter:
    """The SummaryWriter calls the trainer makes, doing nothing (processes other than 0)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "grpo", unit: str = "step"):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit=unit, dynamic_ncols=True)


def completion_markdown(r: dict) -> str:
    """One completion record as TensorBoard text (markdown): the prompt's tail, the completion, its scores."""
    fence = lambda t: "```\n" + t.replace("```", "` ` `") + "\n```"
    scores = ", ".join(f"{k} {v:.3g}" for k, v in r["rewards"].items())
    return (f"**reward {r['reward']:.3g}** ({scores}), advantage {r['advantage']:.3g}, {r['tokens']} tokens"
            f"{' (truncated)' if r['truncated'] else ''}, answer `{r['answer']}`\n\n"
            f"{fence(r['prompt'][-500:])}\n\n{fence(r['completion'])}")
