"""Pipeline stages: a `stage` mesh axis splits the decoder's stacked layers into runs of consecutive layers, each
device running its stage on one microbatch while the others run theirs (runtime.pipeline): GPipe, or the circular
schedule, whose microbatches go round the stages, each holding several runs. The proof is issue 39's: on the CPU
mesh, stage=2 and stage=4 give one stage's loss and gradients, accumulated over passes."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen import runtime
from axgen.analysis import plan as planner
from axgen.backends import plan_for
from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.loader import load_spec
from axgen.runtime.program import Program
from axgen.runtime.stages import bubble
from axgen.ir import cost
from axgen.spec import MESH_AXES, MeshRule
from axgen.analysis.aot import Report, compile_target
from tests.conftest import ROOT, assert_gradients_close
from tests.test_aot import aot
from tests.test_context import packed_batch

WINDOWS = "F.sliding_window(window=24, global_every=2)"  # a scan of groups of 2 layers
RULES = {"batch": ("data", "fsdp"), "seq": (), "embed": (), "mlp": ("model",), "layers": ("stage",)}


def mesh_of(**sizes):
    shape = tuple(sizes.get(axis, 1) for axis in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def spec_file(
    tmp_path,
    name,
    mesh,
    microbatch,
    pipeline_microbatches=None,
    pipeline_repeats=None,
    pipeline_schedule=None,
    base="llama_tiny",
    features="",
    layers=4,
    target="cpu-8",
    shard_residual=None,
):
    """A tiny spec of `layers` layers on `mesh` for `target`, with `features` added to its own."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.spec import features as F\n"
        f"from axgen.specs.{base} import spec as tiny\n"
        f"tiny = tiny.replace(decoder=tiny.decoder.replace(num_layers={layers}))\n"
        f"rule = MeshRule({target!r}, {mesh!r}, why='pipeline stages under test', "
        f"microbatch={microbatch}, pipeline_microbatches={pipeline_microbatches}, "
        f"pipeline_repeats={pipeline_repeats}, pipeline_schedule={pipeline_schedule!r}, "
        f"shard_residual={shard_residual})\n"
        f"spec = tiny.replace(mesh_rules=[rule], features=[*tiny.features, {features}], targets=[{target!r}])\n"
    )
    return path


def test_the_stages_run_the_scan_they_split_in_value_and_gradient():
    """runtime.pipeline of a stack of 8 layers over 2 and 4 stages (and on one device, every stage there) equals
    the plain scan of the stack, in value and in the gradients of the params and the input."""

    def layer(x, p, positions, segment_ids):
        h = runtime.constrain(jnp.tanh(jnp.einsum("bse,ef->bsf", x, p["w1"])), ("batch", "seq", "mlp"), RULES)
        scale = segment_ids[..., None] + 0.01 * positions[..., None]
        return runtime.constrain(
            x + jnp.einsum("bsf,fe->bse", h, p["w2"]) * scale, ("batch", "seq", "embed"), RULES
        )

    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": 0.3 * jax.random.normal(keys[0], (8, 16, 32)),
        "w2": 0.3 * jax.random.normal(keys[1], (8, 32, 16)),
    }
    x = jax.random.normal(keys[2], (8, 6, 16))
    segment_ids = jnp.ones((8, 6), jnp.int32).at[:, 4:].set(2)
    positions = jnp.broadcast_to(jnp.arange(6), (8, 6))

    def plain(params, x):
        scan = jax.lax.scan(lambda x, p: (layer(x, p, positions, segment_ids), None), x, params)[0]
        return (scan * jnp.cos(jnp.arange(16))).sum()

    def staged(stages, repeats, microbatch, params, x):
        out = runtime.pipeline(
            layer,
            x,
            params,
            positions,
            segment_ids,
            stages=stages,
            repeats=repeats,
            microbatch=microbatch,
            rules=RULES,
        )
        return (out * jnp.cos(jnp.arange(16))).sum()

    expected, expected_grads = jax.value_and_grad(plain, (0, 1))(params, x)
    # (stages, repeats, rows a microbatch, mesh): GPipe, and the circular schedule going round twice (4
    # microbatches of 1 row a device over 2 stages, each holding 2 runs of 2 layers), 4 times (2 microbatches of 2
    # over 2 stages of 4 runs of 1 layer), and twice with fewer microbatches than stages (2 over 4 stages: the
    # ring's 4 slots hold 2 empty ones)
    runs = [
        (2, 1, 1, mesh_of(stage=2, fsdp=2, model=2)),
        (4, 1, 1, mesh_of(stage=4, data=2)),
        (4, 1, 1, None),
        (2, 2, 1, mesh_of(stage=2, fsdp=2, model=2)),
        (2, 4, 2, mesh_of(stage=2, data=2, model=2)),
        (4, 2, 2, mesh_of(stage=4, data=2)),
        (2, 2, 1, None),
    ]
    for stages, repeats, microbatch, mesh in runs:
        fn = jax.jit(jax.value_and_grad(functools.partial(staged, stages, repeats, microbatch), (0, 1)))
        if mesh is None:
            value, grads = fn(params, x)
        else:
            with jax.set_mesh(mesh):
                value, grads = fn(params, x)
        np.testing.assert_allclose(value, expected, rtol=1e-5)
        for grad, expected_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
            np.testing.assert_allclose(grad, expected_grad, atol=1e-4 * np.abs(expected_grad).max())
    assert bubble(4, 4) == 3 / 7 and bubble(2, 8) == 1 / 9 and bubble(4, 4, 3) == 3 / 15


def test_1f1b_stages_give_the_loss_and_gradients_of_the_plain_model():
    """runtime.pipelined_loss (1F1B: each microbatch's backward as soon as its forward leaves the last stage, the
    loss in the last stage) of an embedding, 8 layers and a head over 2 and 4 stages, on one device (every stage
    there) and on meshes whose stage axis is manual beside fsdp and model or data, equals the plain model's
    weighted loss, and its gradients those of the params, the stack and the weights (each target's loss); its value
    alone (no gradient) runs the forwards only. With 4 stages of 2 microbatches the ring's slots outnumber them.
    The first 6 of the layers on 4 stages run as stages of 2, 2, 2 and none, the stack split over the stage axis on
    its mlp dimension and sent to the stages in an all-to-all."""

    def layer(x, p, positions, segment_ids):
        h = runtime.constrain(jnp.tanh(jnp.einsum("bse,ef->bsf", x, p["w1"])), ("batch", "seq", "mlp"), RULES)
        scale = segment_ids[..., None] + 0.01 * positions[..., None]
        return runtime.constrain(
            x + jnp.einsum("bsf,fe->bse", h, p["w2"]) * scale, ("batch", "seq", "embed"), RULES
        )

    def first(params, mb):
        return jnp.take(params["embed"], mb["tokens"], axis=0)

    def last(params, x, mb):
        return runtime.cross_entropy(x @ params["head"], mb["labels"])

    keys = jax.random.split(jax.random.key(1), 5)
    eight_layers = {
        "w1": 0.3 * jax.random.normal(keys[0], (8, 16, 32)),
        "w2": 0.3 * jax.random.normal(keys[1], (8, 32, 16)),
    }
    params = {
        "embed": jax.random.normal(keys[2], (11, 16)),
        "head": 0.3 * jax.random.normal(keys[3], (16, 11)),
    }
    tokens = jax.random.randint(keys[4], (8, 7), 0, 11)
    segment_ids = jnp.ones((8, 6), jnp.int32).at[:, 4:].set(2)
    inputs = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "positions": jnp.broadcast_to(jnp.arange(6), (8, 6)),
        "segment_ids": segment_ids,
        "weights": jnp.linspace(0.1, 1.0, 48).reshape(8, 6),
    }

    def plain(params, stacked, weights):
        step = functools.partial(layer, positions=inputs["positions"], segment_ids=inputs["segment_ids"])
        x = jax.lax.scan(lambda x, p: (step(x, p), None), first(params, inputs), stacked)[0]
        return jnp.sum(last(params, x, inputs) * weights)

    six_layers = jax.tree.map(lambda w: w[:6], eight_layers)
    split_mlp = {**RULES, "mlp": ("model", "stage")}  # the rules of stages the layers do not divide
    specs = {
        "w1": runtime.ParamSpec((6, 16, 32), ("layers", "embed", "mlp")),
        "w2": runtime.ParamSpec((6, 32, 16), ("layers", "mlp", "embed")),
    }
    for stages, microbatch, mesh, stacked in [
        (2, 1, None, eight_layers),
        (4, 1, None, eight_layers),
        (2, 1, mesh_of(stage=2, fsdp=2, model=2), eight_layers),
        (4, 2, mesh_of(stage=4, data=2), eight_layers),
        (4, 1, None, six_layers),
        (4, 1, mesh_of(stage=4, model=2), six_layers),
    ]:
        rules = RULES if stacked is eight_layers else split_mlp
        expected, expected_grads = jax.value_and_grad(plain, (0, 1, 2))(params, stacked, inputs["weights"])

        def staged(params, stacked, weights):
            weighted = {**inputs, "weights": weights}
            return runtime.pipelined_loss(
                first,
                layer,
                last,
                params,
                stacked,
                weighted,
                stages=stages,
                microbatch=microbatch,
                rules=rules,
                specs=specs,
            )

        with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
            value, grads = jax.jit(jax.value_and_grad(staged, (0, 1, 2)))(params, stacked, inputs["weights"])
            forward_only = jax.jit(staged)(params, stacked, inputs["weights"])
        np.testing.assert_allclose([value, forward_only], [expected, expected], rtol=1e-6)
        for grad, expected_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
            np.testing.assert_allclose(grad, expected_grad, atol=1e-5 * np.abs(expected_grad).max())


@pytest.fixture(scope="module")
def stage_programs(tmp_path_factory):
    """llama_tiny in passes of 2 sequences a device on stage=2 x fsdp=2 x model=2, circular (each pass 2
    microbatches of 1 sequence, the default, going round the 2 stages twice: stage 0 holds layers 0 and 2) and
    1F1B; in passes of 4 on stage=2 x context=2 x model=2 with 1F1B (4 microbatches of 1 sequence, each device
    holding its context shard); and in passes of 4 on stage=4 x model=2 with GPipe (2 microbatches of 2
    sequences, fewer than the stages)."""
    tmp_path = tmp_path_factory.mktemp("stages")
    programs = {}
    for name, mesh, passes in [
        ("stage=2 circular", {"stage": 2, "fsdp": 2, "model": 2}, (2, None, 2)),
        ("stage=2 1F1B", {"stage": 2, "fsdp": 2, "model": 2}, (2, None, None, "1f1b")),
        ("stage=2 x context=2 1F1B", {"stage": 2, "context": 2, "model": 2}, (4, None, None, "1f1b")),
        ("stage=4 GPipe", {"stage": 4, "model": 2}, (4, 2)),
    ]:
        out = tmp_path / f"{name.replace('=', '_').replace(' ', '_')}.py"
        write_atomically(out, build(spec_file(tmp_path, out.stem, mesh, *passes), "cpu-8").source)
        programs[name] = load_program(out)
    return programs


def test_stage_2_and_4_train_as_one_stage_does(stage_programs):
    """The loss and every gradient of a step of 8 sequences on stage=2 (circular; 1F1B, and 1F1B with each
    sequence split over context=2) and on stage=4 (GPipe) equal one stage's within float32 noise, each taking the batch in 2 passes whose rows are those one device's 2
    passes take (runtime.gradients): with one document a row, and with documents packed into the rows, padding
    and a loss mask (the passes then count different targets, and the step's loss is the mean of the passes'
    means). Gradients within 2e-6 of their largest magnitude: sums over the sharded passes round in another order
    (one element of 32,768 is 1.1e-6 off on stage=2). The 1F1B programs' evaluation (their pipeline's forwards
    alone) sums the same losses."""
    one_stage = load_program(ROOT / "generated/llama_tiny/cpu_8.py")
    params = Program.from_module(one_stage).init_params(jax.random.key(0))
    packed = tuple(x[:8] for x in packed_batch(True))
    rows_alone = (packed[0], jnp.ones_like(packed[0]), jnp.ones_like(packed[0]))

    one_device_step = jax.jit(  # one compile for both batches, which have the same shapes
        functools.partial(
            runtime.gradients,
            one_stage.loss_fn,
            microbatch=4,
            specs=one_stage.PARAMS,
            rules=one_stage.LOGICAL_AXIS_RULES,
        )
    )

    def reference(batch):
        (loss, _), grads = one_device_step({"params": params}, batch=batch)
        return float(loss), grads

    expected = {"rows alone": reference(rows_alone), "packed": reference(packed)}
    expected_sums = one_stage.eval_step(params, *packed)
    for name, module in stage_programs.items():
        program = Program.from_module(module)
        mesh = program.make_mesh()
        step = jax.jit(
            functools.partial(
                runtime.gradients,
                module.loss_fn,
                microbatch=module.MICROBATCH,
                specs=module.PARAMS,
                rules=module.LOGICAL_AXIS_RULES,
            )
        )
        assert program.accumulation_steps(8) == 2
        with jax.set_mesh(mesh):
            placed = {"params": jax.device_put(params, program.param_shardings(mesh))}
            got = {"rows alone": step(placed, batch=rows_alone), "packed": step(placed, batch=packed)}
            if "1F1B" in name:
                sums = jax.jit(module.eval_step)(placed["params"], *packed)
                np.testing.assert_allclose(
                    sums["loss_sum"], expected_sums["loss_sum"], rtol=1e-6, err_msg=name
                )
                assert sums["targets"] == expected_sums["targets"] == 886
        for batch, ((loss, _), grads) in got.items():
            expected_loss, expected_grads = expected[batch]
            np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-6, err_msg=f"{name} {batch}")
            assert_gradients_close(grads, expected_grads, 2e-6, f"{name} {batch}")


def test_1f1b_on_stages_the_layers_do_not_divide_trains_as_one_stage_does(tmp_path):
    """llama_tiny at 6 layers on stage=4 x context=2 with 1F1B, the 405B's design at its smallest: stages of 2, 2
    and 2 layers and a last one running the head alone, the stack split over the stage axis on embed and mlp and
    sent to the stages in an all-to-all, each sequence over 2 context shards. The loss and every gradient of a step
    of 8 packed rows equal the same model's on one device (one pass of 8 each)."""
    base = (
        "from axgen.spec import MeshRule\nfrom axgen.specs.llama_tiny import spec as tiny\n"
        "tiny = tiny.replace(decoder=tiny.decoder.replace(num_layers=6), targets=['cpu-8'])\n"
    )
    programs = {}
    for name, rule in [
        ("one_device", "spec = tiny\n"),
        (
            "uneven",
            "rule = MeshRule('cpu-8', {'stage': 4, 'context': 2}, why='t', microbatch=8, pipeline_schedule='1f1b')\n"
            "spec = tiny.replace(mesh_rules=[rule])\n",
        ),
    ]:
        (tmp_path / f"{name}.py").write_text(base + rule)
        out = tmp_path / f"{name}_program.py"
        write_atomically(out, build(tmp_path / f"{name}.py", "cpu-8").source)
        programs[name] = load_program(out)
    one, uneven = programs["one_device"], programs["uneven"]
    params = Program.from_module(one).init_params(jax.random.key(0))
    packed = tuple(x[:8] for x in packed_batch(True))
    step = functools.partial(runtime.gradients, microbatch=8, specs=one.PARAMS)
    (expected_loss, _), expected_grads = jax.jit(
        functools.partial(step, one.loss_fn, rules=one.LOGICAL_AXIS_RULES)
    )({"params": params}, batch=packed)
    program = Program.from_module(uneven)
    mesh = program.make_mesh()
    with jax.set_mesh(mesh):
        placed = {"params": jax.device_put(params, program.param_shardings(mesh))}
        (loss, _), grads = jax.jit(functools.partial(step, uneven.loss_fn, rules=uneven.LOGICAL_AXIS_RULES))(
            placed, batch=packed
        )
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-6)
    assert_gradients_close(grads, expected_grads, 2e-6, "stage=4 x context=2, 6 layers")


def test_the_lowering_shows_the_stages_and_refuses_what_it_cannot_split(tmp_path, capsys):
    """`axgen graph --after lowering` shows the decoder's scan in stages; the program runs it through
    runtime.pipeline, with why, and the train step its passes as without stages. More stages than layers, stages
    of unequal layers or of part of a group, pipeline microbatches that do not split a pass or have no stages to go
    through, rounds of the circular schedule that do not cut the layers into equal runs, routed experts, a
    schedule that does not match its rounds, 1F1B where the loss is more than the cross-entropy (DPO) or
    where splash attention would meet context shards, and context with shard_residual on stages that are not a
    power of two are refused at build time naming the rule and the value, with nothing written. 1F1B prints the pipelined loss:
    the first stage's input and the last stage's losses as functions of a microbatch."""
    spec = spec_file(tmp_path, "stages", {"stage": 2, "fsdp": 2, "model": 2}, 2)
    assert axgen(["graph", str(spec), "--target", "cpu-8", "--after", "lowering"]) == 0
    graph = capsys.readouterr().out
    assert (
        "steps=4 function=decoder_layer calls=(1xdecoder_layer) stages=2 stage_schedule=gpipe stage_microbatch=1 "
        "pipeline=2 stages of "
        "2 layers on the mesh's stage axis, GPipe over each pass's 2 microbatches of 1 sequence(s) per device"
        in graph
    )
    source = build(spec, "cpu-8").source
    assert "layers = runtime.pipeline(\n        decoder_layer,\n        embed,\n" in source
    assert "# pipeline · 2 stages of 2 layers on the mesh's stage axis, GPipe" in source
    assert (
        "        stages=2,\n        repeats=1,\n        microbatch=1,\n" in source
        and '"layers": ("stage",),' in source
    )
    circular = build(spec_file(tmp_path, "circular", {"stage": 2, "fsdp": 4}, 4, 2, 2), "cpu-8").source
    assert (
        "# pipeline · 2 stages of 2 runs of 1 layers on the mesh's stage axis (stage s: runs s, s + 2, ...), "
        "circular, 2 rounds over each pass's 2 microbatches of 2 sequence(s) per device" in circular
    )
    assert "        stages=2,\n        repeats=2,\n        microbatch=2,\n" in circular
    one_f_one_b = build(
        spec_file(tmp_path, "1f1b", {"stage": 2, "fsdp": 4}, 2, None, None, "1f1b"), "cpu-8"
    ).source
    assert (
        "    # pipeline · 2 stages of 2 layers on the mesh's stage axis, 1F1B (the output head and the loss in the "
        "last stage) over each pass's 2 microbatches of 1 sequence(s) per device" in one_f_one_b
    )
    assert (
        "    return runtime.pipelined_loss(\n        first_stage_input,\n        decoder_layer,\n"
        '        last_stage_losses,\n        outside,\n        params["layers"],\n        inputs,\n'
        in one_f_one_b
    )
    assert "embed = runtime.vocab_parallel_take(" in one_f_one_b and "def target_losses(" not in one_f_one_b
    assert "cross_entropy = weighted_loss(params, tokens, segment_ids, trained / " in one_f_one_b
    # 6 layers on 4 stages: 3 of 2 and one that runs the head alone; the stack split over stage on embed and mlp.
    uneven = build(
        spec_file(tmp_path, "uneven_1f1b", {"stage": 4, "model": 2}, 2, None, None, "1f1b", layers=6), "cpu-8"
    )
    assert "# pipeline · 3 stages of 2 layers and 1 without on the mesh's stage axis, 1F1B" in uneven.source
    assert '        specs=PARAMS["layers"],\n' in uneven.source and "runtime.pipeline(" not in uneven.source
    assert '"embed": ("fsdp", "expert", "context", "stage"),' in uneven.source
    assert '"mlp": ("model", "stage"),' in uneven.source
    assert source.count("MICROBATCH, PARAMS, LOGICAL_AXIS_RULES)") == 1 and "MICROBATCH = 2\n" in source
    assert "runtime.pipeline(" not in build(spec_file(tmp_path, "plain", {"fsdp": 8}, 2), "cpu-8").source
    gpu = build(
        spec_file(tmp_path, "gpu", {"stage": 2, "fsdp": 2, "model": 2}, 2, target="gpu-h100-8"), "gpu-h100-8"
    )
    assert 'else "cudnn"' in gpu.source and "# xla:" not in gpu.source  # cuDNN's attention, in the stages
    cases = [
        (
            spec_file(tmp_path, "eight", {"stage": 8}, 2),
            "stage=8 (pattern 'cpu-8') is more stages than the 4 layers",
        ),
        (
            spec_file(tmp_path, "six", {"stage": 4, "model": 2}, 2, layers=6),
            "stage=4 (pattern 'cpu-8') does not split Decoder.num_layers=6 into stages of as many layers each",
        ),
        (
            spec_file(tmp_path, "experts", {"stage": 2, "fsdp": 4}, 2, base="moe_tiny"),
            "stage=2 (pattern 'cpu-8') and the routed experts of",
        ),
        (
            spec_file(tmp_path, "groups", {"stage": 4, "fsdp": 2}, 2, features=WINDOWS),
            "stage=4 x pipeline_repeats=1 does not split the 2 steps of",
        ),
        (
            spec_file(tmp_path, "uneven", {"stage": 2, "fsdp": 4}, 2, 3),
            "MeshRule.pipeline_microbatches=3 (pattern 'cpu-8') does not split a pass of 2 sequences per device",
        ),
        (
            spec_file(tmp_path, "unstaged", {"fsdp": 8}, 2, 2),
            "MeshRule.pipeline_microbatches=2 (pattern 'cpu-8') is for pipeline stages, and its mesh has none",
        ),
        (
            spec_file(tmp_path, "zero", {"stage": 2, "fsdp": 4}, 2, 0),
            "MeshRule.pipeline_microbatches=0 must be > 0",
        ),
        (
            spec_file(tmp_path, "rounds", {"stage": 2, "fsdp": 4}, 2, None, 3),
            "MeshRule.pipeline_repeats=3 (pattern 'cpu-8') does not cut Decoder.num_layers=4 into 2 stages x 3 "
            "runs of as many layers each",
        ),
        (
            spec_file(tmp_path, "round", {"fsdp": 8}, 2, None, 2),
            "MeshRule.pipeline_repeats=2 (pattern 'cpu-8') is for pipeline stages, and its mesh has none",
        ),
        (
            spec_file(tmp_path, "never", {"stage": 2, "fsdp": 4}, 2, None, -1),
            "MeshRule.pipeline_repeats=-1 must be > 0",
        ),
        (
            spec_file(tmp_path, "five", {"stage": 4, "model": 2}, 2, None, None, "1f1b", layers=5),
            "stage=4 (pattern 'cpu-8') does not split Decoder.num_layers=5 into stages of 2 layers and empty ones",
        ),
        (
            spec_file(tmp_path, "once", {"stage": 2, "fsdp": 4}, 2, None, None, "circular"),
            "MeshRule.pipeline_schedule='circular' (pattern 'cpu-8') with pipeline_repeats=1: only the circular "
            "schedule goes round the stages more than once",
        ),
        (
            spec_file(tmp_path, "twice", {"stage": 2, "fsdp": 4}, 2, None, 2, "1f1b"),
            "MeshRule.pipeline_schedule='1f1b' (pattern 'cpu-8') with pipeline_repeats=2",
        ),
        (
            spec_file(tmp_path, "typo", {"stage": 2, "fsdp": 4}, 2, None, None, "1F1B"),
            "MeshRule.pipeline_schedule='1F1B' is not one of gpipe, circular, 1f1b",
        ),
        (
            spec_file(
                tmp_path, "dpo", {"stage": 2, "fsdp": 4}, 2, None, None, "1f1b", features="F.dpo(beta=0.1)"
            ),
            "pipeline_schedule='1f1b' computes the cross-entropy in the last stage, and this model trains with the "
            "dpo objective; use the gpipe or circular schedule",
        ),
        (
            spec_file(
                tmp_path,
                "odd",
                {"stage": 3, "context": 2, "model": 8},
                2,
                None,
                None,
                "1f1b",
                layers=6,
                target="gpu-h100-48",
                shard_residual=True,
            ),
            "MeshRule.mesh stage=3 (pattern 'gpu-h100-48') with context=2 and shard_residual: XLA's partitioner "
            "aborts on such stage counts that are not a power of two",
            "gpu-h100-48",
        ),
    ]
    splash = spec_file(
        tmp_path, "splash", {"stage": 2, "context": 2, "model": 2}, 2, None, None, "1f1b", target="tpu-v5e-8"
    )
    splash.write_text(splash.read_text() + "spec = spec.replace(train=spec.train.replace(seq_len=256))\n")
    cases.append(
        (
            splash,
            "pipeline_schedule='1f1b' with context=2 runs attention on each device's context shard, which splash "
            "attention does not do there yet",
            "tpu-v5e-8",
        )
    )
    for bad, message, *target in cases:
        out = tmp_path / "out.py"
        assert axgen(["build", str(bad), "--target", *(target or ["cpu-8"]), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_the_planner_tries_stages_for_a_model_one_host_cannot_hold():
    """`axgen plan` splits the layers into pipeline stages where they split evenly, the devices and the batch
    allow, and the params and AdamW moments do not fit one host's devices (Llama 3.1 405B's 126 layers on 896 H100s:
    7 or 14 stages; no mesh without stages divides its batch of 2048 there); Llama 3 8B fits a host, so no stages.
    The search tries GPipe; the target's own rule keeps its circular schedule."""
    meshes, own = {}, {}
    for name, target in [("llama3_405b", "gpu-h100-896"), ("llama3_8b", "gpu-h100-64")]:
        path = ROOT / f"axgen/specs/{name}.py"
        spec = load_spec(path)
        plan = plan_for(spec, target)
        meshes[name] = [dict(m) for m in planner._meshes(spec, plan, build(path, target))]
        own[name] = planner.own_candidate(spec, plan)
    assert {mesh["stage"] for mesh in meshes["llama3_405b"]} == {7, 14}
    # The spec's own rule, compiled first, keeps its circular schedule.
    assert own["llama3_405b"].fields()["pipeline_repeats"] == 2
    assert own["llama3_405b"].mesh_text() == "stage=7 fsdp=16 model=8 x2 rounds"
    assert "pipeline_repeats" not in own["llama3_8b"].fields()
    assert meshes["llama3_405b"][0] == {**dict.fromkeys(MESH_AXES, 1), "stage": 7, "fsdp": 16, "model": 8}
    assert {mesh["stage"] for mesh in meshes["llama3_8b"]} == {1}


def test_the_planner_keeps_a_1f1b_rule_and_counts_its_busiest_stage(tmp_path):
    """A target whose own rule runs 1F1B is compiled so by `axgen plan` (its candidate keeps the schedule), and its
    compute is the busiest stage's every tick, counted from the graph (XLA's count leaves out the dots under a
    lax.cond): the last stage's layers and the head and loss at 8 FLOPs a weight and token (llama_tiny's 4 layers
    on 2 stages), or the larger of a full stage's layers and the head where the last stage holds none (on 3
    stages: 2, 2 and none; with a 65,536-token vocabulary the head weighs more)."""
    path = ROOT / "axgen/specs/llama_tiny.py"
    spec, built = load_spec(path), build(path, "cpu-8")
    tiny_rule = MeshRule("cpu-8", {"stage": 2, "fsdp": 4}, why="t", microbatch=2, pipeline_schedule="1f1b")
    own = planner.own_candidate(spec, plan_for(spec.replace(mesh_rules=[tiny_rule]), "cpu-8"))
    assert own.fields()["pipeline_schedule"] == "1f1b" and own.mesh_text() == "stage=2 fsdp=4 1F1B"
    train, layers = spec.train, spec.decoder.num_layers
    per_layer = cost.flops_per_token(built.graph, train.seq_len, lambda n: n.region != "main") / layers
    tokens = train.global_batch * train.seq_len
    head = 8 * spec.d_model * spec.vocab_size
    two_stages = (2 * per_layer + head) * tokens / 4 / 0.75
    assert planner._one_f_one_b_flops(built, 2, 0.25) == pytest.approx(two_stages)
    assert planner._one_f_one_b_flops(built, 3, 0) == pytest.approx(2 * per_layer * tokens / (8 / 3))
    wide = tmp_path / "wide_vocab.py"
    wide.write_text("from axgen.specs.llama_tiny import spec\nspec = spec.replace(vocab_size=65536)\n")
    head = 8 * spec.d_model * 65536
    assert head > 2 * per_layer
    assert planner._one_f_one_b_flops(build(wide, "cpu-8"), 3, 0) == pytest.approx(head * tokens / (8 / 3))


# slow tier: deviceless compiles for the chips (about 35 s each on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "kernel", "repeats", "schedule"),
    [
        ("tpu-v5e-8", "tpu_custom_call", 2, "circular (2 rounds)"),
        ("gpu-h100-8", "__cudnn$fmhaScaleBiasSoftmax", 1, "GPipe"),
    ],
)
def test_a_staged_train_step_compiles_for_each_chip(target, kernel, repeats, schedule, tmp_path, capsys):
    """stage=2 x fsdp=2 x model=2 in 2 passes of 4 microbatches a device, circular on the TPU and GPipe on the
    H100: the chip's attention kernel runs in the stages (splash on TPU, cuDNN on the H100: each device runs its
    own stage in a shard_map manual over the stage axis); the stages pass activations by collective permutes, and
    the report gives the bubble, (2 - 1) / (repeats x 4 + 2 - 1)."""
    spec = spec_file(tmp_path, "staged", {"stage": 2, "fsdp": 2, "model": 2}, 4, 4, repeats, target=target)
    code, [report], _ = aot(capsys, str(spec), "--target", target)
    assert code == 0 and report["fits"] and report["grad_accum_steps"] == 2
    assert report["pipeline_microbatches"] == 4 and report["pipeline_repeats"] == repeats
    assert report["collectives"]["collective-permute"] > 0
    assert kernel in report["kernels"]
    assert Report(**report).bubble == 1 / (repeats * 4 + 1)
    assert (
        f"pipeline: 2 stages, {schedule} over each pass's 4 microbatches: each stage idles "
        f"{1 / (repeats * 4 + 1):.1%} of the step" in Report(**report).text()
    )


# slow tier: deviceless compiles of Llama 3.1 405B for 1024 H100s (about 100 s on 2 cores)
@pytest.mark.slow
def test_llama_405b_in_1f1b_stages_beats_the_stage_free_mesh_on_1024_h100s(tmp_path):
    """Issue 39's proof: Llama 3.1 405B fits gpu-h100-1024 with pipeline stages (64 of them: 63 of 2 layers and
    one running the head alone, context=2 x model=8, 1F1B, one pass of 2048 microbatches of one sequence) and
    `axgen plan`'s roofline step beats the spec's stage-free rule's (fsdp=128 x model=8; 43.6 s against 51.5 in
    docs/aot.md)."""
    staged = tmp_path / "llama3_405b_1f1b.py"
    staged.write_text(
        "from axgen.spec import MeshRule, Remat\nfrom axgen.specs.llama3_405b import spec as big\n"
        "rule = MeshRule('gpu-h100-1024', {'stage': 64, 'context': 2, 'model': 8}, why='1F1B', microbatch=2048, "
        "pipeline_schedule='1f1b', remat=Remat(policy='save_dots'), shard_residual=True)\n"
        "spec = big.replace(mesh_rules=[rule])\n"
    )
    steps = {}
    for name, path in [("staged", staged), ("stage-free", ROOT / "axgen/specs/llama3_405b.py")]:
        report, built = compile_target(path, "gpu-h100-1024"), build(path, "gpu-h100-1024")
        assert report.fits, name
        if name == "staged":
            assert report.pipeline_schedule == "1f1b" and report.mesh["stage"] == 64
            busiest = planner._one_f_one_b_flops(built, 64, report.bubble)
            seconds = planner.estimate(built.plan, dataclasses.replace(report, dot_flops=busiest), 0)
        else:
            seconds = planner.estimate(built.plan, report, planner._kernel_flops(built))
        steps[name] = max(seconds.values())
    assert steps["staged"] < 0.9 * steps["stage-free"], steps
