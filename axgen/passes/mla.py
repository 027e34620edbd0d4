"""Multi-head latent attention (DeepSeek-V2/V3): the q, k and v projections of every attention become MLA's.

    q            = q_b(rmsnorm(q_a(x)))  or  q_proj(x)                      [heads, nope + rope]
    kv_a(x)      = [latent | k_pe]                                           [kv_lora_rank + rope]
    [k_nope | v] = kv_b(rmsnorm(latent))                                     [heads, nope + v_head_dim]
    k            = [k_nope | k_pe broadcast to every head]                   [heads, nope + rope]

The rope pass, after this one, turns the last `qk_rope_head_dim` channels of q and k (F.rope's rotary_dim), which
are k_pe's for k: turning the broadcast copies is the same as turning k_pe once. The attention then takes q, k
with nope + rope channels and v with v_head_dim, and the output projection reads v_head_dim channels a head.
Training computes the up-projected keys and values, as transformers does; the latent is what inference caches.
"""

from dataclasses import dataclass

from axgen.ir import LAYER, Attrs, Graph, HFWeight, Node, Param, ShapeError, TensorType, register_op
from axgen.passes.manager import register
from axgen.spec import MLA


@dataclass(frozen=True, kw_only=True)
class SliceAttrs(Attrs):
    """Channels [start, stop) of the last axis."""

    start: int
    stop: int


def _slice(ins, attrs, params):
    x = ins["x"]
    if not 0 <= attrs.start < attrs.stop <= x.sizes[-1]:
        raise ShapeError(f"channels [{attrs.start}, {attrs.stop}) are not within x{x}")
    return TensorType(x.axes, (*x.sizes[:-1], attrs.stop - attrs.start))


def _concat_shared(ins, attrs, params):
    """x [batch, seq, kv_heads, head_dim] with one shared head, shared [batch, seq, latent], appended to each
    head's channels."""
    x, shared = ins["x"], ins["shared"]
    if x.axes != ("batch", "seq", "kv_heads", "head_dim") or shared.axes != ("batch", "seq", "latent"):
        raise ShapeError(
            f"expected x[batch, seq, kv_heads, head_dim] and shared[batch, seq, latent]; got {x}, {shared}"
        )
    return TensorType(x.axes, (*x.sizes[:-1], x.sizes[-1] + shared.sizes[-1]))


register_op("slice", ("x",), _slice, "mla", SliceAttrs)
register_op("concat_shared", ("x", "shared"), _concat_shared, "mla")


@register("mla", before=("rope", "sliding_window", "attention_sinks", "out_bias", "softcap", "gemma_block"))
def mla(g: Graph, cfg: MLA) -> None:
    for attn in list(g.nodes(op="attention")):
        region, ins = attn.region, g.inputs(attn)
        h = g.inputs(ins["q"])["x"]
        out_proj = next(n for n in g.nodes(op="linear", region=region) if g.inputs(n)["x"] is attn)
        replaced = {n.name for n in (ins["q"], ins["k"], ins["v"], attn, out_proj)}
        old = g.subgraph(region, lambda n: n.name in replaced)
        embed = h.type.drop("batch", "seq")
        heads = ins["q"].type.drop("batch", "seq", "head_dim")
        kv_heads = ins["k"].type.drop("batch", "seq", "head_dim")
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

        def project(name: str, x: Node, key: str, hf: str, w_type: TensorType) -> Node:
            w = Param(key, w_type, hf=HFWeight(f"{LAYER}.self_attn.{hf}.weight", transpose=True))
            return g.add(region, name, "linear", {"x": x}, {"w": w}, role="qkv_proj")

        def norm(name: str, x: Node, hf: str) -> Node:
            last = x.type.drop("batch", "seq")
            scale = Param(name, last, init="ones", decay=False, hf=HFWeight(f"{LAYER}.self_attn.{hf}.weight"))
            return g.add(region, name, "rms_norm", {"x": x}, {"scale": scale}, eps=cfg.eps)

        q_heads = heads.concat(TensorType.of(("head_dim", qk)))
        if cfg.q_lora_rank is None:
            q = project("query", h, "wq", "q_proj", embed.concat(q_heads))
        else:
            q_latent = TensorType.of(("latent", cfg.q_lora_rank))
            q_a = project("q_a", h, "wq_a", "q_a_proj", embed.concat(q_latent))
            q_a = norm("q_a_norm", q_a, "q_a_layernorm")
            q = project("query", q_a, "wq_b", "q_b_proj", q_latent.concat(q_heads))
        kv_a_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        kv_a = project(
            "kv_a", h, "wkv_a", "kv_a_proj_with_mqa", embed.concat(TensorType.of(("latent", kv_a_width)))
        )
        latent = g.add(region, "kv_latent", "slice", {"x": kv_a}, start=0, stop=cfg.kv_lora_rank)
        k_pe = g.add(region, "k_pe", "slice", {"x": kv_a}, start=cfg.kv_lora_rank, stop=kv_a_width)
        latent = norm("kv_a_norm", latent, "kv_a_layernorm")
        per_head = TensorType.of(("head_dim", cfg.qk_nope_head_dim + cfg.v_head_dim))
        kv_b = project(
            "kv_b",
            latent,
            "wkv_b",
            "kv_b_proj",
            latent.type.drop("batch", "seq").concat(kv_heads).concat(per_head),
        )
        k_nope = g.add(region, "k_nope", "slice", {"x": kv_b}, start=0, stop=cfg.qk_nope_head_dim)
        v = g.add(region, "value", "slice", {"x": kv_b}, start=cfg.qk_nope_head_dim, stop=per_head.sizes[0])
        k = g.add(region, "key", "concat_shared", {"x": k_nope, "shared": k_pe})
        # The attention and the output projection are made anew, not rewired: a node's type is fixed when it is
        # made, and theirs change with v's head dim.
        new = g.add(
            region,
            "attention",
            "attention",
            {"q": q, "k": k, "v": v, "segment_ids": ins["segment_ids"]},
            attn.params,
            source=attn.source,
            label=attn.label,
            **attn.attrs.changed(),
        )
        w_o = out_proj.params["w"]
        o_type = heads.concat(TensorType.of(("head_dim", cfg.v_head_dim))).concat(embed)
        o = g.add(
            region,
            "attention_out",
            "linear",
            {"x": new},
            {"w": Param(w_o.key, o_type, hf=w_o.hf)},
            source=out_proj.source,
            label=out_proj.label,
            **out_proj.attrs.changed(),
        )
        g.replace(old, o)
