"""Rollouts sampled ahead of the learner, kept in a checkpoint's JSON metadata so that a resumed asynchronous run
continues exactly where the uninterrupted one would (`lrmq.rl.loop`): each rollout's batch arrays (one compressed
npz, base64), its statistics, completion records, data batch, index and version."""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np

from lrmq.rl.batch import RolloutBatch
from lrmq.rl.messages import Rollout


def pending_to_meta(rollouts) -> list[dict]:
    out = []
    for r in rollouts:
        buf = io.BytesIO()
        arrays = {f.name: getattr(r.batch, f.name) for f in dataclasses.fields(RolloutBatch)}
        np.savez_compressed(buf, **{k: v for k, v in arrays.items() if v is not None})  # experts: replay only
        out.append({"index": r.index, "version": r.version, "reward_failed": r.reward_failed, "stats": r.stats,
                    "completions": r.completions, "prompts": r.prompts,
                    "batch": base64.b64encode(buf.getvalue()).decode("ascii")})
    return out


def pending_from_meta(entries: list[dict]) -> list[Rollout]:
    out = []
    for e in entries:
        with np.load(io.BytesIO(base64.b64decode(e["batch"]))) as z:
            batch = RolloutBatch(**{f.name: z[f.name] for f in dataclasses.fields(RolloutBatch) if f.name in z})
        out.append(Rollout(batch, dict(e["stats"]), list(e["completions"]), bool(e["reward_failed"]),
                           index=int(e["index"]), version=int(e["version"]), prompts=dict(e["prompts"])))
    return out
