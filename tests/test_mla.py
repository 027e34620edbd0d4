"""Multi-head latent attention (F.mla): the pass's graph and its flops, the lowering that pads v where the kernel
takes one head dim and not for splash, and the specs it refuses in one line. Its logits against transformers'
DeepSeek-V2 are tests/test_deepseek_v2.py's."""

import re

import pytest
from tests.conftest import losses_in, train_in_process
from tests.test_aot import aot
from tests.test_hf_export import run

from axgen.build import build
from axgen.cli import main as run_cli


def mla_spec(tmp_path, features: str = "tiny.features"):
    """tests/fixtures/hf_deepseek_v2_spec.py's model with `features`, at a sequence splash's blocks divide, for
    every target."""
    path = tmp_path / "mla_spec.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "from axgen.spec import Train, features as F\n"
        f"spec = tiny.replace(features={features}, train=Train(seq_len=128, global_batch=8, steps=10, "
        "warmup_steps=1), targets=['cpu-1', 'tpu-v5e-8', 'gpu-h100-8'])\n"
    )
    return path


@pytest.mark.parametrize(
    ("target", "kernel", "pad_v"), [("gpu-h100-8", "cudnn", True), ("tpu-v5e-8", "splash", False)]
)
def test_the_lowering_pads_v_for_cudnn_and_not_for_splash(target, kernel, pad_v, tmp_path, capsys):
    code, output = run(capsys, "graph", mla_spec(tmp_path), "--target", target, "--after", "lowering")
    assert code == 0, output
    (line,) = [line for line in output.splitlines() if line.strip().startswith("attention = attention(")]
    assert f"kernel={kernel}" in line and "v_head_dim=12" in line and ("pad_v=True" in line) == pad_v
    assert "-> [batch, seq, heads=4, head_dim=12]" in line


def test_the_program_has_mla_s_projections_and_counts_their_flops(tmp_path):
    built = build(mla_spec(tmp_path), "gpu-h100-8")
    assert "key = concat_shared(k_nope, k_pe)" in built.source
    assert re.search(
        r"runtime\.causal_attention\(\s*query_rope,\s*key_rope,\s*value,\s*segment_ids,", built.source
    )
    config = dict((k, v) for k, v, _ in built.graph.attrs["config"])
    # Per token and layer, 6 x the weights it multiplies by: q_a 64x24, q_b 24x(4x24), kv_a 64x(16+8),
    # kv_b 16x(4x(16+12)), o (4x12)x64, the router 64x8, 3 of the 8 experts (3 x 64x32 each) and the shared
    # expert (3 x 64x64); attention 6 x heads x (qk 24 + v 12) per key, 128 / 2 keys on average. Then the head.
    weights = 64 * 24 + 24 * 96 + 64 * 24 + 16 * 112 + 48 * 64 + 64 * 8 + 3 * 3 * 64 * 32 + 3 * 64 * 64
    attention = 6 * 64 * 4 * (24 + 12)
    assert config["flops_per_token"] == 2 * (6 * weights + attention) + 6 * 64 * 128


@pytest.mark.parametrize(
    ("features", "message"),
    [
        (
            "[F.rope(theta=1e4), *tiny.features[1:]]",
            "MLA.qk_rope_head_dim=8 needs F.rope(rotary_dim=8), as MLA turns its rope channels only",
        ),
        ("[*tiny.features, F.qk_norm(eps=1e-6)]", "replaces the q, k, v projections that F.qk_norm changes"),
    ],
)
def test_an_mla_without_its_rope_or_with_qk_norm_is_refused_in_one_line(features, message, tmp_path, capsys):
    code, output = run(capsys, "graph", mla_spec(tmp_path, features=features))
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1, output


def test_a_head_dim_other_than_nope_plus_rope_is_refused(tmp_path, capsys):
    path = tmp_path / "bad.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(attention=tiny.decoder.attention.replace(head_dim=16)))\n"
    )
    code, output = run(capsys, "graph", path)
    assert (
        code == 2 and "Attention.head_dim=16 must be qk_nope_head_dim + qk_rope_head_dim = 24" in output
    ), output


def test_a_deepseek_style_model_trains_on_8_cpu_devices_with_falling_loss_and_logs_its_auxiliary_losses(
    corpus, tmp_path
):
    """The suite's one training run of a MoE program: the fixture's DeepSeek-V2 model (MLA with YaRN, routed and
    shared experts) at a byte vocabulary with DeepSeek-V3's routing (sigmoid scores, a correction bias) and its
    first layer dense (first_k_dense_replace), sharded over 8 fake CPU devices: its loss falls, and each step's
    line logs the auxiliary losses."""
    spec = tmp_path / "mla_train.py"
    spec.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "from axgen.spec import AdamW, Train\n"
        "rope, mla, moe = tiny.features\n"
        "moe = moe.replace(aux_loss_weight=0.01, router_z_loss_weight=0.001, first_dense_layers=1,\n"
        "    dense_hidden_dim=48, scoring='sigmoid', balance_bias_rate=1e-3)\n"
        "spec = tiny.replace(vocab_size=256, decoder=tiny.decoder.replace(num_layers=3), features=[rope, mla, moe],\n"
        "    train=Train(seq_len=64, global_batch=8, steps=20, warmup_steps=2, optimizer=AdamW(lr=3e-3)),\n"
        "    targets=['cpu-8'])\n"
    )
    program = tmp_path / "program.py"
    assert run_cli(["build", str(spec), "--target", "cpu-8", "--out", str(program)]) == 0
    source = program.read_text()
    assert source.index("dense_layers, _ = jax.lax.scan(") < source.index(
        "layers, layers_aux = jax.lax.scan("
    )
    log = train_in_process(program, corpus, tmp_path / "run", 10)
    losses = losses_in(log)
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 1.0, losses
    last = log.splitlines()[-2]
    assert (
        last.startswith("step 10 |") and "| load_balance_loss " in last and "| router_z_loss " in last
    ), last


# slow tier: deviceless compiles of the MLA program for each chip (11-26 s each on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "kernels"),
    [
        # splash forward and backward, on q/k of 24 channels and v of 12 as they are
        ("tpu-v5e-8", {"tpu_custom_call"}),
        # cuDNN's fused attention on v padded to 24 channels
        ("gpu-h100-8", {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}),
    ],
)
def test_an_mla_train_step_compiles_for_each_target_s_attention_kernel(target, kernels, tmp_path, capsys):
    code, [report], _ = aot(capsys, str(mla_spec(tmp_path)), "--target", target)
    assert code == 0 and report["fits"]
    assert kernels <= set(report["kernels"]), report["kernels"]


# slow tier: a deviceless H100 compile with cuDNN (25 s on 2 cores)
@pytest.mark.slow
def test_deepseek_s_head_dims_compile_for_the_h100_with_cudnn(tmp_path, capsys):
    """DeepSeek's q/k heads of 128 + 64 channels with v of 128 (padded to 192): Hopper's cuDNN takes head dims up
    to 256, and the deviceless compile answers jax's check as the H100 would, not as the CPU host it runs on.
    """
    path = tmp_path / "mla_deepseek_dims.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "from axgen.spec import Train\n"
        "rope, mla, moe = tiny.features\n"
        "attention = tiny.decoder.attention.replace(num_heads=2, num_kv_heads=2, head_dim=192, scale=192**-0.5)\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(attention=attention), features=[rope.replace("
        "rotary_dim=64), mla.replace(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128), moe], "
        "train=Train(seq_len=128, global_batch=8, steps=10, warmup_steps=1), targets=['gpu-h100-8'])\n"
    )
    code, [report], _ = aot(capsys, str(path), "--target", "gpu-h100-8")
    assert code == 0 and report["fits"]
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(report["kernels"])
