"""What each kernel the programs call takes and refuses: one entry per attention kernel (runtime/attention.py) and per
grouped matmul kernel (runtime/moe.py). The lowering (backends/lowering.py) reads this table to choose a node's
kernel and records the choice in the graph; the runtime reads the same entry to run it, so what a program's
provenance says and what runs cannot drift apart. Adding a kernel is its code beside the others and one entry here.

Plain data, read alike by the compiler (backends/lowering.py; analysis/aot.py counts the custom calls it names) and
by the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

# What an attention node may need beyond causal attention in a packed sequence (AttentionAttrs): a sliding
# `window`, a `softcap` on the scores, a `scale` other than head_dim**-0.5, learned `sinks`.
ATTENTION_OPTIONS = frozenset({"window", "softcap", "scale", "sinks"})


@dataclass(frozen=True)
class AttentionKernel:
    """An attention kernel: the options it implements, the compute dtypes it takes, whether it takes a value head
    dim other than the query/key one (else v is zero-padded to q/k's and the output sliced back: exact, at the
    padded channels' flops), how it keeps each query inside its document (`segment_ids` inside the kernel, or a
    `dense` [batch, 1, seq, seq] mask), whether it runs in blocks of the program's SPLASH_BLOCK, whether it needs
    its chip (then AXGEN_XLA_KERNELS=1, the tests' switch, swaps it for the first of ATTENTION_FALLBACKS that takes
    what the program's attention needs), the custom call it compiles to (a regex over the optimized HLO's call
    targets), and why it lacks what it lacks. Each runs a sequence split over context shards (runtime/context.py).
    """

    name: str
    options: frozenset[str]
    dtypes: frozenset[str]
    v_head_dim: bool
    document_mask: str
    blocked: bool = False
    chip_only: bool = False
    custom_call: str | None = None
    why: str = ""

    def refuses(self, needs: frozenset[str], dtype: str) -> str | None:
        """Why this kernel cannot run an attention that needs `needs` in `dtype`, else None."""
        missing = sorted(needs - self.options)
        if missing:
            return f"{self.name} takes no {' or '.join(missing)} ({self.why})"
        if dtype not in self.dtypes:
            return f"{self.name} takes {' or '.join(sorted(self.dtypes))}, not {dtype}"
        return None


ATTENTION_KERNELS: dict[str, AttentionKernel] = {
    kernel.name: kernel
    for kernel in (
        # jax.nn.dot_product_attention's XLA path, which (as its cuDNN one) requires v's head dim to be k's.
        AttentionKernel(
            "xla",
            options=frozenset({"window", "scale"}),
            dtypes=frozenset({"float32", "bfloat16", "float16"}),
            v_head_dim=False,
            document_mask="dense",
            why="jax.nn.dot_product_attention has none",
        ),
        # The plain-XLA path (einsums, a softmax): everything, at the cost of the whole [seq, seq] scores.
        AttentionKernel(
            "xla_ops",
            options=ATTENTION_OPTIONS,
            dtypes=frozenset({"float32", "bfloat16", "float16"}),
            v_head_dim=True,
            document_mask="dense",
        ),
        # Pallas local masks, attn_logits_soft_cap, and the kernel's `sinks` argument (jax 0.12: forward in the
        # kernel, their gradient beside it); its forward and backward kernels size q/k and v blocks apart
        # (head_dim_qk, head_dim_v).
        AttentionKernel(
            "splash",
            options=ATTENTION_OPTIONS,
            dtypes=frozenset({"float32", "bfloat16"}),
            v_head_dim=True,
            document_mask="segment_ids",
            blocked=True,
            chip_only=True,
            custom_call="tpu_custom_call",
        ),
        # cuDNN's fused attention has a sliding window and neither a soft-cap nor sinks: jax.nn.dot_product_attention
        # takes no sinks, and the logsumexp it returns (return_residual) takes no gradient in its cuDNN backward, so
        # the sinks cannot be folded in after the kernel either.
        AttentionKernel(
            "cudnn",
            options=frozenset({"window", "scale"}),
            dtypes=frozenset({"bfloat16", "float16"}),
            v_head_dim=False,
            document_mask="dense",
            chip_only=True,
            custom_call='__cudnn[^"]*',
            why="cuDNN's fused attention has none",
        ),
    )
}

# Where a node needs what its target's kernel lacks, or the target's kernel needs a chip that is missing: the first
# of these that takes it.
ATTENTION_FALLBACKS = ("xla", "xla_ops")


@dataclass(frozen=True)
class GroupedMatmulKernel:
    """A grouped matmul kernel for a dropless MoE's experts: the operand dtypes it takes (`int8`, `fp8` for
    quantized experts) and why it takes no others, the path that stands in for it where the chip is missing
    (AXGEN_XLA_KERNELS=1), whether its outputs name the mesh axes they vary over (shard_map's check needs them),
    and the custom call it compiles to."""

    name: str
    dtypes: frozenset[str]
    why: str = ""
    stand_in: str | None = None
    names_varying_axes: bool = True
    custom_call: str | None = None


GROUPED_MATMUL_KERNELS: dict[str, GroupedMatmulKernel] = {
    kernel.name: kernel
    for kernel in (
        # XLA's ragged_dot; int8 and fp8 by runtime/quantized_experts.py.
        GroupedMatmulKernel(
            "ragged_dot", dtypes=frozenset({"float32", "bfloat16", "float16", "int8", "fp8"})
        ),
        # ragged_dot_mgpu returns its operands' dtype from an f32 accumulator: int8 fails to lower; e4m3 fails on
        # "Only f16 WGMMA supports transposes" (compiled deviceless for gpu-h100-8).
        GroupedMatmulKernel(
            "mosaic_gpu",
            dtypes=frozenset({"bfloat16", "float16"}),
            why="ragged_dot_mgpu takes no int8 or fp8 operands",
            stand_in="ragged_dot",
            custom_call='mosaic_gpu[^"]*',
        ),
        # megablox's outputs name no mesh axes they vary over, which shard_map's check refuses; unchecked, values
        # and gradients are the same (JEP 17111). megablox.gmm refuses int8 and fp8 (common.assert_is_supported_dtype).
        GroupedMatmulKernel(
            "megablox_gmm",
            dtypes=frozenset({"float32", "bfloat16"}),
            why="megablox.gmm takes bfloat16 or float32 operands only",
            stand_in="ragged_dot",
            names_varying_axes=False,
            custom_call="tpu_custom_call",
        ),
    )
}
