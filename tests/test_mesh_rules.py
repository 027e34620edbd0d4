"""Mesh rules and their modifiers: a spec's rules come first, backends' defaults follow; gradient accumulation
equals the one-pass step; the TPU splash kernel equals XLA attention; multi-slice targets split `data`."""

import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from axgen.backends import plan_for
from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.loader import load_spec
from axgen.spec import MeshRule, Remat
from tests.conftest import ROOT
from axgen.runtime.attention import causal_attention
from axgen.runtime.program import Program
from axgen.runtime.run import parse_args
from axgen.runtime.sharding import logical_to_mesh
from axgen.runtime.training import BatchSplitError, accumulation_steps

TINY = ROOT / "axgen/specs/llama_tiny.py"


def tiny_with(tmp_path, name, rules: str, features: str = "tiny.features"):
    """llama_tiny with `rules` prepended; a spec file in a specs/ folder so the program's provenance is stable."""
    path = tmp_path / "specs" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        "from axgen.spec import MeshRule, Remat\nfrom axgen.spec import features as F\n"
        "from axgen.specs.llama_tiny import spec as tiny\n"
        f"spec = tiny.replace(mesh_rules=[{rules}], features={features})\n"
    )
    return path


def program_for(tmp_path, spec_path, target):
    out = tmp_path / f"{spec_path.stem}_{target.replace('-', '_')}.py"
    write_atomically(out, build(spec_path, target).source)
    return load_program(out)


def test_backend_defaults_for_a_7b_model():
    llama2 = load_spec(ROOT / "axgen/specs/llama2_7b.py")
    v5e = plan_for(llama2, "tpu-v5e-256")
    assert dict(v5e.mesh) == {"data": 1, "stage": 1, "fsdp": 256, "expert": 1, "context": 1, "model": 1}
    assert v5e.remat.policy == "offload_dots" and v5e.microbatch == 1 and v5e.grad_accum_steps == 4
    assert v5e.attention == "splash" and v5e.attention_block == 512 and v5e.num_hosts == 64
    assert v5e.flags_variable == "LIBTPU_INIT_ARGS" and v5e.topology == "v5e:16x16"
    h100 = plan_for(llama2, "gpu-h100-8")
    assert dict(h100.mesh)["fsdp"] == 8 and h100.attention == "cudnn" and h100.topology == "1x1x8"
    trn2 = plan_for(llama2, "trn2-16")
    assert (
        dict(trn2.mesh) == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "context": 1, "model": 4}
        and trn2.topology is None
    )
    llama3_8b = load_spec(ROOT / "axgen/specs/llama3_8b.py")
    assert dict(plan_for(llama3_8b, "gpu-h100-64").mesh) == {
        "data": 8,
        "stage": 1,
        "fsdp": 8,
        "expert": 1,
        "context": 1,
        "model": 1,
    }
    v5p = plan_for(llama3_8b, "tpu-v5p-128")
    assert dict(v5p.mesh)["fsdp"] == 128 and v5p.microbatch == 2 and v5p.grad_accum_steps == 2
    assert v5p.remat.policy == "save_dots" and v5p.xla_flags == ()
    llama3_70b = load_spec(ROOT / "axgen/specs/llama3_70b.py")
    v5p_512 = plan_for(llama3_70b, "tpu-v5p-512")
    assert dict(v5p_512.mesh) == {"data": 8, "stage": 1, "fsdp": 64, "expert": 1, "context": 1, "model": 1}
    assert v5p_512.remat.policy == "full" and v5p_512.rule.origin.file == "specs/llama3_70b.py"
    # The 70B spec's own rule comes first: its weights need every GPU's memory.
    assert dict(plan_for(llama3_70b, "gpu-h100-64").mesh) == {
        "data": 1,
        "stage": 1,
        "fsdp": 64,
        "expert": 1,
        "context": 1,
        "model": 1,
    }


def test_multi_slice_target_puts_slices_on_data():
    plan = plan_for(load_spec(ROOT / "axgen/specs/llama2_7b.py"), "tpu-v5e-256x2")
    assert dict(plan.mesh) == {"data": 2, "stage": 1, "fsdp": 256, "expert": 1, "context": 1, "model": 1}
    assert dict(plan.dcn_mesh) == {"data": 2, "stage": 1, "fsdp": 1, "expert": 1, "context": 1, "model": 1}
    assert plan.num_devices == 512 and plan.num_hosts == 128 and plan.grad_accum_steps == 2
    source = (ROOT / "generated/llama_tiny/tpu_v5e_4x2.py").read_text()
    assert (
        'DCN_MESH_SHAPE = {"data": 2, "stage": 1, "fsdp": 1, "expert": 1, "context": 1, "model": 1}' in source
    )
    program = Program.from_module(load_program(ROOT / "generated/llama_tiny/tpu_v5e_4x2.py"))
    assert dict(program.make_mesh().shape) == {
        "data": 2,
        "stage": 1,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
    }


def test_devices_of_several_slices_form_a_hybrid_mesh_with_slices_on_data(monkeypatch):
    """On a multi-slice job (devices with a slice_index) the runtime lays each slice's devices out as the program's
    mesh over one slice, and the slices along `data` (DCN_MESH_SHAPE)."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils

    program = Program.from_module(load_program(ROOT / "generated/llama_tiny/tpu_v5e_4x2.py"))
    asked = []

    def hybrid(per_slice, across_slices, devices):
        asked.append((per_slice, across_slices, [d.slice_index for d in devices]))
        return np.array(jax.devices()).reshape(2, 1, 4, 1, 1, 1)

    monkeypatch.setattr(mesh_utils, "create_hybrid_device_mesh", hybrid)
    sliced = [type("SlicedDevice", (), {"slice_index": i // 4})() for i in range(8)]
    assert dict(program.make_mesh(sliced).shape) == {
        "data": 2,
        "stage": 1,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
    }
    assert asked == [([1, 1, 4, 1, 1, 1], [2, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])]


def test_spec_rules_come_before_the_backends(tmp_path):
    rule = 'MeshRule(r"cpu-8", {"data": 4, "model": 2}, why="spec says", microbatch=1, remat=Remat(policy="full"))'
    plan = plan_for(load_spec(tiny_with(tmp_path, "ruled", rule)), "cpu-8")
    assert dict(plan.mesh) == {"data": 4, "stage": 1, "fsdp": 1, "expert": 1, "context": 1, "model": 2}
    assert plan.rule.origin.file == "specs/ruled.py" and plan.grad_accum_steps == 4
    assert plan.remat.policy == "full"
    unmatched = plan_for(load_spec(tiny_with(tmp_path, "ruled", rule)), "cpu-1")
    assert unmatched.rule.why == "one device: the unsharded reference run"


def test_a_rule_can_choose_the_xla_attention_on_tpu(tmp_path):
    spec = tiny_with(
        tmp_path, "xla_on_tpu", 'MeshRule(r"tpu-.*", {"fsdp": -1}, why="compare", attention="xla")'
    )
    source = build(spec, "tpu-v5e-8").source
    assert 'ATTENTION_IMPL = "xla"' in source and "splash" not in source
    assert "implementation=ATTENTION_IMPL" in source and "block=SPLASH_BLOCK" not in source


@pytest.mark.parametrize(
    ("rule", "target", "message"),
    [
        (
            'MeshRule(r"cpu-8", {"fsdp": 3}, why="x")',
            "cpu-8",
            "MeshRule.mesh={'fsdp': 3} (pattern 'cpu-8') does not fit the 8 devices of target cpu-8",
        ),
        (
            'MeshRule(r"cpu-1", {}, why="x", microbatch=3)',
            "cpu-1",
            "MeshRule.microbatch=3 does not divide the 16 sequences per device that Train.global_batch=16 gives on "
            "target cpu-1",
        ),
        (
            'MeshRule(r"tpu-v5e-8", {"fsdp": -1}, why="x", attention="cudnn")',
            "tpu-v5e-8",
            "MeshRule.attention='cudnn' is not a kernel of target tpu-v5e-8 (TPU v5e runs splash, xla)",
        ),
        (
            'MeshRule(r"tpu-v5e-8", {"fsdp": -1}, why="x", attention_block=256)',
            "tpu-v5e-8",
            "Train.seq_len=128 is not a multiple of the 256-long blocks of splash attention on target tpu-v5e-8",
        ),
        (
            'MeshRule(r"cpu-8", {"fsdp": -1}, why="x", shard_residual=True)',
            "cpu-8",
            "MeshRule.shard_residual=True (pattern 'cpu-8') on cpu-8: the mesh has model=1",
        ),
        (
            'MeshRule(r"cpu-8", {"data": 2, "fsdp": 2, "model": 2}, why="x", shard_residual=True)',
            "cpu-8",
            "MeshRule.shard_residual=True (pattern 'cpu-8') on cpu-8: the mesh splits the batch over data=2 x "
            "fsdp=2, and XLA's partitioner swaps batch rows",
        ),
        (
            'MeshRule(r"cpu-8", {"fsdp": 2, "expert": 2, "model": 2}, why="x", shard_residual=True)',
            "cpu-8",
            "the mesh splits the batch over fsdp=2 x expert=2",
        ),
    ],
    ids=["mesh", "microbatch", "kernel", "block", "residual", "residual_data_fsdp", "residual_fsdp_expert"],
)
def test_a_rule_that_cannot_apply_is_one_line(tmp_path, rule, target, message):
    with pytest.raises(Exception) as err:
        plan_for(load_spec(tiny_with(tmp_path, "bad_rule", rule)), target)
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1
    assert "specs/" in str(err.value)


def test_rule_fields_are_checked_where_the_rule_is_written():
    with pytest.raises(
        Exception, match=r"MeshRule.mesh=\{'fsdb': 2\} has axis 'fsdb', .* did you mean 'fsdp'\?"
    ):
        MeshRule(r"cpu-8", {"fsdb": 2}, why="typo")
    with pytest.raises(Exception, match=r"MeshRule.attention='flash' is not one of xla, splash, cudnn"):
        MeshRule(r"cpu-8", {}, why="x", attention="flash")
    with pytest.raises(Exception, match=r"MeshRule.memory_fraction=1.5 is not in \(0, 1\]"):
        MeshRule(r"gpu-.*", {}, why="x", memory_fraction=1.5)
    with pytest.raises(
        Exception, match=r"MeshRule.moe_dispatch='ragged' is not one of all_gather, all_to_all"
    ):
        MeshRule(r"tpu-.*", {"expert": 4}, why="x", moe_dispatch="ragged")
    with pytest.raises(
        Exception, match=r"MeshRule.stack_cast='before' is not one of per_layer, before_layers; did you mean"
    ):
        MeshRule(r"tpu-.*", {}, why="x", stack_cast="before")
    assert MeshRule(r"cpu-8", {}, why="x", remat=Remat(policy="full")).matches("cpu-8")


def test_a_rule_may_give_the_allocator_another_share_and_the_fit_check_follows(tmp_path):
    rule = 'MeshRule(r"gpu-h100-8", {"fsdp": -1}, why="leave room for another process", memory_fraction=0.5)'
    plan = plan_for(load_spec(tiny_with(tmp_path, "half", rule)), "gpu-h100-8")
    assert plan.memory_fraction == 0.5 and plan.usable_bytes == plan.chip.hbm_bytes // 2
    assert plan_for(load_spec(tiny_with(tmp_path, "tpu", rule)), "tpu-v5e-8").usable_bytes == 16 * 1024**3


def test_a_residual_split_over_model_is_the_same_model(tmp_path):
    """MeshRule.shard_residual: the constraints between layers name `residual_embed`, which the rules give
    `model` (so on fsdp=4 x model=2 the residual stream is split 4 x 2, batch by embed), the header says so, and
    the loss and every gradient equal one device's."""
    rule = 'MeshRule(r"cpu-8", {"fsdp": 4, "model": 2}, why="x", shard_residual=True)'
    program = program_for(tmp_path, tiny_with(tmp_path, "residual", rule), "cpu-8")
    source = Path(program.__file__).read_text()
    assert (
        source.count('("batch", "seq", "residual_embed"))') == 3
    )  # the embedding, and each layer's two adds
    assert "residual stream over model (specs/residual.py: mesh rule 'cpu-8')" in source
    assert program.LOGICAL_AXIS_RULES["residual_embed"] == ("model",)
    mesh = jax.make_mesh(
        (1, 1, 4, 1, 1, 2), tuple(program.MESH_SHAPE), axis_types=(jax.sharding.AxisType.Auto,) * 6
    )
    with jax.set_mesh(mesh):
        split = logical_to_mesh(
            program.LOGICAL_AXIS_RULES, ("batch", "seq", "residual_embed"), (8, 16, 128), mesh.shape
        )
    assert split == jax.sharding.PartitionSpec("fsdp", None, "model")

    params = program.init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    grad_fn = jax.value_and_grad(program.loss_fn, has_aux=True)
    (loss, _), grads = jax.jit(grad_fn)(params, tokens)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        (sharded_loss, _), sharded_grads = jax.jit(grad_fn)(placed, tokens)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-6)

    def check(path, grad, expected):
        atol = 1e-5 * float(jnp.abs(expected).max())
        np.testing.assert_allclose(grad, expected, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, sharded_grads, grads)


def test_stacks_cast_before_the_layers_are_the_same_model(tmp_path):
    """MeshRule.stack_cast='before_layers': no layer casts its own params, the whole stacks are cast first (STACKED
    is empty), the program says which rule chose it, and the loss and every gradient are the per-layer program's
    to the bit: the same casts of the same float32 params, made at another time."""
    rule = 'MeshRule(r"cpu-1", {"fsdp": 1}, why="x", stack_cast="before_layers")'
    cast_first = program_for(tmp_path, tiny_with(tmp_path, "cast_first", rule), "cpu-1")
    per_layer = program_for(tmp_path, TINY, "cpu-1")
    source = Path(cast_first.__file__).read_text()
    assert cast_first.STACKED == [] and per_layer.STACKED == ["layers"]
    assert "w.astype(COMPUTE_DTYPE), p)" not in source
    assert "w.astype(COMPUTE_DTYPE), p)" in Path(per_layer.__file__).read_text()
    assert "# cast to COMPUTE_DTYPE · specs/cast_first.py: mesh rule 'cpu-1' · before_layers: " in source

    params = per_layer.init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, 256)
    results = [
        jax.jit(jax.value_and_grad(program.loss_fn, has_aux=True))(params, tokens)
        for program in (per_layer, cast_first)
    ]
    (loss, _), grads = results[0]
    (loss_first, _), grads_first = results[1]
    assert loss_first == loss
    jax.tree.map(np.testing.assert_array_equal, grads_first, grads)
    assert {g.dtype for g in jax.tree.leaves(grads_first)} == {jnp.dtype("float32")}


@pytest.mark.parametrize("batch", [("data", "fsdp"), ("data", "expert"), ("fsdp", "expert")], ids="x".join)
def test_xla_still_swaps_batch_rows_where_a_split_residual_meets_a_batch_split_twice(batch):
    """Why shard_residual is refused where two mesh axes split the batch (backends/common.residual_refused): the
    smallest case of a layer's output projection onto the residual split over model, with the projection's weight
    split over the second of the batch's axes, as the rules give `embed` fsdp and expert. XLA permutes the input's
    batch rows into that axis's order to multiply by the weight gathered over it, and labels the result in the
    batch's order: devices (0, 1) and (1, 0) of the two axes hold each other's rows. When this test fails, XLA
    partitions it right and the refusal can go."""
    mesh = jax.make_mesh((2, 2, 2), (*batch, "model"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    heads = jax.random.normal(jax.random.key(0), (8, 4, 32))  # [batch, heads, head_dim]
    w_out = jax.random.normal(jax.random.key(1), (4, 32, 128))  # [heads, head_dim, embed]

    def project(heads, w_out):
        heads = jax.lax.with_sharding_constraint(heads, P(batch, "model", None))
        return jax.lax.with_sharding_constraint(jnp.einsum("bhd,hde->be", heads, w_out), P(batch, "model"))

    with jax.set_mesh(mesh):
        placed = jax.device_put(w_out, jax.sharding.NamedSharding(mesh, P("model", None, batch[1])))
        split = np.asarray(jax.jit(project)(heads, placed))
    whole = np.asarray(jnp.einsum("bhd,hde->be", heads, w_out))
    wrong = [row for row in range(8) if not np.allclose(split[row], whole[row], atol=1e-3)]
    assert wrong == [2, 3, 4, 5]
    np.testing.assert_allclose(split[[4, 5, 2, 3]], whole[2:6], atol=1e-3)  # the two devices' rows, swapped


def one_step(program, tokens):
    """One train step from the seed-0 state. fp8 amax histories start full (a history of zeros means "use this
    step's amax", which differs per microbatch), so every scale comes from the history, as after the first step.
    """
    state = Program.from_module(program).init_state(jax.random.key(0))
    state["params"] = jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.full_like(p, 4.0) if "amax_history" in jax.tree_util.keystr(path) else p,
        state["params"],
    )
    new_state, metrics = jax.jit(program.train_step)(state, tokens)
    return new_state["params"], metrics


@pytest.mark.parametrize(
    "features",
    [
        pytest.param("tiny.features", id="dense"),
        # slow tier: the quick one keeps test_quantize's delayed scaling and this test's accumulation
        pytest.param(
            '[*tiny.features, F.quantize(dtype="fp8", scaling="delayed", emulate=True)]',
            id="fp8_delayed",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_gradient_accumulation_equals_the_one_pass_step(tmp_path, features):
    rule = 'MeshRule(r"cpu-1", {}, why="four passes of four sequences", microbatch=4)'
    accumulated = program_for(tmp_path, tiny_with(tmp_path, "accumulated", rule, features), "cpu-1")
    one_pass = program_for(tmp_path, tiny_with(tmp_path, "one_pass", "", features), "cpu-1")
    assert accumulated.MICROBATCH == 4 and one_pass.MICROBATCH == 16

    tokens = jax.random.randint(jax.random.key(3), (16, 129), 0, 256)
    params, metrics = one_step(accumulated, tokens)
    expected_params, expected_metrics = one_step(one_pass, tokens)
    np.testing.assert_allclose(metrics["loss"], expected_metrics["loss"], rtol=1e-6)
    # fp8's emulated rounding of each microbatch's gradients adds a little to their norm's error.
    grad_norm_tolerance = 1e-5 if features == "tiny.features" else 5e-5
    np.testing.assert_allclose(metrics["grad_norm"], expected_metrics["grad_norm"], rtol=grad_norm_tolerance)

    def check(path, value, expected):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, params, expected_params)


def test_a_batch_that_does_not_split_into_the_microbatches_is_refused(tmp_path, capsys):
    rule = 'MeshRule(r"cpu-1", {}, why="four passes", microbatch=4)'
    program = program_for(tmp_path, tiny_with(tmp_path, "accumulated", rule), "cpu-1")
    assert (
        parse_args(Program.from_module(program), ["--data", "d", "--run-dir", "c", "--batch", "8"]).batch == 8
    )
    with pytest.raises(SystemExit):
        parse_args(Program.from_module(program), ["--data", "d", "--run-dir", "c", "--batch", "6"])
    assert capsys.readouterr().err.endswith(
        "error: --batch 6: its 6 sequences per device do not split into passes of MICROBATCH=4; use a multiple of "
        "4 sequences\n"
    )


def test_a_larger_batch_keeps_the_rules_pass_and_takes_more_of_them():
    """llama2-7b on tpu-v5e-256: the rule's one sequence per chip per pass, 4 passes at the spec's 1024; --batch 512
    takes 2 passes of the same size, not 4 of half a sequence."""
    program = Program.from_module(load_program(ROOT / "generated/llama2_7b/tpu_v5e_256.py"))
    assert program.microbatch == 1 and program.config["global_batch"] == 1024
    assert [program.accumulation_steps(batch) for batch in (2048, 1024, 512, 256)] == [8, 4, 2, 1]
    with pytest.raises(
        BatchSplitError, match="its 3 sequences per device do not split into passes of MICROBATCH=2"
    ):
        accumulation_steps(3 * 256, 2, program.logical_axis_rules, program.mesh_shape)
    assert parse_args(program, ["--data", "d", "--run-dir", "c", "--batch", "512"]).batch == 512


def tiny_program_with(tmp_path, features: str, target: str, scale: float | None = None):
    """llama_tiny with more features (and an attention scale of its own), built for `target` and imported."""
    spec = tmp_path / "variant.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        f"attention = tiny.decoder.attention.replace(scale={scale!r})\n"
        f"spec = tiny.replace(features=[*tiny.features, {features}], "
        "decoder=tiny.decoder.replace(attention=attention))\n"
    )
    program = tmp_path / f"variant_{target.replace('-', '_')}.py"
    write_atomically(program, build(spec, target).source)
    return load_program(program)


@pytest.mark.parametrize(
    ("window", "softcap", "scale"),
    [
        (None, None, None),
        (64, None, None),
        (None, 2.0, None),
        (64, 2.0, None),
        (None, None, 0.3),
        (64, 2.0, 0.3),
    ],
)
def test_splash_kernel_equals_xla_attention_when_sharded(window, softcap, scale):
    """Splash in interpret mode against XLA: causal, with a sliding window (a local mask), with soft-capped scores
    (the kernel's own cap against the XLA helper the program uses where a kernel has none), with a softmax scale
    other than head_dim**-0.5 (Gemma-2-27B's), each over rows that pack several documents (segment ids into the
    kernel against XLA's dense document mask)."""
    options = {"window": window, "softcap": softcap, "scale": scale, "sinks": None}
    program = load_program(ROOT / "generated/llama_tiny/tpu_v5e_8.py")
    q, k, v = (
        jax.random.normal(key, shape)
        for key, shape in zip(
            jax.random.split(jax.random.key(0), 3), [(8, 256, 4, 32), (8, 256, 2, 32), (8, 256, 2, 32)]
        )
    )

    document_starts = np.random.default_rng(0).random((8, 256)) < 0.02
    segment_ids = jnp.asarray(np.cumsum(document_starts, axis=1) + 1, jnp.int32)
    assert segment_ids[:, -1].min() > 1, "every row packs several documents"

    assert program.ATTENTION_IMPL == "splash"

    def loss(attention, q, k, v):
        return (attention(q, k, v) ** 2).sum()

    xla = functools.partial(
        causal_attention,
        segment_ids=segment_ids,
        implementation="xla" if softcap is None else "xla_ops",
        block=None,
        rules={},
        **options,
    )
    expected = xla(q, k, v)
    expected_grads = jax.grad(functools.partial(loss, xla), argnums=(0, 1, 2))(q, k, v)
    splash = functools.partial(
        causal_attention,
        segment_ids=segment_ids,
        implementation="splash",
        block=program.SPLASH_BLOCK,
        rules=program.LOGICAL_AXIS_RULES,
        interpret=True,
        **options,
    )
    mesh = jax.make_mesh(
        (1, 4, 1, 2), ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    with jax.set_mesh(mesh):
        out = jax.jit(splash)(q, k, v)
        grads = jax.jit(jax.grad(lambda q, k, v: loss(splash, q, k, v), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        np.testing.assert_allclose(grad, expected_grad, atol=1e-4 * float(jnp.abs(expected_grad).max()))


@pytest.mark.parametrize(
    ("target", "features", "implementation"),
    [
        ("cpu-1", "", "ATTENTION_IMPL"),  # xla
        ("gpu-h100-8", "", "ATTENTION_IMPL"),  # cudnn
        ("gpu-h100-8", "F.softcap(attention=2.0)", "'xla_ops'"),  # cuDNN has no soft-cap
        ("tpu-v5e-8", "F.softcap(attention=2.0)", "ATTENTION_IMPL"),  # splash
    ],
)
def test_an_attention_scale_reaches_every_kernel(target, features, implementation, tmp_path, capsys):
    """A spec's own softmax scale is a lowering attr that every kernel's call takes: XLA's, cuDNN's, the
    soft-capped XLA path and splash."""
    spec = tmp_path / "scaled.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "attention = tiny.decoder.attention.replace(scale=144**-0.5)\n"
        f"spec = tiny.replace(features=[*tiny.features, {features}], "
        "decoder=tiny.decoder.replace(attention=attention))\n"
    )
    calls = [
        call
        for call in ast.walk(ast.parse(build(spec, target).source))
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "runtime.causal_attention"
    ]
    assert {ast.unparse(k.value) for call in calls for k in call.keywords if k.arg == "implementation"} == {
        implementation
    }
    scales = [ast.unparse(k.value) for call in calls for k in call.keywords if k.arg == "scale"]
    assert len(scales) == len(calls) and repr(144**-0.5) in scales, scales
    assert axgen(["graph", str(spec), "--target", target, "--after", "lowering"]) == 0
    assert f"scale={144**-0.5!r}" in capsys.readouterr().out


@pytest.mark.parametrize("window", [None, 16])
def test_softcapped_attention_is_attention_when_the_cap_is_far(window):
    """XLA's soft-capped attention (GQA, causal, windowed) with a cap far above every score is plain attention."""
    q, k, v = (
        jax.random.normal(key, s)
        for key, s in zip(
            jax.random.split(jax.random.key(2), 3), [(2, 64, 4, 8), (2, 64, 2, 8), (2, 64, 2, 8)]
        )
    )
    local_window_size = None if window is None else (window - 1, 0)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local_window_size)
    one_document = jnp.ones((2, 64), jnp.int32)
    capped = functools.partial(
        causal_attention,
        implementation="xla_ops",
        block=None,
        rules={},
        window=window,
        scale=None,
        sinks=None,
    )
    got = capped(q, k, v, one_document, softcap=1e4)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    capped = capped(q * 30, k, v, one_document, softcap=1.0)
    assert not np.allclose(capped, jax.nn.dot_product_attention(q * 30, k, v, is_causal=True), atol=1e-2)


def test_final_softcap_caps_the_logits_the_loss_sees(tmp_path):
    capped = tiny_program_with(tmp_path, "F.softcap(final=0.5)", "cpu-1")
    plain = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    params = plain.init_params(jax.random.key(0))
    params["lm_head"] = params["lm_head"] * 50  # logits far beyond the cap
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    logits = plain.forward(params, tokens)
    np.testing.assert_allclose(capped.forward(params, tokens), 0.5 * jnp.tanh(logits / 0.5), atol=1e-6)
    assert float(jnp.abs(capped.forward(params, tokens)).max()) <= 0.5 < float(jnp.abs(logits).max())


def test_a_rules_later_mesh_axes_are_fallbacks_taken_while_they_divide():
    """A dimension takes its rule's axes in order while the product divides it, so fsdp x expert = 128 x 8 shards
    a 7168-wide embed both ways (7 a device) and a 1536-wide latent over fsdp alone (1536 / 1024 is no integer);
    an axis an earlier dimension took is skipped."""
    from axgen.backends.common import LOGICAL_AXIS_RULES
    from axgen.runtime.sharding import logical_to_mesh

    rules, mesh = dict(LOGICAL_AXIS_RULES), {
        "data": 1,
        "stage": 1,
        "fsdp": 128,
        "expert": 8,
        "context": 1,
        "model": 1,
    }
    assert logical_to_mesh(rules, ("embed", "heads"), (7168, 128), mesh) == jax.sharding.PartitionSpec(
        ("fsdp", "expert"), None
    )
    P = jax.sharding.PartitionSpec
    assert logical_to_mesh(rules, ("latent", "heads", "head_dim"), (1536, 128, 192), mesh) == P(
        "fsdp", None, None
    )
    assert logical_to_mesh(rules, ("expert", "embed", "mlp"), (256, 7168, 2048), mesh) == P(
        "expert", "fsdp", None
    )
    assert logical_to_mesh(rules, ("embed",), (7000,), mesh) == P("expert")  # 7000 / 128 is no integer
    assert logical_to_mesh(rules, ("embed",), (7001,), mesh) == P(None)


def test_deepseek_v3_on_its_tpu_slice_holds_no_large_param_whole():
    """Each of DeepSeek-V3's 671,026,404,352 params (transformers' count) is on 1,024 chips: a chip holds about a
    1,024th. MLA's up-projections [layers, latent, heads, head_dim] were once whole on every chip (latent had no
    rule): 3.98B params a chip."""
    from axgen.runtime.sharding import logical_to_mesh, shards

    program = load_program(ROOT / "generated/deepseek_v3/tpu_v5p_1024.py")
    mesh = program.MESH_SHAPE
    per_device = 0
    for path, param in jax.tree_util.tree_leaves_with_path(
        program.PARAMS, is_leaf=lambda x: hasattr(x, "axes")
    ):
        spec = logical_to_mesh(program.LOGICAL_AXIS_RULES, param.axes, param.shape, mesh)
        split = np.prod([shards(entry, mesh) for entry in spec])
        per_device += int(np.prod(param.shape)) // split
        if np.prod(param.shape) > 2**20:
            assert split >= 128, f"{jax.tree_util.keystr(path)} {param.axes} {param.shape}: {spec}"
    assert per_device < 1.1 * 671_026_404_352 / 1024


def test_build_warns_when_a_mesh_leaves_params_whole_on_every_device(tmp_path, capsys):
    """gpt-oss-120b on the backend's tpu-v5p-256 rule, fsdp=256: its 2880 width is not a multiple of 256 and every
    other dim goes to `model` (1 here), so every param stays whole on every chip; the program is still written
    (the user may mean it), with one line saying so. The spec's own rule, fsdp=64 x expert=4, draws no warning.
    """
    spec = tmp_path / "oss_fsdp.py"
    spec.write_text(
        "from axgen.specs.gpt_oss_120b import spec as oss\nspec = oss.replace(name='oss-fsdp', mesh_rules=[])\n"
    )
    out = tmp_path / "program.py"
    assert axgen(["build", str(spec), "--target", "tpu-v5p-256", "--out", str(out)]) == 0 and out.is_file()
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith(
        f"axgen: warning: {spec} on tpu-v5p-256: a device holds 116.83B of the 116.83B params"
    )
    assert "(242x its even share over fsdp=256;" in warning and "w_gate, w_up, w_down and others" in warning
    own = tmp_path / "own.py"
    assert (
        axgen(
            ["build", str(ROOT / "axgen/specs/gpt_oss_120b.py"), "--target", "tpu-v5p-256", "--out", str(own)]
        )
        == 0
    )
    assert capsys.readouterr().err == ""
