"""axgen.runtime is a library the programs call: it stands apart from the compiler, and refuses a program it
cannot run. (That a changed runtime changes no program is tests/test_wheel.py's, on an installed copy.)"""

import pytest
from tests.conftest import ROOT, python_result

TINY_CPU_1 = ROOT / "generated/llama_tiny/cpu_1.py"
COMPILER_MODULES = (
    "axgen.codegen",
    "axgen.ir",
    "axgen.passes",
    "axgen.backends",
    "axgen.spec",
    "jinja2",
    "libcst",
)


def test_the_runtime_imports_nothing_of_the_compiler():
    """A training host needs jax, optax, orbax, numpy and tensorboardX, not the compiler's dependencies."""
    probe = (
        "import sys, axgen.runtime, axgen.runtime.run;"
        f"print(sorted(m for m in sys.modules if m.startswith({COMPILER_MODULES!r})))"
    )
    result = python_result("-c", probe)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_program_of_another_axgen_is_refused_in_one_line(tmp_path):
    program = tmp_path / "old.py"
    source = TINY_CPU_1.read_text()
    assert source.count('AXGEN_VERSION = "') == 1
    program.write_text(source.replace('AXGEN_VERSION = "', 'AXGEN_VERSION = "0.1.0"  # was "', 1))
    result = python_result(program, "--data", tmp_path, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "was built by axgen 0.1.0" in result.stderr and "rebuild it with `axgen build`" in result.stderr
    assert not (tmp_path / "run").exists()


def test_evaluation_runs_in_the_train_steps_microbatches_and_fits_where_one_pass_would_not(
    tmp_path, monkeypatch
):
    """eval_step sums the cross-entropy over passes of MICROBATCH sequences: the loss of one pass over the batch,
    at a fraction of its peak, so a device budget that one pass exceeds still evaluates; run's fit check compiles
    the eval step too and names it when it does not fit."""
    import jax
    import numpy as np

    from axgen.build import build
    from axgen.files import write_atomically
    from axgen.interop import load_program
    from axgen.runtime import run
    from axgen.runtime.program import Program

    spec = tmp_path / "accumulating.py"
    spec.write_text(
        "from specs.llama_tiny import spec as tiny\nfrom axgen.spec import MeshRule\n"
        "spec = tiny.replace(train=tiny.train.replace(global_batch=32), mesh_rules=[MeshRule('cpu-1', "
        "{'data': 1}, microbatch=4, why='eight microbatches of four sequences')])\n"
    )
    write_atomically(tmp_path / "program.py", build(spec, "cpu-1").source)
    module = load_program(tmp_path / "program.py")
    program = Program.from_module(module)
    assert module.MICROBATCH == 4 and program.accumulation_steps(32) == 8
    mesh = program.make_mesh(jax.devices()[:1])
    params = jax.jit(program.init_params)(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 512, (32, 129)).astype(np.int32)
    segments = np.repeat(np.arange(1, 5), [40, 30, 30, 29])[None].repeat(32, 0).astype(np.int32)
    every_token = np.ones_like(tokens)
    sums = jax.jit(module.eval_step)(params, tokens, segments, every_token)
    one_pass = jax.jit(module.eval_sums)(params, tokens, segments, every_token)
    assert int(sums["targets"]) == int(one_pass["targets"]) == 32 * 125
    np.testing.assert_allclose(float(sums["loss_sum"]), float(one_pass["loss_sum"]), rtol=1e-5)

    _, microbatched_peak = program.compile_eval_step(mesh, 32)
    monkeypatch.setattr(module, "eval_step", module.eval_sums)
    _, one_pass_peak = Program.from_module(module).compile_eval_step(mesh, 32)
    assert microbatched_peak < one_pass_peak / 2, (microbatched_peak, one_pass_peak)
    # A device between the two eval peaks; the train step, checked the same way, is not what this test is about.
    budget = (microbatched_peak + one_pass_peak) // 2
    monkeypatch.setattr(run, "device_memory_limit", lambda: budget)
    monkeypatch.setattr(Program, "compile_train_step", lambda self, mesh, batch: ("train step", 0))
    with pytest.raises(SystemExit, match="an evaluation step of llama-tiny at --batch 32 needs"):
        run.compile_checked(Program.from_module(module), mesh, 32, evaluating=True)
    assert run.compile_checked(program, mesh, 32, evaluating=True)[1] is not None


def test_the_cross_entropy_equals_optax_in_value_and_gradient_and_keeps_one_logits_buffer_less():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axgen.runtime.losses import cross_entropy

    def optax_form(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)

    keys = jax.random.split(jax.random.key(0), 3)
    labels = jax.random.randint(keys[1], (4, 16), 0, 1000)
    weights = jax.random.normal(keys[2], (4, 16))
    for dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        logits = (jax.random.normal(keys[0], (4, 16, 1000)) * 3).astype(dtype)
        np.testing.assert_array_equal(cross_entropy(logits, labels), optax_form(logits, labels))
        grads = [
            jax.grad(lambda x: (loss(x, labels) * weights).sum())(logits)
            for loss in (cross_entropy, optax_form)
        ]
        assert grads[0].dtype == dtype
        np.testing.assert_allclose(
            *(np.asarray(g, np.float32) for g in grads), atol=tolerance * 1e-2, rtol=tolerance
        )

    # A language-model head's step: the bf16 logits [4, 512, 32768] are 128 MiB, their float32 copy 256.
    x, w = jax.ShapeDtypeStruct((4, 512, 1024), jnp.bfloat16), jax.ShapeDtypeStruct(
        (1024, 32768), jnp.bfloat16
    )
    tokens = jax.ShapeDtypeStruct((4, 512), jnp.int32)

    def temporaries(loss):
        step = jax.jit(jax.grad(lambda x, w, labels: loss(x @ w, labels).mean(), argnums=(0, 1)))
        return step.lower(x, w, tokens).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(optax_form) - temporaries(cross_entropy) >= 128 * 2**20


def test_replicas_sum_their_own_passes_and_the_step_equals_one_pass_over_the_batch(tmp_path):
    """On a mesh of 4 data replicas x 2 fsdp shards, 2 passes a step: each replica accumulates its own passes'
    gradients (runtime.gradients' shard_map over `data`) and the replicas meet once. Loss, metrics and every
    gradient equal value_and_grad of the loss over the whole batch in one pass on one device."""
    import jax
    import numpy as np

    from axgen.build import build
    from axgen.files import write_atomically
    from axgen.interop import load_program
    from axgen.runtime import gradients
    from axgen.runtime.program import Program
    from axgen.runtime.sharding import replica_axes

    spec = tmp_path / "replicas.py"
    spec.write_text(
        "from specs.llama_tiny import spec as tiny\nfrom axgen.spec import MeshRule\n"
        "spec = tiny.replace(mesh_rules=[MeshRule('cpu-8', {'data': 4, 'fsdp': 2}, microbatch=1, "
        "why='two passes of one sequence per device')])\n"
    )
    write_atomically(tmp_path / "program.py", build(spec, "cpu-8").source)
    module = load_program(tmp_path / "program.py")
    program = Program.from_module(module)
    assert program.accumulation_steps(16) == 2
    assert replica_axes(module.LOGICAL_AXIS_RULES, dict(program.mesh_shape)) == ("data",)
    params = jax.jit(program.init_params)(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 256, (16, 129)).astype(np.int32)
    batch = (tokens, np.ones_like(tokens), np.ones_like(tokens))
    expected = jax.jit(jax.value_and_grad(module.loss_fn, has_aux=True))(params, *batch)

    mesh = program.make_mesh(jax.devices()[:8])
    with jax.set_mesh(mesh):
        step = jax.jit(
            lambda p, b: gradients(
                module.loss_fn, p, b, module.MICROBATCH, module.PARAMS, module.LOGICAL_AXIS_RULES
            )
        )
        got = step(params, batch)
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=2e-5, atol=1e-7)
