"""MoE.routed_scale (DeepSeek's routed_scaling_factor): the routed experts' weights, so their output, multiplied."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from axgen import runtime
from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.export import hf_config
from axgen.interop import CheckpointError, load_program
from axgen.loader import load_spec
from axgen.spec import SpecError
from tests.conftest import moe_options


def moe_tiny_with(tmp_path, routed_scale):
    spec = tmp_path / "specs" / "scaled.py"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(
        "from axgen.specs.moe_tiny import spec as tiny\n"
        f"moe = tiny.feature('moe').replace(routed_scale={routed_scale!r})\n"
        "spec = tiny.replace(features=[moe if f.pass_name == 'moe' else f for f in tiny.features])\n"
    )
    return spec


def test_the_routed_weights_are_scaled_and_the_losses_are_not(tmp_path):
    logits = jax.random.normal(jax.random.key(0), (2, 16, 4))
    routes = []
    for routed_scale in (None, 2.5):
        spec = moe_tiny_with(tmp_path, routed_scale)
        program = tmp_path / f"program_{routed_scale}.py".replace(".5", "_5")
        write_atomically(program, build(spec, "cpu-1").source)
        routes.append(runtime.route(logits, moe_options(load_program(program))["routing"]))
    (plain, experts, losses), (scaled, scaled_experts, scaled_losses) = routes
    np.testing.assert_array_equal(experts, scaled_experts)
    np.testing.assert_allclose(scaled, 2.5 * plain, rtol=1e-6)
    for name in losses:
        np.testing.assert_array_equal(losses[name], scaled_losses[name])


def test_a_routed_scale_that_cannot_be_is_one_line(tmp_path):
    with pytest.raises(SpecError, match=r"MoE.routed_scale=0.0 must be > 0$"):
        load_spec(moe_tiny_with(tmp_path, 0.0))


def test_export_refuses_a_routed_scale_no_exported_family_states(tmp_path):
    with pytest.raises(CheckpointError, match=r"MoE.routed_scale=2.5: no family axgen exports scales"):
        hf_config(load_spec(moe_tiny_with(tmp_path, 2.5)), "float32")
