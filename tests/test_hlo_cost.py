"""hlo_cost reads a step's FLOPs, memory traffic and collective bytes off XLA's optimized HLO, each loop body
counted as often as it runs: checked against programs whose counts are known by hand."""

import jax
import jax.numpy as jnp
import pytest

from axgen.analysis.hlo_cost import device_groups, hlo_cost

# A TPU-style loop (no known_trip_count: the bound is the condition's constant) whose body runs a matmul spelled
# as a convolution with the heads as a padded window, and a cuBLAS gemm outside it.
TPU_STYLE = """
%cond (p: (s32[], bf16[2,128,128])) -> pred[] {
  %p = (s32[], bf16[2,128,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %bound = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%body (q: (s32[], bf16[2,128,128])) -> (s32[], bf16[2,128,128]) {
  %q = (s32[], bf16[2,128,128]{2,1,0}) parameter(0)
  %x = bf16[2,128,128,1]{3,2,1,0} parameter(1)
  %w = bf16[128,4,32,1]{3,2,1,0} parameter(2)
  %conv = bf16[2,128,4,32]{3,2,1,0} convolution(%x, %w), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
  ROOT %t = (s32[], bf16[2,128,128]{2,1,0}) tuple(%i2, %y)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %init = (s32[], bf16[2,128,128]{2,1,0}) tuple(%zero, %z)
  %loop = (s32[], bf16[2,128,128]{2,1,0}) while(%init), condition=%cond, body=%body
  %gemm = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %gather = bf16[8,64,16]{2,1,0} all-gather(%g), dimensions={0}
  ROOT %sum = bf16[64,16]{1,0} all-reduce(%s), to_apply=%add
}
"""


def test_a_tpu_style_loop_counts_its_body_by_the_conditions_bound_and_a_padded_window_by_its_real_taps():
    cost = hlo_cost(TPU_STYLE)
    # Per iteration: 2 x 2*128*4*32 outputs x 128 input features x 1 valid tap of the 4 (the input has one head
    # position, padded by 3 on each side); 4 iterations. Plus the gemm: 2 x 64*16 x 32.
    assert cost.dot_flops == 4 * 2 * (2 * 128 * 4 * 32) * 128 + 2 * 64 * 16 * 32
    assert cost.collective_bytes == {"all-gather": 8 * 64 * 16 * 2, "all-reduce": 2 * 64 * 16 * 2}


def test_scan_bodies_count_once_per_layer_where_xla_counts_them_once():
    def loss(w, x):
        def layer(h, w_layer):
            return jnp.tanh(h @ w_layer), None

        return jax.lax.scan(layer, x, w)[0].sum()

    layers, batch, width = 4, 8, 64
    compiled = (
        jax.jit(jax.grad(loss)).lower(jnp.ones((layers, width, width)), jnp.ones((batch, width))).compile()
    )
    cost = hlo_cost(compiled.as_text())
    # Forward, and two products backward (the input's and the weight's gradient), in every layer.
    assert cost.dot_flops == 3 * layers * 2 * batch * width * width
    assert compiled.cost_analysis()["flops"] < cost.dot_flops / 2
    assert cost.memory_bytes > 0 and cost.collective_bytes == {} and cost.host_bytes == 0


def test_hlo_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_cost("%f (x: f32[]) -> f32[] {\n}\n")


# 16 devices, 8 a host, in each of the spellings XLA gave collectives in the compiled Llama 3.1 405B H100 step.
ACROSS_HOSTS = """
%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

ENTRY %main (a: bf16[16,128]) -> bf16[16,128] {
  %a = bf16[16,128]{1,0} parameter(0)
  %in_host = bf16[16,128]{1,0} all-reduce(%a), channel_id=1, replica_groups=[2,8]<=[16], use_global_device_ids=true, to_apply=%add
  %across = bf16[32,128]{1,0} all-gather(%a), channel_id=2, replica_groups=[8,2]<=[2,8]T(1,0), dimensions={0}, use_global_device_ids=true
  %across_mesh = bf16[8,128]{1,0} reduce-scatter(%a), channel_id=3, replica_groups=mesh['fsdp'=2,'model'=8] {'fsdp'}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  %in_host_mesh = bf16[16,128]{1,0} all-to-all(%a), channel_id=4, replica_groups=mesh['fsdp'=2,'model'=8] {'model'}, dimensions={0}
  %in_host_listed = bf16[64,128]{1,0} all-gather(%a), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}, dimensions={0}, use_global_device_ids=true
  %across_pairs = bf16[16,128]{1,0} collective-permute(%a), channel_id=6, source_target_pairs={{0,8},{8,0}}
  ROOT %out = bf16[16,128]{1,0} add(%in_host, %across_pairs)
}
"""


def test_collectives_whose_groups_span_hosts_are_told_apart_in_every_spelling():
    """Device d is on host d // 8: groups of 8 consecutive devices stay in a host, pairs 8 apart cross."""
    assert device_groups("replica_groups=[8,2]<=[2,8]T(1,0), dimensions={0}")[:2] == [[0, 8], [1, 9]]
    assert device_groups("replica_groups=mesh['fsdp'=2,'model'=8] {'model'}, x") == [
        list(range(8)),
        list(range(8, 16)),
    ]
    assert device_groups("replica_groups={}, to_apply=%add") is None  # one group: every device
    cost = hlo_cost(ACROSS_HOSTS, devices_per_host=8)
    assert cost.cross_host_bytes == {
        "all-gather": 32 * 128 * 2,
        "collective-permute": 16 * 128 * 2,
        "reduce-scatter": 8 * 128 * 2,
    }
    assert cost.collective_bytes["all-gather"] == (32 + 64) * 128 * 2
    assert hlo_cost(ACROSS_HOSTS).cross_host_bytes == {}
