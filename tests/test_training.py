"""The emitted CPU program trains on 8 fake devices, resumes exactly, and shards without changing results."""

import jax
import numpy as np
from tests.conftest import ROOT, train

from axgen.interop import load_program

CPU_8 = ROOT / "generated/llama_tiny/cpu_8.py"


def test_loss_falls_and_resume_matches_uninterrupted_run(corpus, tmp_path):
    uninterrupted = train(CPU_8, corpus, tmp_path / "a", 20)
    first_half = train(CPU_8, corpus, tmp_path / "b", 8)
    second_half = train(CPU_8, corpus, tmp_path / "b", 20)

    assert sorted(uninterrupted) == list(range(1, 21))
    assert uninterrupted[20] < uninterrupted[1] - 1.5, uninterrupted
    assert sorted(second_half) == list(range(9, 21)), "the second run must resume at step 9"
    np.testing.assert_allclose(
        [second_half[s] for s in range(9, 21)], [uninterrupted[s] for s in range(9, 21)], rtol=1e-6
    )
    np.testing.assert_allclose([first_half[s] for s in range(1, 9)], [uninterrupted[s] for s in range(1, 9)])


def test_sharded_forward_equals_single_device_forward():
    program = load_program(CPU_8)
    params = program.init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (8, 32), 0, 256)
    single = program.forward(params, tokens)

    mesh = program.make_mesh()
    assert mesh.devices.size == 8
    with jax.set_mesh(mesh):
        sharded_params = jax.device_put(params, program.param_shardings(mesh))
        assert not sharded_params["layers"]["wq"].sharding.is_fully_replicated
        sharded = jax.jit(program.forward)(sharded_params, tokens)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)
