"""axgen.runtime is a library the programs call: it stands apart from the compiler, and refuses a program it
cannot run. (That a changed runtime changes no program is tests/test_wheel.py's, on an installed copy.)"""

import contextlib

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


def test_the_runtime_imports_nothing_of_the_compiler_and_a_program_used_from_python_compiles_once():
    """A training host needs jax, optax, orbax, numpy and tensorboardX, not the compiler's dependencies. And a
    program imported in a fresh interpreter (as README's "Using an emitted program from Python" does) has its
    runtime imported whole before its first trace: splash's import adds Pallas's flags to jax's trace context, and
    imported mid-trace it made jit compile the same forward again at its second call."""
    probe = (
        "import sys, importlib.util, jax, jax.numpy as jnp, axgen.runtime.run;"
        f"spec = importlib.util.spec_from_file_location('program', {str(TINY_CPU_1)!r});"
        "program = importlib.util.module_from_spec(spec); spec.loader.exec_module(program);"
        "forward, params = jax.jit(program.forward), program.init_params(jax.random.key(0));"
        "[forward(params, jnp.zeros((1, 8), jnp.int32)).block_until_ready() for _ in range(2)];"
        f"print(sorted(m for m in sys.modules if m.startswith({COMPILER_MODULES!r})), forward._cache_size())"
    )
    result = python_result("-c", probe)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]", "1"]


def test_a_program_of_another_axgen_is_refused_in_one_line(tmp_path):
    program = tmp_path / "old.py"
    source = TINY_CPU_1.read_text()
    assert source.count('AXGEN_VERSION = "') == 1
    program.write_text(source.replace('AXGEN_VERSION = "', 'AXGEN_VERSION = "0.1.0"  # was "', 1))
    result = python_result(program, "--data", tmp_path, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "was built by axgen 0.1.0" in result.stderr and "# Regenerate: axgen build ...`" in result.stderr
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
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import MeshRule\n"
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


@pytest.mark.parametrize(
    ("base", "mesh"),
    [
        ("llama_tiny", {"data": 4, "fsdp": 2}),
        # Beside a model axis the passes meet once each (XLA could not partition the replicas' shard_map there):
        # the same values, and a step that compiles.
        ("llama_tiny", {"data": 2, "fsdp": 2, "model": 2}),
        # Without experts the expert axis splits the batch and, as in MaxText, the weights' embed: one more fsdp
        # axis, not a replica axis. (Slow tier: its program is the first mesh's with one more fsdp axis.)
        pytest.param("llama_tiny", {"data": 2, "fsdp": 2, "expert": 2}, marks=pytest.mark.slow),
    ],
)
def test_replicas_sum_their_own_passes_and_the_step_equals_one_pass_over_the_batch(base, mesh, tmp_path):
    """On a mesh of data replicas x fsdp shards, 2 or more passes a step: each replica accumulates its own passes'
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
        f"from axgen.specs.{base} import spec as tiny\nfrom axgen.spec import MeshRule\n"
        f"spec = tiny.replace(mesh_rules=[MeshRule('cpu-8', {mesh!r}, microbatch=1, "
        "why='two passes of one sequence per device')])\n"
    )
    write_atomically(tmp_path / "program.py", build(spec, "cpu-8").source)
    module = load_program(tmp_path / "program.py")
    program = Program.from_module(module)
    assert program.accumulation_steps(16) >= 2
    assert replica_axes(module.LOGICAL_AXIS_RULES, dict(program.mesh_shape)) == ("data",)
    params = jax.jit(program.init_params)(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 256, (16, 129)).astype(np.int32)
    batch = (tokens, np.ones_like(tokens), np.ones_like(tokens))
    expected = jax.jit(jax.value_and_grad(module.loss_fn, has_aux=True))(params, *batch)

    mesh = program.make_mesh(jax.devices()[:8])
    with jax.set_mesh(mesh):
        step = jax.jit(
            lambda p, b: gradients(
                module.loss_fn, {"params": p}, b, module.MICROBATCH, module.PARAMS, module.LOGICAL_AXIS_RULES
            )
        )
        got = step(params, batch)
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
    "tied, soft_cap, vocab", [(False, None, 1012), (True, 5.0, 1012), (False, 5.0, 72), (True, None, 72)]
)
def test_the_fused_head_and_cross_entropy_equals_optax_on_the_logits_on_a_vocab_sharded_mesh(
    tied, soft_cap, vocab
):
    """Value, and gradient w.r.t. the hidden states and the head's weight, under a loss mask, against optax on the
    whole float32 logits; 37 positions in chunks of 8 (the last padded), on one device and on a CPU mesh that
    shards the vocabulary over `model` and the batch over `data`. With 1012 columns the backward pass goes through
    the vocabulary (a device's 148 or 74 positions are fewer than its 1012 or 253 columns), in 5 runs of 203 or
    51, so its last run overlaps the one before; with 72, through the positions."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from axgen.runtime.losses import lm_head_cross_entropy

    rules = {"batch": ("data",), "seq": (), "embed": (), "vocab": ("model",)}
    keys = jax.random.split(jax.random.key(1), 4)
    hidden = jax.random.normal(keys[0], (4, 37, 64))
    w = jax.random.normal(keys[1], (vocab, 64) if tied else (64, vocab)) * 0.5
    labels = jax.random.randint(keys[2], (4, 37), 0, vocab)
    mask = jax.random.bernoulli(keys[3], 0.7, (4, 37))  # targets a loss mask leaves out get no gradient

    def optax_form(hidden, w):
        logits = jnp.einsum("bse,ve->bsv" if tied else "bse,ev->bsv", hidden, w)
        logits = logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def fused(hidden, w):
        return lm_head_cross_entropy(hidden, w, labels, chunk=8, rules=rules, tied=tied, soft_cap=soft_cap)

    def masked_mean(loss):
        return jax.jit(
            jax.value_and_grad(lambda h, w: jnp.sum(loss(h, w) * mask) / mask.sum(), argnums=(0, 1))
        )

    expected_losses = optax_form(hidden, w)
    expected, (expected_dh, expected_dw) = masked_mean(optax_form)(hidden, w)
    np.testing.assert_allclose(fused(hidden, w), expected_losses, rtol=1e-5, atol=1e-5)
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )  # as programs make it
    w_spec = P("model", None) if tied else P(None, "model")
    for sharded in (False, True):
        h, weight = hidden, w
        if sharded:
            h = jax.device_put(hidden, NamedSharding(mesh, P("data")))
            weight = jax.device_put(w, NamedSharding(mesh, w_spec))
        with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
            value, (dh, dw) = masked_mean(fused)(h, weight)
        np.testing.assert_allclose(value, expected, rtol=1e-5)
        np.testing.assert_allclose(dh, expected_dh, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(dw, expected_dw, rtol=1e-4, atol=1e-6)
        assert not np.any(np.asarray(dh)[~np.asarray(mask)])
        if sharded:
            assert dw.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2)  # sharded as the weight


def test_the_fused_head_and_cross_entropy_never_holds_the_whole_logits():
    """A language-model head's step with bf16 hidden states and weight: the bf16 logits [8, 1024, 32768] are 512
    MiB and the logits form's temporaries exceed them; in chunks of 64 positions, and in the backward pass runs of
    2048 columns, the step holds a chunk's or a run's float32 logits (64 MiB) at a time, under 192 MiB."""
    import jax
    import jax.numpy as jnp

    from axgen.runtime.losses import cross_entropy, lm_head_cross_entropy

    x, w = jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16), jax.ShapeDtypeStruct(
        (256, 32768), jnp.bfloat16
    )
    tokens = jax.ShapeDtypeStruct((8, 1024), jnp.int32)
    rules = {"batch": (), "seq": (), "embed": (), "vocab": ()}

    def temporaries(loss):
        step = jax.jit(jax.grad(lambda x, w, labels: loss(x, w, labels).mean(), argnums=(0, 1)))
        return step.lower(x, w, tokens).compile().memory_analysis().temp_size_in_bytes

    fused = temporaries(lambda x, w, labels: lm_head_cross_entropy(x, w, labels, chunk=64, rules=rules))
    on_logits = temporaries(lambda x, w, labels: cross_entropy(x @ w, labels))
    assert on_logits > 512 * 2**20
    assert fused < 192 * 2**20, (fused, on_logits)


def test_the_fused_head_moves_the_weight_and_its_gradient_once_a_pass_not_once_a_chunk():
    """On 8 devices that split the rows and the head's embed dimension (FSDP), a step of the fused head in chunks
    of 8 positions moves what one chunk of all 64 does: the weight gathered once each way and its gradient reduced
    once (hlo_cost counts a loop body's collectives as often as it runs). Per chunk it would be 8 times that.
    And it holds no device's float32 partial of the whole weight's gradient beside the gathered weight (the weight
    size again): each run of vocabulary columns is reduced into the weight's shards as it completes."""
    import jax
    import jax.numpy as jnp

    from axgen.analysis.hlo_cost import hlo_cost
    from axgen.runtime.losses import lm_head_cross_entropy

    rules = {"batch": ("fsdp",), "seq": (), "embed": ("fsdp",), "vocab": ()}
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))  # as programs make it
    x = jax.ShapeDtypeStruct((8, 64, 128), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("fsdp")))
    w = jax.ShapeDtypeStruct((128, 4096), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("fsdp")))
    labels = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P("fsdp")))

    def moved(chunk):
        loss = lambda x, w, y: lm_head_cross_entropy(x, w, y, chunk=chunk, rules=rules).mean()
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, labels).compile()
        collectives = sum(hlo_cost(compiled.as_text()).collective_bytes.values())
        return collectives, compiled.memory_analysis().temp_size_in_bytes

    weight = 128 * 4096 * 4
    (in_chunks, temporaries), (whole, _) = moved(8), moved(64)
    assert in_chunks == whole and whole < 4 * weight, (in_chunks, whole, weight)
    assert weight < temporaries < 1.5 * weight, (temporaries, weight)


def test_a_program_trains_on_the_cross_entropy_of_its_own_logits(tmp_path):
    """The emitted loss (the head fused with the cross-entropy, soft-capped logits, on cpu-8's mesh, which shards
    the vocabulary over `model`) equals optax on the logits `forward` returns, in value and gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axgen.runtime.program import Program
    from tests.test_mesh_rules import tiny_program_with

    program = tiny_program_with(tmp_path, "F.softcap(final=3.0)", "cpu-8")
    assert "# Loss: runtime.lm_head_cross_entropy" in (tmp_path / "variant_cpu_8.py").read_text()
    assert program.LOGICAL_AXIS_RULES["vocab"] == ("model",) and program.MESH_SHAPE["model"] == 2
    params = program.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, program.CONFIG["vocab_size"])
    ones = jnp.ones_like(tokens)

    def emitted(params):
        return program.target_losses(params, tokens, ones, ones)[0].mean()

    def on_logits(params):
        logits = program.forward(params, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    with jax.set_mesh(Program.from_module(program).make_mesh()):
        (value, grads), (expected, expected_grads) = (
            jax.jit(jax.value_and_grad(loss))(params) for loss in (emitted, on_logits)
        )
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-6), grads, expected_grads)


def test_every_name_a_program_reads_from_the_runtime_is_what_it_names():
    """The runtime imports its names lazily; a submodule of the same name as one (runtime.rope once was both)
    would shadow it once imported."""
    import importlib
    import pkgutil
    import types

    from axgen import runtime

    for module in pkgutil.iter_modules(runtime.__path__):
        importlib.import_module(f"axgen.runtime.{module.name}")
    for name in runtime.__all__:
        assert not isinstance(getattr(runtime, name), types.ModuleType), name
