"""Run checkpoints: model/optimizer pytrees (orbax, sharded) plus JSON metadata (step, data iterator)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

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
