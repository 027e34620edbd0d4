"""F.lora against PEFT (tests/fixtures/make_peft_fixture.py): the same adapters on the same base, trained on the
same batches by the same optimizer, give the same losses, gradients and merged model; and what stays frozen.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tests.conftest import ROOT, run_in_process

from axgen.cli import main as axgen
from axgen.data.datasets import write_dataset

from axgen.build import build
from axgen.files import write_atomically
from axgen.hf import peft
from axgen.interop import hf_to_params, load_program
from axgen.ir import from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes
from axgen.runtime import checkpoints
from axgen.runtime.context import sequence_index
from axgen.runtime.params import joined
from axgen.runtime.program import Program

FIXTURES = ROOT / "tests/fixtures"
REFERENCE = np.load(FIXTURES / "peft_llama_gqa.npz")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The LoRA program on PEFT's base and initial adapters: its first step's gradients, then 20 steps."""
    built = build(FIXTURES / "peft_llama_gqa_spec.py", "cpu-1")
    program_file = tmp_path_factory.mktemp("lora") / "peft_llama_gqa.py"
    write_atomically(program_file, built.source)
    module = load_program(program_file)
    program = Program.from_module(module)
    base = np.load(FIXTURES / "hf_llama_gqa.npz")
    state_dict = {k: base[k] for k in base.files if k.startswith(("model.", "lm_head."))}
    adapters = peft.read_adapter(FIXTURES / "peft_llama_gqa", built.spec)
    state = program.state_from_params(joined(hf_to_params(state_dict, built.spec), adapters))
    tokens = jnp.asarray(REFERENCE["tokens"])
    ones = jnp.ones_like(tokens[0])
    (_, _), grads = module.runtime.gradients(
        module.loss_fn,
        state,
        (tokens[0], ones, ones),
        module.MICROBATCH,
        module.PARAMS,
        module.LOGICAL_AXIS_RULES,
    )
    frozen_before = jax.tree.map(np.asarray, state["frozen"])
    step = jax.jit(module.train_step)
    losses = []
    for batch in tokens:
        state, metrics = step(state, batch, ones, ones)
        losses.append(float(metrics["loss"]))
    return dict(
        spec=built.spec,
        module=module,
        program=program,
        grads=grads,
        losses=losses,
        state=state,
        frozen_before=frozen_before,
        source=built.source,
        base=base,
    )


def test_losses_of_20_steps_equal_peft_and_torch(lora_run):
    np.testing.assert_allclose(lora_run["losses"], REFERENCE["losses"], rtol=2e-5)


def test_first_step_gradients_of_every_a_and_b_equal_peft(lora_run):
    grads = peft.adapter_tensors(lora_run["grads"], lora_run["spec"])
    expected = {k.removeprefix("grad/"): REFERENCE[k] for k in REFERENCE.files if k.startswith("grad/")}
    assert sorted(grads) == sorted(expected) and len(grads) == 2 * 7 * 2
    for name, value in expected.items():
        assert np.abs(value).max() > 0, name
        np.testing.assert_allclose(grads[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_merged_model_gives_the_logits_of_pefts_merge_and_unload(lora_run, tmp_path):
    """peft.merged gives the params of hf_llama_gqa's own program, whose forward then equals PEFT's merged model."""
    program, state = lora_run["program"], lora_run["state"]
    merged = peft.merged(jax.tree.map(np.asarray, program.model_params(state)), lora_run["spec"])
    base_file = tmp_path / "hf_llama_gqa.py"
    write_atomically(base_file, build(FIXTURES / "hf_llama_gqa_spec.py", "cpu-1").source)
    logits = load_program(base_file).forward(merged, lora_run["base"]["input_ids"])
    np.testing.assert_allclose(np.asarray(logits), REFERENCE["merged_logits"], atol=2e-4, rtol=2e-4)


def test_only_the_adapters_train_and_the_base_is_kept_apart(lora_run):
    state = lora_run["state"]
    trained = jax.tree_util.tree_leaves_with_path(state["params"])
    assert trained and all("lora" in jax.tree_util.keystr(path) for path, _ in trained)
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(
        x.size for _, x in trained
    ), "AdamW's mu and nu, adapters only"
    unchanged = jax.tree.map(
        lambda a, b: bool((np.asarray(a) == b).all()), state["frozen"], lora_run["frozen_before"]
    )
    assert all(jax.tree.leaves(unchanged))
    assert "frozen" not in checkpoints.saved_part(state), "checkpoints leave the base out"
    source = lora_run["source"]
    assert "runtime.gradients(loss_fn, state, batch" in source
    assert (
        '+ 2.0 * jnp.einsum(\n        "bsn,nhd->bshd", jnp.einsum("bse,en->bsn", attn_norm, p["wq_lora_a"]), p["wq_lora_b"]'
        in source
    )


def test_lora_dropout_drops_the_adapters_inputs_as_torch_dropout_does_in_training_only(tmp_path):
    """F.lora(dropout=0.25), as PEFT's lora_dropout: a kept value is scaled by 1 / 0.75; the masks follow from the
    seed, step and row alone, so the train step's passes split nothing differently; with B zero (a fresh adapter)
    the loss is the dropout-free one, A's gradients are zero, and B's, averaged over steps' masks, are the
    dropout-free gradients (torch's dropout is unbiased in the same way). Evaluation drops nothing."""
    from axgen.runtime import dropout
    from axgen.runtime.params import select

    x = jnp.ones((64, 32, 16))
    keys = dropout.dropout_keys(0, 3, 64)
    rules = {"batch": ("data",), "seq": ("context",)}
    dropped = dropout.lora_dropout(x, keys, 0.25, "wq_lora_a", rules)
    np.testing.assert_allclose(np.unique(np.asarray(dropped)), [0.0, 1 / 0.75], rtol=1e-6)
    assert abs(float((dropped == 0).mean()) - 0.25) < 0.01, "a quarter of the values"
    assert (
        0.55 < float((dropped == dropout.lora_dropout(x, keys, 0.25, "wk_lora_a", rules)).mean()) < 0.7
    ), "own masks"
    next_step = dropout.lora_dropout(x, dropout.dropout_keys(0, 4, 64), 0.25, "wq_lora_a", rules)
    assert 0.55 < float((dropped == next_step).mean()) < 0.7, "each step its own masks"
    assert dropout.lora_dropout(x, None, 0.25, "wq_lora_a", rules) is x
    # The sequence split over 4 context shards, in context order (each shard a front and a back chunk): each
    # position is dropped as it is in sequence order.
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        in_context_order = jax.jit(lambda x: dropout.lora_dropout(x, keys, 0.25, "wq_lora_a", rules))(x)
    np.testing.assert_array_equal(in_context_order, np.asarray(dropped)[:, sequence_index(32, 4)])

    spec = tmp_path / "lora_dropout.py"
    spec.write_text(
        "from tests.fixtures.peft_llama_gqa_spec import spec as base\nrope, lora = base.features\n"
        'spec = base.replace(name="lora-dropout", features=[rope, lora.replace(dropout=0.25)])\n'
    )
    built = build(spec, "cpu-1")
    assert (
        'runtime.lora_dropout(attn_norm, dropout_keys, 0.25, "wq_lora_a", LOGICAL_AXIS_RULES)' in built.source
    )
    assert peft.adapter_config(built.spec, None)["lora_dropout"] == 0.25
    write_atomically(tmp_path / "program.py", built.source)
    module = load_program(tmp_path / "program.py")
    program = Program.from_module(module)
    base = np.load(FIXTURES / "hf_llama_gqa.npz")
    params = hf_to_params(
        {k: base[k] for k in base.files if k.startswith(("model.", "lm_head."))}, built.spec
    )
    params = joined(params, peft.read_adapter(FIXTURES / "peft_llama_gqa", built.spec))
    fresh_b = select(params, module.PARAMS, lambda spec: spec.adapter and spec.init == "zeros")
    state = program.state_from_params(joined(params, jax.tree.map(jnp.zeros_like, fresh_b)))
    tokens = jnp.asarray(REFERENCE["tokens"][:2].reshape(4, -1))
    ones = jnp.ones_like(tokens)

    def gradients(step, passes):
        keys = None if step is None else dropout.dropout_keys(0, step, tokens.shape[0])
        batch = (tokens, ones, ones) if keys is None else (tokens, ones, ones, keys)
        microbatch = tokens.shape[0] // passes
        (loss, _), grads = module.runtime.gradients(
            module.loss_fn, state, batch, microbatch, module.PARAMS, module.LOGICAL_AXIS_RULES
        )
        return loss, grads["layers"]

    samples = 64
    (losses, grads), (exact_loss, exact), (_, in_passes) = jax.jit(
        lambda: (
            jax.vmap(lambda step: gradients(step, 1))(jnp.arange(samples)),
            gradients(None, 1),
            gradients(0, 4),
        )
    )()
    # B is zero, so the drop changes no output: the loss is the dropout-free one, to the float32 rounding the vmap's
    # own fusions make (1 ulp on some CPUs).
    np.testing.assert_allclose(losses, np.full(samples, exact_loss), rtol=1e-6)
    for name in grads:
        if name.endswith("_lora_a"):
            assert not np.asarray(grads[name]).any(), name
            continue
        np.testing.assert_allclose(in_passes[name], grads[name][0], atol=1e-6, err_msg=name)
        # Each element's mean over the steps, in standard errors from the dropout-free gradient: chi-square per
        # element about 1 when unbiased; the same masks without the 1 / 0.75 scale give about 10.
        standard_error = np.asarray(grads[name].std(0, ddof=1)) / np.sqrt(samples)
        drawn = standard_error > 0
        z = (np.asarray(grads[name].mean(0)) - np.asarray(exact[name]))[drawn] / standard_error[drawn]
        unscaled = (np.asarray(grads[name].mean(0)) * 0.75 - np.asarray(exact[name]))[drawn] / standard_error[
            drawn
        ]
        assert drawn.mean() > 0.9 and np.mean(z**2) < 1.5 < 4 < np.mean(unscaled**2), name

    # Evaluation drops nothing: on PEFT's adapters (B not zero) its loss is PEFT's first, dropout-free one.
    tokens = jnp.asarray(REFERENCE["tokens"][0])
    eval_sums = module.eval_sums(params, tokens, jnp.ones_like(tokens), jnp.ones_like(tokens))
    loss = float(eval_sums["loss_sum"]) / float(eval_sums["targets"])
    assert loss == pytest.approx(REFERENCE["losses"][0], rel=2e-5)


def cli(capsys, *argv) -> tuple[int, str]:
    code = axgen([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def succeeds(*argv) -> None:
    assert axgen([str(a) for a in argv]) == 0, argv


@pytest.fixture(scope="module")
def lora_cli_run(tmp_path_factory):
    """The user's path, by the command line: the base converted with PEFT's adapter, 3 steps trained, stopped,
    resumed to 5 without --init-from (the run recorded its base), then exported as a PEFT adapter and merged.
    """
    root = tmp_path_factory.mktemp("lora_cli")
    (root / "hf").mkdir()
    base = np.load(FIXTURES / "hf_llama_gqa.npz")
    save_file(
        {k: base[k] for k in base.files if k.startswith(("model.", "lm_head."))},
        str(root / "hf/model.safetensors"),
    )
    spec = FIXTURES / "peft_llama_gqa_spec.py"
    rng = np.random.default_rng(0)
    write_dataset(
        root / "data",
        [rng.integers(1, 128, 60) for _ in range(40)],
        vocab_size=128,
        bos_id=None,
        eos_id=0,
        eval_fraction=0.1,
    )
    succeeds(
        "convert-hf",
        spec,
        "--hf",
        root / "hf",
        "--adapter",
        FIXTURES / "peft_llama_gqa",
        "--out",
        root / "ckpt",
    )
    succeeds("build", spec, "--target", "cpu-8", "--out", root / "program.py")
    run = ["--data", root / "data", "--run-dir", root / "run", "--batch", 8, "--log-every", 1]
    first = run_in_process(root / "program.py", *run, "--steps", 3, "--init-from", root / "ckpt")
    resumed = run_in_process(root / "program.py", *run, "--steps", 5, "--eval-every", 5, "--eval-batches", 1)
    assert first.returncode == 0 and resumed.returncode == 0, first.stderr + resumed.stderr
    succeeds("export-hf", spec, "--ckpt", root / "run", "--adapter", "--out", root / "adapter")
    succeeds(
        "export-hf", spec, "--ckpt", root / "run", "--merge", "--dtype", "float32", "--out", root / "merged"
    )
    return root, first.stdout + resumed.stdout


def test_a_lora_run_checkpoints_its_adapters_alone_and_resumes_on_its_recorded_base(lora_cli_run):
    root, log = lora_cli_run
    assert "params from" in log and "resumed from step 3" in log and "eval step 5" in log
    state = checkpoints.read_on_host(root / "run/checkpoints/5/state")
    assert set(state) == {"step", "params", "opt_state"}
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state["params"])]
    assert len(names) == 14 and all("lora" in n for n in names)
    assert json.loads((root / "run/base.json").read_text()) == {"init_from": str(root / "ckpt")}


def test_the_exported_adapter_is_pefts_layout_and_the_merge_is_w_plus_scaled_b_a(lora_cli_run):
    root, _ = lora_cli_run
    config = json.loads((root / "adapter/adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        "LORA",
        4,
        8,
        str(root / "hf"),
    )
    adapter = load_file(str(root / "adapter/adapter_model.safetensors"))
    initial = load_file(str(FIXTURES / "peft_llama_gqa/adapter_model.safetensors"))
    assert sorted(adapter) == sorted(initial)
    assert all(
        adapter[k].shape == initial[k].shape and not np.array_equal(adapter[k], initial[k]) for k in adapter
    )
    (shard,) = (root / "merged").glob("*.safetensors")
    merged = load_file(str(shard))
    base = np.load(FIXTURES / "hf_llama_gqa.npz")
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            want = (
                base[f"model.layers.{layer}.{module}.weight"]
                + 2.0 * adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
            )
            np.testing.assert_allclose(
                merged[f"model.layers.{layer}.{module}.weight"], want, rtol=1e-5, atol=1e-6
            )
    np.testing.assert_array_equal(merged["model.norm.weight"], base["model.norm.weight"])


def test_an_adapter_that_does_not_fit_the_spec_is_one_line_and_writes_nothing(lora_cli_run, tmp_path, capsys):
    root, _ = lora_cli_run
    spec = FIXTURES / "peft_llama_gqa_spec.py"
    for key, value, says in [
        ("r", 8, "r=8 differs from the spec's F.lora(rank=4)"),
        ("use_dora", True, "use_dora=True (DoRA) is not implemented"),
        ("target_modules", ["q_proj", "v_proj"], "target_modules=['q_proj', 'v_proj'] are not the spec's"),
        ("lora_alpha", 16, "lora_alpha=16 differs"),
    ]:
        adapter = tmp_path / key
        shutil.copytree(FIXTURES / "peft_llama_gqa", adapter)
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        code, output = cli(
            capsys, "convert-hf", spec, "--hf", root / "hf", "--adapter", adapter, "--out", tmp_path / "out"
        )
        assert code == 2 and says in output and len(output.strip().splitlines()) == 1, output
        assert not (tmp_path / "out").exists()
    other_base = tmp_path / "other_base"  # an adapter PEFT made for a model of another width
    shutil.copytree(FIXTURES / "peft_llama_gqa", other_base)
    tensors = load_file(str(other_base / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, name: tensors[name][:, :32].copy()}, str(other_base / "adapter_model.safetensors"))
    code, output = cli(
        capsys, "convert-hf", spec, "--hf", root / "hf", "--adapter", other_base, "--out", tmp_path / "out"
    )
    assert (
        code == 2 and f"{name!r} has shape [4, 32]" in output and len(output.strip().splitlines()) == 1
    ), output
    assert not (tmp_path / "out").exists()
    code, output = cli(capsys, "export-hf", spec, "--ckpt", root / "run", "--out", tmp_path / "out")
    assert code == 2 and "export them with --adapter" in output and not (tmp_path / "out").exists()
    other = run_in_process(
        root / "program.py",
        "--data",
        root / "data",
        "--run-dir",
        root / "run",
        "--steps",
        6,
        "--init-from",
        tmp_path,
    )
    assert other.returncode == 2 and "trains its adapters on the base" in other.stderr


def test_the_ir_after_lora_holds_the_adapters_beside_frozen_weights(snapshot):
    """What `axgen graph --after lora` shows: each projection's A and B beside its frozen weight, every other
    param frozen."""
    spec = load_spec(FIXTURES / "peft_llama_gqa_spec.py")
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    assert graph.dump() == snapshot


def test_a_bfloat16_base_restores_from_float32_and_trains_as_peft_does_within_its_rounding(
    lora_cli_run, tmp_path
):
    root, _ = lora_cli_run
    spec = tmp_path / "bf16_base.py"
    spec.write_text(
        "from axgen.spec import features as F\nfrom tests.fixtures.peft_llama_gqa_spec import spec as base\n"
        "rope, lora = base.features\n"
        'spec = base.replace(name="bf16-base", features=[rope, lora.replace(base_dtype="bfloat16")])\n'
    )
    built = build(spec, "cpu-1")
    assert 'frozen=True, dtype="bfloat16"' in built.source and "base_dtype=bfloat16" in built.source
    write_atomically(tmp_path / "program.py", built.source)
    module = load_program(tmp_path / "program.py")
    program = Program.from_module(module)
    mesh = program.make_mesh(jax.devices()[:1])
    with jax.set_mesh(mesh):
        state = program.state_from_params(program.restore_params(root / "ckpt", mesh))
        assert {x.dtype for x in jax.tree.leaves(state["frozen"])} == {jnp.dtype(jnp.bfloat16)}
        assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
        ones = jnp.ones_like(REFERENCE["tokens"][0])
        losses = []
        for batch in REFERENCE["tokens"][:5]:
            state, metrics = jax.jit(module.train_step)(state, batch, ones, ones)
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, REFERENCE["losses"][:5], rtol=5e-3)
