"""The Sampler / Learner split (lrmq.rl.sampler, lrmq.rl.learner) and the loop between them (lrmq.rl.loop,
lrmq.rl.trainer): the default (colocated, max_staleness 0) reproduces the synchronous trainer it replaced; the
schedule, the stream and its thread are host logic, tested with fakes and no model."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from sync_golden import GOLDEN, fingerprint, golden_config


def test_the_default_loop_reproduces_the_synchronous_trainer(tmp_path):
    """2 steps of the tiny model, colocated and on-policy: the same completions (texts, rewards, advantages, token
    counts: a sha256) and the same train/* and reward/* metrics as GRPOTrainer at 6576fb1, before the split
    (tests/data/sync_golden.json; exact floats)."""
    from lrmq.rl.trainer import GRPOTrainer

    GRPOTrainer(golden_config(str(tmp_path))).train()
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert fingerprint(str(tmp_path)) == golden
