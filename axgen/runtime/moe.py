"""Routed experts (mixture of experts), by the options the lowering chose for each `moe` node: the router's scoring
and top-k (Mixtral, Qwen-MoE, DeepSeek's sigmoid scores, group-limited choice and correction bias), the experts'
activation (gpt-oss's clamped SwiGLU and biases too), the grouped matmul kernel (XLA's ragged_dot, Mosaic GPU,
megablox, the quantized ragged dots), how token copies reach the experts' devices, and the checkpoint names remat
policies save. A program passes each node's options as keywords; everything here is shared.

Shapes: x [batch, seq, embed], router_logits [batch, seq, experts], w_gate and w_up [experts, embed, mlp] (w_gate
None for an ungated activation), w_down [experts, mlp, embed]. Each path returns the output [batch, seq, embed]
and a dict of auxiliary losses (and metrics: the capacity path's dropped fraction).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import PartitionSpec as P

from axgen.runtime.kernels import GROUPED_MATMUL_KERNELS
from axgen.runtime.quantized_experts import fp8_ragged_dot, int8_ragged_dot
from axgen.runtime.sharding import logical_to_mesh, mesh_axes, varying_axes, varying_over

QUANTIZED_RAGGED_DOTS = {"int8": int8_ragged_dot, "fp8": fp8_ragged_dot}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Routing:
    """How a router chooses each token's experts and weighs them. `scoring`: "softmax" over the experts (Mixtral,
    Qwen-MoE) or a "sigmoid" score per expert (DeepSeek-V3). `renormalize`: the top_k weights rescaled to sum to 1.
    `routed_scale`: what the weights are multiplied by (DeepSeek's routed_scaling_factor). With `n_group`, a token
    chooses among the experts of its best `topk_group` of `n_group` equal groups, a group ranked by `group_score`:
    "top2_sum" (the sum of its two highest scores, DeepSeek-V3's noaux_tc) or "max" (its highest, DeepSeek-V2's
    group_limited_greedy). `seq_balance_loss`: route also returns DeepSeek-V3's sequence-wise balance loss. Every
    field is stated: a program prints them all."""

    top_k: int
    scoring: str
    renormalize: bool
    routed_scale: float | None
    n_group: int | None
    topk_group: int | None
    group_score: str | None
    seq_balance_loss: bool


def in_top_groups(choice, routing: Routing):
    """choice [..., experts] with the experts outside each token's best `topk_group` of `n_group` equal groups set
    to -inf."""
    groups = choice.reshape(*choice.shape[:-1], routing.n_group, -1)
    if routing.group_score == "top2_sum":
        group_scores = jax.lax.top_k(groups, 2)[0].sum(axis=-1)
    else:
        group_scores = groups.max(axis=-1)
    top_groups = jax.lax.top_k(group_scores, routing.topk_group)[1]
    kept = jax.nn.one_hot(top_groups, routing.n_group, dtype=jnp.bool_).any(axis=-2)
    return jnp.where(kept[..., None], groups, -jnp.inf).reshape(choice.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def top_k_corrected(scores, correction_bias, routing: Routing, batch_axes=None):
    """The top_k experts of each token by scores + correction_bias (within its best groups, with `n_group`), and
    their scores alone as weights: the bias chooses experts and weights none (DeepSeek-V3's
    e_score_correction_bias). It takes no gradient: backward returns each expert's load in its place, how many of
    the batch's tokens chose it (summed over `batch_axes`), from which the train step moves the bias toward balance
    (runtime.balanced, at the rate its ParamSpec states)."""
    choice = scores + correction_bias
    if routing.n_group:
        choice = in_top_groups(choice, routing)
    experts = jax.lax.top_k(choice, routing.top_k)[1]
    return jnp.take_along_axis(scores, experts, axis=-1), experts


def _top_k_corrected_forward(scores, correction_bias, routing, batch_axes):
    weights, experts = top_k_corrected(scores, correction_bias, routing, batch_axes)
    return (weights, experts), (experts, correction_bias)


def _top_k_corrected_backward(routing, batch_axes, saved, cotangents):
    experts, correction_bias = saved
    chosen = jax.nn.one_hot(experts, correction_bias.shape[-1], dtype=jnp.float32)  # [..., top_k, experts]
    d_scores = jnp.einsum("...k,...ke->...e", cotangents[0], chosen)
    load = chosen.sum(axis=tuple(range(chosen.ndim - 1)))
    load = jax.lax.psum(load, batch_axes) if batch_axes else load
    return d_scores, load.astype(correction_bias.dtype)


top_k_corrected.defvjp(_top_k_corrected_forward, _top_k_corrected_backward)


def route(router_logits, routing: Routing, batch_axes=None, correction_bias=None, sequence_axes=None):
    """Each token's experts and their weights [..., top_k] as `routing` says, scores in float32, and the auxiliary
    losses: the Switch Transformer load balance num_experts * sum_e(f_e * p_e), f_e = top-k choices of expert e per
    token, p_e = its mean probability (top_k when perfectly balanced), and the ST-MoE router z-loss
    mean(logsumexp(logits)^2). With sigmoid scores, a token's probabilities are its scores over their sum. On one
    device's rows of the batch, split over the mesh axes `batch_axes`, the means are still over the whole batch.
    `correction_bias` [experts] (DeepSeek-V3) joins the scores to choose the experts and weights none
    (top_k_corrected). With `routing.seq_balance_loss`, DeepSeek-V3's sequence-wise balance loss is the same product
    per sequence (the rows of the last axis but one), with f_e a fraction of the sequence's tokens, times
    num_experts / top_k, averaged over the sequences; where each sequence is split over the mesh axes
    `sequence_axes` (context shards, which `batch_axes` include too), its means are the shards' mean."""
    top_k = routing.top_k
    logits = router_logits.astype(jnp.float32)
    if routing.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(axis=-1, keepdims=True)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        scores = probs
    if correction_bias is not None:
        weights, experts = top_k_corrected(scores, correction_bias, routing, batch_axes)
    elif routing.n_group:
        experts = jax.lax.top_k(in_top_groups(scores, routing), top_k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    else:
        weights, experts = jax.lax.top_k(scores, top_k)
    if routing.renormalize and routing.scoring == "sigmoid":
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    elif routing.renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if routing.routed_scale:
        weights = weights * routing.routed_scale
    num_experts = probs.shape[-1]

    def token_mean(x):
        mean = x.mean(axis=tuple(range(probs.ndim - 1)))
        return jax.lax.pmean(mean, batch_axes) if batch_axes else mean

    choices = jax.nn.one_hot(experts, num_experts).sum(axis=-2)  # [..., experts]: 1 where chosen
    load_balance = num_experts * jnp.sum(token_mean(choices) * token_mean(probs))
    z_loss = token_mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    losses = {"load_balance_loss": load_balance, "router_z_loss": z_loss}
    if routing.seq_balance_loss:

        def sequence_mean(x):
            mean = x.mean(axis=-2)
            return jax.lax.pmean(mean, sequence_axes) if sequence_axes else mean

        per_sequence = num_experts / top_k * jnp.sum(sequence_mean(choices) * sequence_mean(probs), axis=-1)
        # Each sequence's loss is the same on all of its context shards: the mean over sequences is over the rest.
        rows_axes = tuple(a for a in batch_axes or () if a not in (sequence_axes or ()))
        seq_balance = jax.lax.pmean(per_sequence.mean(), rows_axes) if rows_axes else per_sequence.mean()
        losses["seq_balance_loss"] = seq_balance
    return weights, experts, losses


def expert_mlp(gate, up, *, activation, swiglu_limit=None, swiglu_alpha=None):
    """The spec's MLP `activation` on each expert's hidden units (`gate` is None for "gelu", which has no gate).
    gpt-oss's "clamped_swiglu": the gate clamped from above and up on both sides at `swiglu_limit`,
    gate * sigmoid(swiglu_alpha * gate) times up + 1."""
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    if activation == "clamped_swiglu":
        # min(gate, limit) twice, as programs before 0.7 printed it: one shared min sums the backward's two
        # cotangents in another order, which moves gradients by an ulp.
        limit, alpha = swiglu_limit, swiglu_alpha
        return (
            (jnp.clip(up, -limit, limit) + 1)
            * jnp.minimum(gate, limit)
            * jax.nn.sigmoid(alpha * jnp.minimum(gate, limit))
        )
    if activation == "geglu":
        return jax.nn.gelu(gate, approximate=True) * up
    if activation == "gelu":
        return jax.nn.gelu(up, approximate=False)
    raise ValueError(f"no expert activation {activation!r}: swiglu, clamped_swiglu, geglu or gelu")


def grouped_matmul(rows, weights, group_sizes, *, kernel, tiles):
    """rows [rows, in] x weights [experts, in, out] -> [rows, out]: each expert's contiguous group of rows times its
    own weights, as jax.lax.ragged_dot computes it, by `kernel`: "ragged_dot" (XLA's), "mosaic_gpu" (jax's Mosaic
    GPU kernel, 4-6x ragged_dot's speed on H100) or "megablox_gmm" (TPU; its own gradient runs tgmm for the
    weights), the kernels with the `tiles` the backend chose (None for ragged_dot). Rows after the last group give zeros (and, by the
    kernels, take no gradient: they leave them unwritten)."""
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(rows, weights, group_sizes)
    if kernel == "mosaic_gpu":
        # Inside shard_map, as ragged_dot's own rule does: the weights meet rows that vary over more mesh axes (the
        # batch's), and the transpose of this cast sums their gradient over those axes.
        varying = frozenset().union(*(varying_axes(a) for a in (rows, weights, group_sizes)))
        rows, weights, group_sizes = (varying_over(a, varying) for a in (rows, weights, group_sizes))
        return _mosaic_grouped_matmul(rows, weights, group_sizes, tuple(tiles.items()))
    if kernel == "megablox_gmm":
        # Row tiles divide the rows: a device's tokens x top_k, a multiple of 512 at any real sequence length.
        tiling = (math.gcd(rows.shape[0], tiles["tm"]), tiles["tk"], tiles["tn"])
        out = megablox.gmm(in_groups(rows, group_sizes), weights, group_sizes, rows.dtype, tiling)
        return in_groups(out, group_sizes)
    raise ValueError(f"no grouped matmul kernel {kernel!r}: ragged_dot, mosaic_gpu or megablox_gmm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mosaic_grouped_matmul(rows, weights, group_sizes, tiles):
    out = ragged_dot_mgpu.ragged_dot(rows, weights, group_sizes=group_sizes, **dict(tiles))
    return varying_over(in_groups(out, group_sizes), varying_axes(rows))


def _mosaic_grouped_matmul_forward(rows, weights, group_sizes, tiles):
    return _mosaic_grouped_matmul(rows, weights, group_sizes, tiles), (rows, weights, group_sizes)


def _mosaic_grouped_matmul_backward(tiles, saved, d_out):
    """The rows' gradient is the same kernel against each expert's weights transposed; the weights' gradient,
    each group's rows transposed times its output gradient, is the transposed kernel's."""
    rows, weights, group_sizes = saved
    d_rows = ragged_dot_mgpu.ragged_dot(
        d_out, weights, group_sizes=group_sizes, transpose_rhs=True, **dict(tiles)
    )
    d_weights = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        rows, d_out, group_sizes=group_sizes, **dict(tiles)
    )
    d_rows = in_groups(d_rows, group_sizes)
    return (
        varying_over(d_rows, varying_axes(rows)),
        varying_over(d_weights, varying_axes(weights)),
        None,
    )


_mosaic_grouped_matmul.defvjp(_mosaic_grouped_matmul_forward, _mosaic_grouped_matmul_backward)


def in_groups(x, group_sizes):
    """x with the rows after the last group zeroed: the kernels leave them unwritten."""
    return jnp.where(jnp.arange(x.shape[0])[:, None] < group_sizes.sum(), x, 0)


@dataclasses.dataclass(frozen=True)
class _Experts:
    """One MoE node's experts as its keywords state them: the grouped matmul, the activation, and the names its
    products are saved under for remat (`checkpoint_names`: (up and gate, down), or None)."""

    matmul: object
    activation: str
    swiglu_limit: float | None
    swiglu_alpha: float | None
    checkpoint_names: tuple[str, str] | None

    def products(self, rows, row_experts, group_sizes, w_gate, w_up, w_down, biases, mlp_axes):
        """The experts' MLP on `rows`, sorted by expert into `group_sizes`; `row_experts` is each row's expert
        (num_experts_here for rows in no group). With `biases` (b_gate, b_up, b_down: gpt-oss), each row's expert
        adds its biases to its products; the down projection's bias joins on the first device of the `mlp_axes`
        only, as the sum over them counts it once."""
        matmul = self.matmul
        gate = None if w_gate is None else _named(matmul(rows, w_gate, group_sizes), self.checkpoint_names, 0)
        up = _named(matmul(rows, w_up, group_sizes), self.checkpoint_names, 0)
        if biases is not None:
            b_gate, b_up, b_down = biases
            row_expert = jnp.minimum(row_experts, w_up.shape[0] - 1)  # rows in no group: zeroed by the caller
            if mlp_axes:
                b_down = jnp.where(jax.lax.axis_index(mlp_axes) == 0, b_down, 0)
            gate, up = gate + b_gate[row_expert], up + b_up[row_expert]
        hidden = expert_mlp(
            gate,
            up,
            activation=self.activation,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
        )
        down = _named(matmul(hidden, w_down, group_sizes), self.checkpoint_names, 1)
        if biases is not None:
            down = down + b_down[row_expert]
        return down


def _named(product, checkpoint_names, which):
    """`product` under its remat name, checkpoint_names[which] (0: up and gate, 1: down), where names are given."""
    return product if checkpoint_names is None else checkpoint_name(product, checkpoint_names[which])


def _experts(activation, swiglu_limit, swiglu_alpha, checkpoint_names, kernel, tiles, quantize):
    if quantize is None:
        matmul = functools.partial(grouped_matmul, kernel=kernel, tiles=tiles)
    elif kernel in GROUPED_MATMUL_KERNELS and quantize in GROUPED_MATMUL_KERNELS[kernel].dtypes:
        matmul = QUANTIZED_RAGGED_DOTS[quantize]
    else:
        raise ValueError(f"quantize={quantize!r} runs on XLA's ragged_dot, not the {kernel} kernel")
    return _Experts(matmul, activation, swiglu_limit, swiglu_alpha, checkpoint_names)


def moe_dropless(
    x,
    router_logits,
    w_gate,
    w_up,
    w_down,
    *,
    routing: Routing,
    activation,
    swiglu_limit,
    swiglu_alpha,
    correction_bias,
    biases,
    checkpoint_names,
    kernel,
    tiles,
    quantize,
    dispatch,
    check_vma,
    rules,
    receive_capacity=None,
):
    """Mixture of experts that drops no token (unless `receive_capacity` bounds the all-to-all, below). Each
    device routes its own rows of the batch: the expert weights reach it whole along `embed` (FSDP's all-gather),
    split along `expert` and `mlp` as the program's `rules` (LOGICAL_AXIS_RULES) say. Sorting the whole batch's
    tokens by expert instead would gather them all onto every device. The experts' products run by
    grouped_matmul's `kernel` with its `tiles`, or by a `quantize`d ragged dot ("int8", "fp8":
    runtime.int8_ragged_dot, fp8_ragged_dot), on a kernel whose entry in runtime/kernels.py takes them.
    `dispatch`: how token copies reach the devices of their experts where the experts are split, "all_gather"
    (every token of the expert group to every device), "ragged_all_to_all" or "all_to_all" (each copy only to its
    expert's device: _experts_by_all_to_all).
    `receive_capacity`, with an all-to-all `dispatch`: each device takes at most ceil(receive_capacity * copies /
    devices) token copies from each device of its expert group (`copies`: a device's tokens x top_k, so 1.0 is
    the even share), a receive buffer of receive_capacity x copies rows instead of the whole group's; the auxiliary
    outputs add `dropped_fraction` (_experts_by_all_to_all says which copies drop).
    `check_vma=False` is for a kernel whose outputs name no mesh axes they vary over, which shard_map's check
    refuses; unchecked, values and gradients are the same, the backward may sum a cotangent once more (JEP 17111).
    `biases`: (b_gate, b_up, b_down), each expert's bias per output, split as its weight's outputs are (gpt-oss).
    `checkpoint_names`: the names remat policies save the up/gate and down products under."""
    experts = _experts(activation, swiglu_limit, swiglu_alpha, checkpoint_names, kernel, tiles, quantize)
    on_device = functools.partial(
        _moe_dropless_on_device,
        routing=routing,
        experts=experts,
        dispatch=dispatch,
        receive_capacity=receive_capacity,
    )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return on_device(
            x, router_logits, w_gate, w_up, w_down, correction_bias=correction_bias, biases=biases
        )
    if rules is None:
        raise ValueError("moe_dropless on a mesh needs the program's rules (LOGICAL_AXIS_RULES) to split by")
    # Rows, and positions where the sequence is split over context shards (runtime/context.py): each device routes
    # its own tokens, and the routing's means run over every device that holds tokens.
    batch, seq = logical_to_mesh(rules, ("batch", "seq"), x.shape[:2], mesh.shape)
    expert, mlp = logical_to_mesh(rules, ("expert", "mlp"), (w_up.shape[0], w_up.shape[-1]), mesh.shape)
    rows, w_in, w_out = P(batch, seq), P(expert, None, mlp), P(expert, mlp, None)
    # The optional inputs travel only where given: the correction bias whole, the biases split with their weights.
    optional, optional_specs = {}, {}
    if correction_bias is not None:
        optional["correction_bias"], optional_specs["correction_bias"] = correction_bias, P()
    if biases is not None:
        optional["biases"] = biases
        optional_specs["biases"] = (P(expert, mlp), P(expert, mlp), P(expert, None))

    def per_device(x, router_logits, w_gate, w_up, w_down, optional):
        return on_device(
            x,
            router_logits,
            w_gate,
            w_up,
            w_down,
            batch_axes=(*mesh_axes(batch), *mesh_axes(seq)) or None,
            sequence_axes=mesh_axes(seq) or None,
            expert_axes=expert,
            mlp_axes=mlp,
            **optional,
        )

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rows, rows, w_in, w_in, w_out, optional_specs),
        out_specs=(rows, P()),
        check_vma=check_vma,
    )(x, router_logits, w_gate, w_up, w_down, optional)


def _moe_dropless_on_device(
    x,
    router_logits,
    w_gate,
    w_up,
    w_down,
    *,
    routing: Routing,
    experts: _Experts,
    dispatch,
    receive_capacity=None,
    batch_axes=None,
    sequence_axes=None,
    expert_axes=None,
    mlp_axes=None,
    correction_bias=None,
    biases=None,
):
    """One device's share of `moe_dropless`. Each token is copied once per chosen expert, the copies are sorted by
    expert, and each weight is one grouped matmul over the experts' contiguous groups of rows. With the experts
    split over `expert_axes`, the device gathers the tokens of its expert group, computes the copies routed to
    its own experts (the others sort last, in no group), and the group's partial outputs are summed back onto
    the devices the tokens came from; with `dispatch` other than all_gather, the copies travel to their experts'
    devices and back instead (`_experts_by_all_to_all`). With the hidden units split over `mlp_axes`, the partial
    outputs of the down projection are summed over them."""
    weights, chosen, aux = route(router_logits, routing, batch_axes, correction_bias, sequence_axes)
    tokens = x.reshape(-1, x.shape[-1])  # [tokens, embed]
    weights, chosen = weights.reshape(-1), chosen.reshape(-1)  # [tokens * top_k]
    num_experts_here = w_up.shape[0]
    top_k = routing.top_k
    if expert_axes and dispatch != "all_gather":
        out, kept = _experts_by_all_to_all(
            tokens,
            weights,
            chosen,
            w_gate,
            w_up,
            w_down,
            top_k,
            experts,
            expert_axes,
            dispatch,
            mlp_axes,
            biases,
            receive_capacity,
        )
        if mlp_axes:
            out = jax.lax.psum(out, mlp_axes)
        if receive_capacity is not None:
            kept, copies = kept.sum(), jnp.float32(chosen.shape[0])
            if batch_axes:
                kept, copies = jax.lax.psum(kept, batch_axes), jax.lax.psum(copies, batch_axes)
            aux["dropped_fraction"] = 1 - kept / copies
        return out.reshape(x.shape), aux
    if expert_axes:
        tokens, weights, chosen = (
            jax.lax.all_gather(a, expert_axes, tiled=True) for a in (tokens, weights, chosen)
        )
        chosen = chosen - jax.lax.axis_index(expert_axes) * num_experts_here
    here = (chosen >= 0) & (chosen < num_experts_here)
    chosen = jnp.where(here, chosen, num_experts_here)
    order = jnp.argsort(chosen)
    token_of_row = order // top_k
    rows = tokens[token_of_row]
    group_sizes = jnp.bincount(chosen, length=num_experts_here)
    down = experts.products(rows, chosen[order], group_sizes, w_gate, w_up, w_down, biases, mlp_axes)
    out = down * weights[order, None].astype(x.dtype)
    out = jnp.zeros_like(tokens).at[token_of_row].add(jnp.where(here[order, None], out, 0))
    if mlp_axes:
        out = jax.lax.psum(out, mlp_axes)
    if expert_axes:
        out = jax.lax.psum_scatter(out, expert_axes, tiled=True)
    return out.reshape(x.shape), aux


def _experts_by_all_to_all(
    tokens,
    weights,
    chosen,
    w_gate,
    w_up,
    w_down,
    top_k,
    experts,
    expert_axes,
    dispatch,
    mlp_axes,
    biases=None,
    receive_capacity=None,
):
    """The experts' outputs for this device's token copies [tokens * top_k] chosen among all experts, summed onto its
    tokens [tokens, embed], when the experts are split over `expert_axes`: each copy travels only to the device
    that holds its expert, and its output comes back the same way; and which copies were kept [tokens * top_k].

    The copies are sorted by destination device, and within a destination first choices before second choices
    (then by token); each device sorts what it receives by its own experts for the grouped matmul, restores the
    order it received them in, and sends the outputs back. Each device keeps a block of `block` rows for each
    sender. Without `receive_capacity` a block holds every copy of its sender (all of them choosing this device's
    experts), so nothing is dropped and values and gradients equal the all-gather path's. With it, a block holds
    ceil(receive_capacity * copies / devices) rows, and a sender's copies for a device beyond that are dropped,
    its tokens' later choices first: a dropped copy adds nothing to its token (which passes on through the
    residual) and its router weight gets no gradient, as in the capacity path. `dispatch` is the collective:
    ragged_all_to_all sends each device exactly its kept copies (the per-destination counts are all-gathered
    first); all_to_all, for XLA:CPU, which has no ragged-all-to-all, sends every block whole, padding included.
    """
    num_experts_here = w_up.shape[0]
    devices, copies = jax.lax.axis_size(expert_axes), chosen.shape[0]
    block = (
        copies if receive_capacity is None else min(copies, math.ceil(receive_capacity * copies / devices))
    )
    destination_of = chosen // num_experts_here
    choice = jnp.arange(copies) % top_k  # a copy's rank among its token's choices: 0 first
    by_destination = jnp.lexsort((jnp.arange(copies), choice, destination_of))
    token_of_copy = by_destination // top_k
    destination, local_expert = jnp.divmod(chosen[by_destination], num_experts_here)
    counts = jnp.bincount(destination, length=devices).astype(jnp.int32)
    send_offsets = jnp.cumsum(counts) - counts
    slot = jnp.arange(copies) - send_offsets[destination]  # each copy's row in its destination's block
    kept = slot < block
    if dispatch == "ragged_all_to_all":
        all_counts = jax.lax.all_gather(counts, expert_axes)  # [sender, receiver]
        me = jax.lax.axis_index(expert_axes)
        send_sizes, recv_sizes = jnp.minimum(counts, block), jnp.minimum(all_counts[:, me], block)
        # A receiver keeps a block for each sender, in sender order, and sends each block back to where its
        # copies start in the sender's order.
        blocks_at = jnp.arange(devices, dtype=jnp.int32) * block
        back_offsets = (jnp.cumsum(all_counts, axis=1) - all_counts)[:, me]

        # jax types ragged_all_to_all's result as its output buffer: a fresh buffer is invariant, as if every
        # device received the same rows, and the transpose of the cast to varying that the experts' products then
        # need would sum the received rows' gradients over the devices (an all-reduce of the whole buffer, each
        # device's rows' gradient replaced by the group's sum). The buffers are typed as varying as what fills them.
        received_varies = varying_axes(tokens) | set(mesh_axes(expert_axes))

        def send(x, fill):
            buffer = jnp.full((devices * block, *x.shape[1:]), fill, x.dtype)
            args = (send_offsets, send_sizes, jnp.full_like(send_sizes, me * block), recv_sizes)
            return jax.lax.ragged_all_to_all(
                x, varying_over(buffer, received_varies), *args, axis_name=expert_axes
            )

        def send_back(y):
            buffer = jnp.zeros((copies, *y.shape[1:]), y.dtype)
            args = (blocks_at, recv_sizes, back_offsets, send_sizes)
            return jax.lax.ragged_all_to_all(
                y, varying_over(buffer, received_varies), *args, axis_name=expert_axes
            )

    elif dispatch == "all_to_all":

        def send(x, fill):
            blocks = jnp.full((devices, block, *x.shape[1:]), fill, x.dtype)
            blocks = blocks.at[destination, slot].set(x, mode="drop")  # a slot past the block: dropped
            return jax.lax.all_to_all(blocks, expert_axes, 0, 0).reshape(devices * block, *x.shape[1:])

        def send_back(y):
            blocks = jax.lax.all_to_all(y.reshape(devices, block, *y.shape[1:]), expert_axes, 0, 0)
            return blocks.at[destination, slot].get(mode="fill", fill_value=0)

    else:
        raise ValueError(f"no MoE dispatch {dispatch!r}: all_gather, ragged_all_to_all or all_to_all")
    received = send(tokens[token_of_copy], 0)
    received_experts = send(local_expert, num_experts_here)  # rows no copy filled: no expert, sorted last
    order = jnp.argsort(received_experts)
    rows = received[order]
    group_sizes = jnp.bincount(received_experts, length=num_experts_here)
    down = experts.products(
        rows, received_experts[order], group_sizes, w_gate, w_up, w_down, biases, mlp_axes
    )
    down = jnp.where((received_experts[order] < num_experts_here)[:, None], down, 0)
    out = send_back(jnp.zeros_like(down).at[order].set(down)) * weights[by_destination, None].astype(
        tokens.dtype
    )
    return jnp.zeros_like(tokens).at[token_of_copy].add(out), kept


def moe_with_capacity(
    x,
    router_logits,
    w_gate,
    w_up,
    w_down,
    *,
    routing: Routing,
    capacity_factor,
    activation,
    swiglu_limit,
    swiglu_alpha,
    correction_bias,
    biases,
    checkpoint_names,
):
    """Mixture of experts with a fixed buffer per expert and sequence, as in GShard: each expert takes
    ceil(top_k * seq * capacity_factor / experts) token copies of a sequence, first choices of every token
    before second choices, and drops the rest (they pass through on the residual). Dispatch and combine are
    einsums, so the expert axis shards like any other. The auxiliary outputs add `dropped_fraction`. The other
    keywords are moe_dropless's."""
    top_k = routing.top_k
    weights, chosen_experts, aux = route(router_logits, routing, correction_bias=correction_bias)
    batch, seq, _ = x.shape
    num_experts = w_up.shape[0]
    capacity = math.ceil(top_k * seq * capacity_factor / num_experts)
    chosen = jax.nn.one_hot(chosen_experts, num_experts, dtype=jnp.int32)  # [batch, seq, top_k, experts]
    by_priority = chosen.transpose(0, 2, 1, 3).reshape(batch, top_k * seq, num_experts)
    slot = jnp.cumsum(by_priority, axis=1).reshape(batch, top_k, seq, num_experts).transpose(0, 2, 1, 3) - 1
    kept = chosen * (slot < capacity)
    # [batch, seq, top_k, experts, slot]
    in_slot = kept[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.int32)
    dispatch = in_slot.sum(axis=2).astype(x.dtype)
    combine = (weights[..., None, None] * in_slot).sum(axis=2).astype(x.dtype)
    expert_in = jnp.einsum("bsec,bsm->becm", dispatch, x)
    gate = (
        None
        if w_gate is None
        else _named(jnp.einsum("becm,emf->becf", expert_in, w_gate), checkpoint_names, 0)
    )
    up = _named(jnp.einsum("becm,emf->becf", expert_in, w_up), checkpoint_names, 0)
    # Each expert's biases per output; an empty slot's output is combined with weight 0.
    if biases is not None:
        b_gate, b_up, b_down = biases
        gate, up = gate + b_gate[:, None], up + b_up[:, None]
    hidden = expert_mlp(gate, up, activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    expert_out = _named(jnp.einsum("becf,efm->becm", hidden, w_down), checkpoint_names, 1)
    if biases is not None:
        expert_out = expert_out + b_down[:, None]
    aux["dropped_fraction"] = 1 - kept.sum() / chosen.sum()
    return jnp.einsum("bsec,becm->bsm", combine, expert_out), aux
