"""PTQ sharded over the host's chips (lrmq.ptq.shard): units, their order, and 1 vs 4 vs 8 devices."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_with_devices

from lrmq.ptq.shard import UnitRunner, ordered_sum, ptq_mesh, unit_size


def test_units_are_a_fixed_cut_of_the_blocks():
    assert [unit_size(n, 8) for n in (128, 12, 7, 3, 1)] == [8, 6, 7, 3, 1]
    with pytest.raises(ValueError, match="mesh.devices=2: this host has 1 local cpu device"):
        ptq_mesh(2)


def _tokens_sum(x):
    return jnp.sum(x, axis=(0, 1))


def test_runner_maps_units_in_order_and_sums_them_in_that_order():
    x = np.arange(5 * 3 * 2, dtype=np.float32).reshape(5, 3, 2) ** 1.5
    runner = UnitRunner.for_blocks(ptq_mesh(1), 5, 2)  # 5 blocks: units of 1 (the largest divisor <= 2)
    assert (runner.size, runner.units) == (1, 5)
    parts = list(runner.map(_tokens_sum, (), (x,)))
    np.testing.assert_array_equal(np.stack(parts), x.sum(axis=1))
    np.testing.assert_array_equal(runner.sum(_tokens_sum, (), (x,)), ordered_sum(parts))
    np.testing.assert_array_equal(runner.concat(lambda a: a * 2, (), (x,)), x * 2)
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = acc + p
    np.testing.assert_array_equal(ordered_sum(parts), acc)  # ((p0 + p1) + p2) + ...


def test_one_four_and_eight_devices_give_identical_bytes(tmp_path):
    """AWQ (W3 g32, the clip search's column chunks over the chips) and GPTQ on the tiny model: every code, scale,
    zero, quantized weight and exported compressed-tensors byte is the same on 1, 4 and 8 devices."""
    res = run_with_devices("scripts/ptq_devices.py", str(tmp_path), n_devices=8)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for method in ("awq", "gptq"):
        assert report[method]["items"] > 50  # 14 packed Linears x 3 arrays, the layer weights, the files
        assert report[method]["differ"] == {"4": [], "8": []}, report
