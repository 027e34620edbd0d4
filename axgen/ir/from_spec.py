"""Lowering: a validated `Model` spec becomes a graph of a main region and one repeated decoder block."""

from __future__ import annotations

from axgen.ir.graph import Graph, Node
from axgen.ir.types import Param, TensorType
from axgen.spec import LayerNorm, Model, RMSNorm

BLOCK = "layers"


def from_spec(spec: Model) -> Graph:
    g = Graph(spec.name)
    g.add_region("main")
    _decoder_block(g, spec)
    src = str(spec.origin)
    embed_type = TensorType.of(("embed", spec.d_model))
    tokens = g.add("main", "tokens", "input", source=src, label="tokens", type=TensorType.of("batch", "seq"))
    positions = g.add("main", "positions", "positions", {"tokens": tokens}, source=src, label="tokens")
    table = Param("embed", TensorType.of(("vocab", spec.vocab_size)).concat(embed_type), decay=False)
    x = g.add("main", "embed", "embed", {"tokens": tokens}, {"table": table}, source=src, label="embedding")
    x = g.add(
        "main",
        BLOCK,
        "scan",
        {"x": x, "positions": positions},
        source=str(spec.decoder.origin),
        label="decoder",
        blocks=(BLOCK,),
        steps=spec.decoder.num_layers,
    )
    x = _norm(g, "main", "final_norm", x, spec.decoder.norm)
    if spec.tie_embeddings:
        logits = g.add(
            "main",
            "logits",
            "lm_head",
            {"x": x},
            source=src,
            label="output",
            tied=True,
            vocab=spec.vocab_size,
        )
    else:
        w = Param("lm_head", embed_type.concat(TensorType.of(("vocab", spec.vocab_size))))
        logits = g.add(
            "main", "logits", "lm_head", {"x": x}, {"w": w}, source=src, label="output", tied=False
        )
    g.set_output(logits)
    return g


def _decoder_block(g: Graph, spec: Model) -> None:
    """One pre-norm Llama layer: x + attention(norm(x)), then + mlp(norm(.))."""
    decoder, attn, mlp = spec.decoder, spec.decoder.attention, spec.decoder.mlp
    g.add_region(BLOCK, repeat=decoder.num_layers, function="decoder_layer")
    d = ("embed", spec.d_model)
    x = g.add(
        BLOCK,
        "x",
        "input",
        source=str(decoder.origin),
        label="decoder",
        type=TensorType.of("batch", "seq", d),
    )
    # Every block receives token positions; passes that need them (rope) find this node by name.
    g.add(BLOCK, "positions", "input", source=str(decoder.origin), label="decoder", type=TensorType.of("seq"))

    a = str(attn.origin)
    h = _norm(g, BLOCK, "attn_norm", x, decoder.norm)
    heads, kv_heads, head_dim = (
        ("heads", attn.num_heads),
        ("kv_heads", attn.num_kv_heads),
        ("head_dim", attn.head_dim),
    )
    q = _linear(g, "q", h, "wq", (d, heads, head_dim), a, "attention")
    k = _linear(g, "k", h, "wk", (d, kv_heads, head_dim), a, "attention")
    v = _linear(g, "v", h, "wv", (d, kv_heads, head_dim), a, "attention")
    out = g.add(
        BLOCK, "attn", "attention", {"q": q, "k": k, "v": v}, source=a, label="attention", causal=True
    )
    out = _linear(g, "attn_out", out, "wo", (heads, head_dim, d), a, "attention")
    x = g.add(BLOCK, "x_attn", "add", {"x": x, "y": out}, source=a, label="attention")

    m = str(mlp.origin)
    h = _norm(g, BLOCK, "mlp_norm", x, decoder.norm)
    hidden = ("mlp", mlp.hidden_dim)
    if mlp.activation == "swiglu":
        gate = _linear(g, "gate", h, "w_gate", (d, hidden), m, "mlp")
        up = _linear(g, "up", h, "w_up", (d, hidden), m, "mlp")
        h = g.add(BLOCK, "hidden", "swiglu", {"gate": gate, "up": up}, source=m, label="mlp")
    else:
        h = g.add(
            BLOCK,
            "hidden",
            "gelu",
            {"x": _linear(g, "up", h, "w_up", (d, hidden), m, "mlp")},
            source=m,
            label="mlp",
        )
    out = _linear(g, "mlp_out", h, "w_down", (hidden, d), m, "mlp")
    g.set_output(g.add(BLOCK, "x_mlp", "add", {"x": x, "y": out}, source=m, label="mlp"))


def _linear(g: Graph, name: str, x: Node, weight: str, axes: tuple, source: str, label: str) -> Node:
    w = Param(weight, TensorType.of(*axes))
    return g.add(x.region, name, "linear", {"x": x}, {"w": w}, source=source, label=label)


def _norm(g: Graph, region: str, name: str, x: Node, norm: RMSNorm | LayerNorm) -> Node:
    last = TensorType(x.type.axes[-1:], x.type.sizes[-1:])
    src = str(norm.origin)
    if isinstance(norm, RMSNorm):
        params = {"scale": Param(name, last, init="ones", decay=False)}
        return g.add(region, name, "rms_norm", {"x": x}, params, source=src, label="norm", eps=norm.eps)
    params = {
        "scale": Param(f"{name}_scale", last, init="ones", decay=False),
        "bias": Param(f"{name}_bias", last, init="zeros", decay=False),
    }
    return g.add(region, name, "layer_norm", {"x": x}, params, source=src, label="norm", eps=norm.eps)
