"""DeepSeek-V2 and V3, in both directions: multi-head latent attention (F.mla) with its YaRN-scaled softmax, and
DeepSeek-MoE (V2: softmax scores, greedy or group-limited top-k; V3: sigmoid scores with a correction bias,
noaux_tc groups, leading dense layers), a shared expert of n_shared_experts experts' width named `shared_experts`;
V3's published checkpoints store the projections as FP8 blocks (`axgen.hf.storage.Fp8Blocks`) and carry
multi-token-prediction layers axgen does not train."""

from __future__ import annotations

import math

from axgen.hf.adapter import GATE_UP_DOWN, Family
from axgen.hf.config import (
    LLAMA_DEFAULTS,
    Config,
    HFImportError,
    SpecSource,
    check_activation,
    decoder,
    literal,
    positive_int,
    shown,
)
from axgen.hf.rope import read_rope, write_scaling, yarn_mscale
from axgen.interop import CheckpointError
from axgen.spec import Model

# transformers 5.23's DeepseekV2Config (head_dim and qk_head_dim it derives from the qk dims, and saves).
DEEPSEEK_V2_DEFAULTS = LLAMA_DEFAULTS | {
    "vocab_size": 102_400,
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_group": None,
    "topk_group": None,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_head_dim": None,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "num_experts_per_tok": None,
    "moe_intermediate_size": 1407,
    # DeepSeek's own configs' balance-loss weight; transformers' model computes no balance loss.
    "aux_loss_alpha": 0.0,
    "scoring_func": "softmax",
    "moe_layer_freq": 1,
}


# transformers 5.23's DeepseekV3Config, and the keys of DeepSeek's own V3 configs it does not read (their remote
# code's: how it scores and chooses experts, which transformers' model does as noaux_tc with sigmoid scores).
DEEPSEEK_V3_DEFAULTS = LLAMA_DEFAULTS | {
    "vocab_size": 129_280,
    "hidden_size": 7168,
    "intermediate_size": 18_432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "qk_head_dim": None,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "moe_layer_freq": 1,
}


def read_deepseek_v2(c: Config) -> SpecSource:
    """DeepSeek-V2: multi-head latent attention (F.mla) whose RoPE turns the qk_rope_head_dim channels of each
    head in adjacent pairs, its softmax scale qk_head_dim**-0.5 times YaRN's mscale(factor, mscale_all_dim)**2
    where the RoPE states mscale_all_dim (transformers' yarn_apply_mscale); and DeepSeek-MoE in every layer:
    softmax over the routed experts, the greedy top-k kept as they are (transformers' deepseek_v2 renormalises
    nothing) and scaled by routed_scaling_factor, plus n_shared_experts experts' width of shared expert, ungated.
    """
    check_activation(c, "hidden_act", ("silu",))
    c.expect("attention_bias", (False, None), "puts biases on q_a, kv_a and o, which axgen's MLA does not")
    topk_method = c["topk_method"]
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise HFImportError(
            f"{c.path}: topk_method={shown(topk_method)} is not one transformers' deepseek_v2 computes "
            "(greedy, group_limited_greedy)"
        )
    if topk_method == "greedy":
        c.read |= {"n_group", "topk_group"}  # read by group_limited_greedy only
    # DeepSeek's own configs (its remote code's keys) say how they score and place experts and how their code
    # ran: transformers' model scores by softmax in every layer after the dense ones, whatever they say, so other
    # values are refused; ep_size is their inference's expert parallelism, seq_aux their balance loss's form
    # (axgen's is Switch's, weighted by aux_loss_alpha), auto_map their code's classes.
    c.expect(
        "scoring_func", ("softmax",), "scores experts otherwise than transformers' deepseek_v2 (softmax)"
    )
    c.expect(
        "moe_layer_freq", (1,), "puts experts in some layers only, which transformers' deepseek_v2 does not"
    )
    c.read |= {"ep_size", "seq_aux", "auto_map"}
    c.expect(
        "norm_topk_prob",
        (False,),
        "asks for renormalised top-k weights, which transformers' deepseek_v2 does not compute; axgen will not guess",
    )
    source = _deepseek_mla(c, interleaved=True)
    source.mlp = f'MLP(hidden_dim={literal(c["moe_intermediate_size"])}, activation="swiglu")'
    # V2's group_limited_greedy ranks a group by its best expert's score.
    groups = _deepseek_groups(c, "max") if topk_method == "group_limited_greedy" else ""
    source.features.append(
        f'F.moe(num_experts={c["n_routed_experts"]}, top_k={c["num_experts_per_tok"]}, renormalize=False, '
        + _deepseek_moe_fields(c)
        + groups
        + f'aux_loss_weight={float(c["aux_loss_alpha"])!r}, router_z_loss_weight=0.0)'
    )
    return source


def read_deepseek_v3(c: Config) -> SpecSource:
    """DeepSeek-V3: V2's multi-head latent attention, its RoPE's channels in adjacent pairs when rope_interleave
    (transformers de-interleaves q and k alike, which leaves q.k as the pairs give it) and in halves otherwise; and
    DeepSeek-MoE after the first first_k_dense_replace dense layers: sigmoid scores, the e_score_correction_bias
    added to choose experts (noaux_tc: the best topk_group of n_group groups by their two best experts' sum) but not
    to weight them, the chosen scores renormalised when norm_topk_prob and scaled by routed_scaling_factor, plus
    n_shared_experts experts' width of shared expert. The multi-token-prediction layers (num_nextn_predict_layers,
    the Hub's `model.layers.61.*`) are not trained here: convert-hf leaves their tensors out."""
    check_activation(c, "hidden_act", ("silu",))
    c.expect("attention_bias", (False, None), "puts biases on q_a, kv_a and o, which axgen's MLA does not")
    # DeepSeek's own configs state the routing transformers' read_deepseek_v3 computes whatever they say; other values
    # are refused. ep_size is their inference's expert parallelism, auto_map their code's classes.
    c.expect("topk_method", ("noaux_tc",), "is not the routing transformers' deepseek_v3 computes (noaux_tc)")
    c.expect(
        "scoring_func", ("sigmoid",), "scores experts otherwise than transformers' deepseek_v3 (sigmoid)"
    )
    c.expect(
        "moe_layer_freq", (1,), "puts experts in some layers only, which transformers' deepseek_v3 does not"
    )
    c.expect("seq_aux", (True,), "asks for a batch-wise balance loss; DeepSeek-V3's is sequence-wise")
    c.read |= {"ep_size", "auto_map"}
    mtp = c["num_nextn_predict_layers"]
    if type(mtp) is not int or mtp < 0:
        raise HFImportError(f"{c.path}: num_nextn_predict_layers={shown(mtp)} is not a count of layers")
    interleave = c["rope_interleave"]
    if type(interleave) is not bool:
        raise HFImportError(f"{c.path}: rope_interleave={shown(interleave)} is not true or false")
    source = _deepseek_mla(c, interleaved=interleave)
    source.checkpoint_comment = _fp8_storage(c)
    source.mlp = f'MLP(hidden_dim={literal(c["moe_intermediate_size"])}, activation="swiglu")'
    renormalize = c["norm_topk_prob"]
    if type(renormalize) is not bool:
        raise HFImportError(f"{c.path}: norm_topk_prob={shown(renormalize)} is not true or false")
    source.features.append(
        # The expressions' comments reach the written spec: black keeps them in the call.
        f'F.moe(num_experts={c["n_routed_experts"]}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={renormalize}, scoring="sigmoid", '
        + _deepseek_moe_fields(c)
        + _deepseek_groups(c, "top2_sum")
        + "\n# The config states no update rate for e_score_correction_bias: 0.0 holds the published bias as it"
        "\n# is (DeepSeek-V3's own rate for its last 500B tokens); 0.001 is its rate for the first 14.3T.\n"
        + "balance_bias_rate=0.0, "
        + f'seq_aux_loss_weight={float(c["aux_loss_alpha"])!r}, aux_loss_weight=0.0, router_z_loss_weight=0.0'
        + (
            f"\n# num_nextn_predict_layers={mtp}: the multi-token-prediction layers are not trained here;"
            "\n# convert-hf leaves their tensors (the Hub's model.layers.61.*) out.\n"
            if mtp
            else ""
        )
        + ")"
    )
    return source


# DeepSeek-V3's published quantization_config (V3.1's adds scale_fmt ue8m0: its scales are powers of two, still
# stored as float32), each key with the values convert-hf reads.
FP8_STORAGE = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),  # how DeepSeek's inference quantizes activations; training does not
    "scale_fmt": ("ue8m0",),
}


def _fp8_storage(c: Config) -> str:
    """`quantization_config`: DeepSeek-V3's checkpoints store each projection as float8_e4m3fn blocks with a float32
    weight_scale_inv per block, which convert-hf dequantizes (it does not change what the model computes); the
    comment the spec gets that says so, or "" for a checkpoint without one."""
    storage = c.values.get("quantization_config")
    c.read.add("quantization_config")
    if storage is None:
        return ""
    if not isinstance(storage, dict):
        raise HFImportError(
            f"{c.path}: quantization_config={shown(storage)} is not an object of storage settings, or null"
        )
    method = storage.get("quant_method")
    if method != "fp8":
        raise HFImportError(
            f"{c.path}: quantization_config.quant_method={shown(method)} is not a storage convert-hf reads (fp8)"
        )
    for key in sorted(storage):
        value = storage[key]
        if key == "weight_block_size":
            if not (
                isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)
            ):
                raise HFImportError(
                    f"{c.path}: quantization_config.weight_block_size={shown(value)} is not [rows, columns] of "
                    "a 2-D block"
                )
        elif key not in FP8_STORAGE:
            raise HFImportError(
                f"{c.path}: quantization_config.{key}={shown(value)} is not a key axgen's fp8 reading knows"
            )
        elif value not in FP8_STORAGE[key]:
            raise HFImportError(
                f"{c.path}: quantization_config.{key}={shown(value)} is not a storage convert-hf reads "
                f"({', '.join(FP8_STORAGE[key])})"
            )
    if "weight_block_size" not in storage:
        raise HFImportError(
            f"{c.path}: quantization_config states no weight_block_size, which convert-hf needs to read its blocks"
        )
    rows, columns = storage["weight_block_size"]
    powers = (
        "\n# scale_fmt ue8m0: the scales are powers of two, stored as float32."
        if "scale_fmt" in storage
        else ""
    )
    return (
        f"# The published checkpoint stores the projections as FP8 (e4m3) in {rows} x {columns} blocks, each with a"
        "\n# float32 weight_scale_inv (its quantization_config); convert-hf dequantizes them to checkpoint_dtype by"
        "\n# the block size in the checkpoint's config.json. Training does not keep FP8 blocks: the program trains"
        f"\n# in its own dtype.{powers}\n"
    )


def _deepseek_mla(c: Config, interleaved: bool) -> SpecSource:
    """DeepSeek-V2's and V3's attention: multi-head latent attention (F.mla) whose RoPE turns the qk_rope_head_dim
    channels of each head (in adjacent pairs when `interleaved`), its softmax scale qk_head_dim**-0.5 times YaRN's
    mscale(factor, mscale_all_dim)**2 where the RoPE states mscale_all_dim (transformers' yarn_apply_mscale). The
    source's features are the RoPE and the MLA."""
    heads = c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    c.expect(
        "num_key_value_heads",
        (None, heads),
        f"differs from num_attention_heads={heads}; MLA has a k, v per head",
    )
    c.expect(
        "head_dim",
        (None, rope),
        f"is not qk_rope_head_dim={rope}, which transformers' DeepSeek sets it to",
    )
    c.expect("qk_head_dim", (None, nope + rope), f"is not qk_nope_head_dim + qk_rope_head_dim={nope + rope}")
    source = decoder(c)
    rope_feature = read_rope(c)  # first: it checks the RoPE parameters that the softmax scale reads
    mscale = _mla_mscale(c)
    scale = (nope + rope) ** -0.5 * mscale * mscale
    source.attention = (
        f"Attention(num_heads={heads}, num_kv_heads={heads}, head_dim={nope + rope}, scale={scale!r})"
    )
    source.features = [
        rope_feature[:-1] + f", rotary_dim={rope}, interleaved={interleaved})",
        # transformers' DeepSeek norms the latents with DeepseekV2RMSNorm's default eps, not rms_norm_eps.
        f'F.mla(q_lora_rank={c["q_lora_rank"]}, kv_lora_rank={c["kv_lora_rank"]}, qk_nope_head_dim={nope}, '
        f"qk_rope_head_dim={rope}, v_head_dim={v}, eps=1e-06)",
    ]
    return source


def _mla_mscale(c: Config) -> float:
    """YaRN's mscale(factor, mscale_all_dim) where the RoPE states mscale_all_dim, else 1; `_rope` has checked
    the parameters (only YaRN reads mscale_all_dim)."""
    key = "rope_parameters" if "rope_parameters" in c.values else "rope_scaling"
    parameters = c.values.get(key) or {}
    if not parameters.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])


def _deepseek_groups(c: Config, score: str) -> str:
    """F.moe's group-limited top-k: n_group equal groups of the routed experts, the best topk_group chosen from."""
    experts, groups, chosen = c["n_routed_experts"], c["n_group"], c["topk_group"]
    if not positive_int(groups) or experts % groups:
        raise HFImportError(
            f"{c.path}: n_group={shown(groups)} does not split n_routed_experts={shown(experts)} into equal groups"
        )
    if not positive_int(chosen) or chosen > groups:
        raise HFImportError(
            f"{c.path}: topk_group={shown(chosen)} is not a count of groups up to n_group={groups}"
        )
    return f'n_group={groups}, topk_group={chosen}, group_score="{score}", '


def _deepseek_moe_fields(c: Config) -> str:
    """F.moe's fields that DeepSeek-V2 and V3 state alike: routed_scaling_factor, the shared experts' width, and the
    first first_k_dense_replace layers dense at intermediate_size (the experts' width is moe_intermediate_size).
    """
    shared = c["n_shared_experts"] * c["moe_intermediate_size"]
    fields = f'routed_scale={float(c["routed_scaling_factor"])!r}, shared_hidden_dim={literal(shared)}, '
    dense = c["first_k_dense_replace"]
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < c["num_hidden_layers"]:
        raise HFImportError(
            f"{c.path}: first_k_dense_replace={shown(dense)} is not a count of leading dense layers below "
            f"num_hidden_layers={shown(c['num_hidden_layers'])}"
        )
    c.read.add("intermediate_size")  # the dense layers' width, when there are any
    if dense:
        fields += f'first_dense_layers={dense}, dense_hidden_dim={literal(c["intermediate_size"])}, '
    return fields


def write_deepseek_v2(spec: Model) -> dict:
    """DeepSeek-V2: MLA's dims, DeepSeek-MoE in every layer (greedy softmax top-k, not renormalised, scaled by
    routed_scaling_factor, a shared expert of n_shared_experts experts' width), and the softmax scale as transformers
    derives it: qk_head_dim**-0.5 times YaRN's mscale(factor, mscale_all_dim)**2."""
    moe, rope = spec.feature("moe"), spec.feature("rope")
    width = spec.decoder.mlp.hidden_dim
    if moe is None or moe.every != 1 or moe.capacity_factor is not None:
        raise CheckpointError(f"{spec.origin}: DeepSeek-V2 in HF routes experts dropless in every layer")
    if moe.renormalize or moe.shared_gate or not moe.shared_hidden_dim or moe.shared_hidden_dim % width:
        raise CheckpointError(
            f"{moe.origin}: DeepSeek-V2 in HF keeps the top-k weights as they are and shares an ungated expert "
            f"of a whole number of experts' width ({width})"
        )
    if not rope.interleaved:
        raise CheckpointError(
            f"{rope.origin}: RoPE.interleaved=False: DeepSeek-V2 in HF turns MLA's rope channels in adjacent pairs"
        )
    v2_routing = {
        "scoring": moe.scoring == "softmax",
        "balance_bias_rate": moe.balance_bias_rate is None,
        "group_score": moe.n_group is None or moe.group_score == "max",
        "seq_aux_loss_weight": not moe.seq_aux_loss_weight,
    }
    for field, stated in v2_routing.items():
        if not stated:
            raise CheckpointError(
                f"{moe.origin}: MoE.{field}={getattr(moe, field)!r}: DeepSeek-V2 in HF scores by softmax with no "
                "correction bias or sequence-wise loss, and ranks groups by their best expert (group_score='max')"
            )
    return (
        _deepseek_attention(spec, "V2")
        | _deepseek_experts(moe, width)
        | {
            "topk_method": "greedy" if moe.n_group is None else "group_limited_greedy",
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "norm_topk_prob": False,
            "aux_loss_alpha": moe.aux_loss_weight or 0.0,
        }
        | _deepseek_dense_layers(moe, width)
    )


def _deepseek_attention(spec: Model, version: str) -> dict:
    """MLA's dims, and the softmax scale as transformers' DeepSeek derives it: qk_head_dim**-0.5 times YaRN's
    mscale(factor, mscale_all_dim)**2."""
    mla, rope = spec.feature("mla"), spec.feature("rope")
    if mla.eps != 1e-6:
        raise CheckpointError(
            f"{mla.origin}: MLA.eps={mla.eps!r}: DeepSeek-{version} in HF norms its latents with 1e-6"
        )
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scaling = write_scaling(rope.scaling)
    scale = spec.decoder.attention.scale
    if scale is not None and scale != qk**-0.5:
        scaling = (scaling or {}) | {"mscale_all_dim": _mscale_all_dim(spec, scale, qk)}
    return {
        "head_dim": mla.qk_rope_head_dim,
        "rope_scaling": scaling,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }


def _deepseek_experts(moe, width: int) -> dict:
    """DeepSeek-MoE's routed and shared experts: the shared expert is a whole number of experts' width."""
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_hidden_dim // width,
        "moe_intermediate_size": width,
        "routed_scaling_factor": moe.routed_scale or 1.0,
    }


def _deepseek_dense_layers(moe, width: int) -> dict:
    """first_k_dense_replace and intermediate_size, the leading dense layers' width (the experts' width where there
    are none, as DeepSeek's configs leave it unused)."""
    return {
        "first_k_dense_replace": moe.first_dense_layers,
        "intermediate_size": moe.dense_hidden_dim if moe.first_dense_layers else width,
    }


def write_deepseek_v3(spec: Model) -> dict:
    """DeepSeek-V3: MLA's dims and RoPE layout (rope_interleave), the softmax scale as V2's, and DeepSeek-MoE after
    the first_k_dense_replace dense layers: sigmoid scores with the e_score_correction_bias (a tensor of the
    checkpoint; its update rate is a training choice no config states), noaux_tc's groups ranked by their two best
    experts, norm_topk_prob, routed_scaling_factor and the shared experts. No multi-token-prediction layers are
    trained here, so none are written (num_nextn_predict_layers 0). The keys of DeepSeek's own configs
    (topk_method, scoring_func, seq_aux, aux_loss_alpha: the sequence-wise loss's weight) are written too."""
    moe, rope = spec.feature("moe"), spec.feature("rope")
    width = spec.decoder.mlp.hidden_dim
    if moe.every != 1 or moe.capacity_factor is not None:
        raise CheckpointError(f"{spec.origin}: DeepSeek-V3 in HF routes experts dropless in every MoE layer")
    if moe.shared_gate or not moe.shared_hidden_dim or moe.shared_hidden_dim % width:
        raise CheckpointError(
            f"{moe.origin}: DeepSeek-V3 in HF shares an ungated expert of a whole number of experts' width ({width})"
        )
    v3_routing = {
        "balance_bias_rate": moe.balance_bias_rate is not None,
        "group_score": moe.n_group is None or moe.group_score == "top2_sum",
        "aux_loss_weight": not moe.aux_loss_weight,
    }
    for field, stated in v3_routing.items():
        if not stated:
            raise CheckpointError(
                f"{moe.origin}: MoE.{field}={getattr(moe, field)!r}: DeepSeek-V3 in HF chooses experts with a "
                "correction bias, ranks groups by their two best experts (group_score='top2_sum') and has no "
                "Switch balance loss"
            )
    return (
        _deepseek_attention(spec, "V3")
        | _deepseek_experts(moe, width)
        | {
            "rope_interleave": rope.interleaved,
            # Without groups every expert is one group's: noaux_tc over one group chooses among them all.
            "n_group": moe.n_group or 1,
            "topk_group": moe.topk_group or 1,
            "norm_topk_prob": moe.renormalize,
            "num_nextn_predict_layers": 0,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "aux_loss_alpha": moe.seq_aux_loss_weight,
        }
        | _deepseek_dense_layers(moe, width)
    )


def _mscale_all_dim(spec: Model, scale: float, qk: int) -> float:
    """The mscale_all_dim whose YaRN temperature squared takes qk**-0.5 to `scale`, as transformers' DeepSeek
    scales its softmax; a scale no such value gives back exactly is refused."""
    attention, scaling = spec.decoder.attention, spec.feature("rope").scaling
    if scaling is not None and scaling.rule == "yarn" and scaling.factor > 1:
        log = math.log(scaling.factor)
        value = round(((scale * qk**0.5) ** 0.5 - 1) / (0.1 * log), 12)
        mscale = 0.1 * value * log + 1.0
        if value > 0 and qk**-0.5 * mscale * mscale == scale:
            return value
    raise CheckpointError(
        f"{attention.origin}: Attention.scale={scale!r}: DeepSeek-V2 in HF scales attention by qk_head_dim**-0.5, "
        "times YaRN's mscale_all_dim temperature squared, and no mscale_all_dim gives this scale"
    )


def mtp_tensors(names, spec: Model) -> set[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers), which its checkpoints
    number after the decoder's layers (the Hub's `model.layers.61.*`), each marked by its `eh_proj`: axgen does not
    train them, so convert-hf leaves them out. A deeper plain model's layers have no eh_proj and stay unexpected.
    """
    mtp = set()
    for name in names:
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3:] == ["eh_proj", "weight"]:
            if parts[2].isdigit() and int(parts[2]) >= spec.decoder.num_layers:
                mtp.add(f"model.layers.{parts[2]}.")
    return {name for name in names if name.startswith(tuple(mtp))}


_DEEPSEEK = dict(
    features=frozenset({"rope", "mla", "moe"}),
    scaled_attention=True,
    deepseek_layout=True,
    experts=GATE_UP_DOWN,
    shared_expert=".mlp.shared_experts.",
)
FAMILIES = [
    Family(
        "deepseek_v2",
        read_deepseek_v2,
        DEEPSEEK_V2_DEFAULTS,
        write=write_deepseek_v2,
        architecture="DeepseekV2ForCausalLM",
        **_DEEPSEEK,
    ),
    Family(
        "deepseek_v3",
        read_deepseek_v3,
        DEEPSEEK_V3_DEFAULTS,
        write=write_deepseek_v3,
        architecture="DeepseekV3ForCausalLM",
        storage="fp8",
        untrained=mtp_tensors,
        not_exported=("quantization_config", "num_nextn_predict_layers"),
        **_DEEPSEEK,
    ),
]
