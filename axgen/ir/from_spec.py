"""Lowering: a validated `Model` spec becomes a graph of a main region and one repeated decoder block.

Each node's `source` names the spec field it comes from, by the file that set it and its path in the model
(`specs/llama2_7b.py: decoder.attention`), never by line: the emitted program prints it, and moving a line in a
spec must change no program."""

from __future__ import annotations

from axgen.ir.graph import Graph, Node
from axgen.ir.types import HFWeight, Param, TensorType
from axgen.spec import LayerNorm, Model, RMSNorm

BLOCK = "layers"
LAYER = "model.layers.{layer}"  # HF's prefix of one decoder layer's tensors


def from_spec(spec: Model) -> Graph:
    g = Graph(spec.name)
    g.add_region("main")
    _decoder_block(g, spec)
    model_file = spec.origin.file  # the inputs come from the model as a whole
    vocab = spec.origin.provenance("vocab_size")
    embed_type = TensorType.of(("embed", spec.d_model))
    token_type = TensorType.of("batch", "seq")
    tokens = g.add("main", "tokens", "input", source=model_file, label="tokens", type=token_type)
    # Which document of a packed sequence each token belongs to: attention stays inside it, positions restart.
    segment_ids = g.add("main", "segment_ids", "input", source=model_file, label="tokens", type=token_type)
    positions = g.add(
        "main",
        "positions",
        "positions",
        {"tokens": tokens, "segment_ids": segment_ids},
        source=model_file,
        label="tokens",
    )
    table_type = TensorType.of(("vocab", spec.vocab_size)).concat(embed_type)
    table = Param("embed", table_type, decay=False, hf=HFWeight("model.embed_tokens.weight"))
    x = g.add("main", "embed", "embed", {"tokens": tokens}, {"table": table}, source=vocab, label="embedding")
    x = g.add(
        "main",
        BLOCK,
        "scan",
        {"x": x, "positions": positions, "segment_ids": segment_ids},
        source=spec.decoder.origin.provenance("decoder"),
        label="decoder",
        blocks=(BLOCK,),
        steps=spec.decoder.num_layers,
    )
    x = _norm(g, "main", "final_norm", x, spec.decoder.norm, "model.norm")
    if spec.tie_embeddings:
        params = {}  # multiplies by the input embedding's table
    else:
        w_type = embed_type.concat(TensorType.of(("vocab", spec.vocab_size)))
        params = {"w": Param("lm_head", w_type, hf=HFWeight("lm_head.weight", transpose=True))}
    logits = g.add(
        "main",
        "logits",
        "lm_head",
        {"x": x},
        params,
        source=vocab,
        label="output",
        tied=spec.tie_embeddings,
        vocab=spec.vocab_size,
    )
    g.set_output(logits)
    g.attrs["spec_file"] = model_file
    g.attrs["config"] = _config(spec, model_file)
    return g


def _config(spec: Model, spec_file: str) -> tuple[tuple[str, object, str], ...]:
    """What the program's CONFIG states of the spec, as (key, value, comment): the model's shape and its
    training settings. Lowering adds what it computes from the graph (parameter count, FLOPs per token)."""
    attn, mlp = spec.decoder.attention, spec.decoder.mlp
    entries = [
        ("model", spec.name, ""),
        ("vocab_size", spec.vocab_size, ""),
        ("d_model", spec.d_model, ""),
        ("num_layers", spec.decoder.num_layers, ""),
        ("num_heads", attn.num_heads, ""),
        ("num_kv_heads", attn.num_kv_heads, ""),
        ("head_dim", attn.head_dim, ""),
        ("mlp_hidden", mlp.hidden_dim, mlp.activation),
        ("tie_embeddings", spec.tie_embeddings, ""),
        ("spec", spec_file, "datasets are checked against its vocab_size"),
    ]
    train = spec.train
    if train is None:  # a graph to inspect; building a program needs Train (the plan says so)
        return tuple(entries)
    opt = train.optimizer
    return tuple(
        entries
        + [
            ("seq_len", train.seq_len, ""),
            ("global_batch", train.global_batch, "sequences per step, over all devices"),
            ("steps", train.steps, "length of the learning-rate schedule"),
            ("warmup_steps", train.warmup_steps, ""),
            ("lr", opt.lr, "peak"),
            ("min_lr_ratio", opt.min_lr_ratio, ""),
            ("b1", opt.b1, ""),
            ("b2", opt.b2, ""),
            ("eps", opt.eps, ""),
            ("weight_decay", opt.weight_decay, ""),
            ("grad_clip", train.grad_clip, "global norm"),
            ("seed", train.seed, ""),
            ("checkpoint_every", train.checkpoint_every, "steps"),
        ]
    )


def _decoder_block(g: Graph, spec: Model) -> None:
    """One pre-norm Llama layer: x + attention(norm(x)), then + mlp(norm(.))."""
    decoder, attn, mlp = spec.decoder, spec.decoder.attention, spec.decoder.mlp
    g.add_region(BLOCK, repeat=decoder.num_layers, function="decoder_layer")
    d = ("embed", spec.d_model)
    layer = decoder.origin.provenance("decoder")
    x = g.add(
        BLOCK,
        "x",
        "input",
        source=layer,
        label="decoder",
        type=TensorType.of("batch", "seq", d),
    )
    # Every block receives each token's position in its document and its document's id; passes that need them
    # (rope) find these nodes by name.
    for name in ("positions", "segment_ids"):
        g.add(
            BLOCK,
            name,
            "input",
            source=layer,
            label="decoder",
            type=TensorType.of("batch", "seq"),
        )

    a = attn.origin.provenance("decoder.attention")
    h = _norm(g, BLOCK, "attn_norm", x, decoder.norm, f"{LAYER}.input_layernorm")
    heads, kv_heads, head_dim = (
        ("heads", attn.num_heads),
        ("kv_heads", attn.num_kv_heads),
        ("head_dim", attn.head_dim),
    )
    q = _linear(g, "q", h, "wq", "self_attn.q_proj", (d, heads, head_dim), a, "attention", "qkv_proj")
    k = _linear(g, "k", h, "wk", "self_attn.k_proj", (d, kv_heads, head_dim), a, "attention", "qkv_proj")
    v = _linear(g, "v", h, "wv", "self_attn.v_proj", (d, kv_heads, head_dim), a, "attention", "qkv_proj")
    segment_ids = g.node(BLOCK, "segment_ids")
    out = g.add(
        BLOCK,
        "attn",
        "attention",
        {"q": q, "k": k, "v": v, "segment_ids": segment_ids},
        source=a,
        label="attention",
        causal=True,
        scale=attn.scale,
    )
    out = _linear(
        g, "attn_out", out, "wo", "self_attn.o_proj", (heads, head_dim, d), a, "attention", "out_proj"
    )
    x = g.add(BLOCK, "x_attn", "add", {"x": x, "y": out}, source=a, label="attention")

    m = mlp.origin.provenance("decoder.mlp")
    h = _norm(g, BLOCK, "mlp_norm", x, decoder.norm, f"{LAYER}.post_attention_layernorm")
    hidden = ("mlp", mlp.hidden_dim)
    if mlp.activation == "swiglu":
        gate = _linear(g, "gate", h, "w_gate", "mlp.gate_proj", (d, hidden), m, "mlp", "mlp_in")
        up = _linear(g, "up", h, "w_up", "mlp.up_proj", (d, hidden), m, "mlp", "mlp_in")
        h = g.add(BLOCK, "hidden", "swiglu", {"gate": gate, "up": up}, source=m, label="mlp")
    else:
        h = g.add(
            BLOCK,
            "hidden",
            "gelu",
            {"x": _linear(g, "up", h, "w_up", "mlp.up_proj", (d, hidden), m, "mlp", "mlp_in")},
            source=m,
            label="mlp",
        )
    out = _linear(g, "mlp_out", h, "w_down", "mlp.down_proj", (hidden, d), m, "mlp", "mlp_out")
    g.set_output(g.add(BLOCK, "x_mlp", "add", {"x": x, "y": out}, source=m, label="mlp"))


def _linear(
    g: Graph, name: str, x: Node, weight: str, hf: str, axes: tuple, source: str, label: str, role: str
) -> Node:
    """A projection; its `role` is MaxText's name for it, which remat policies save or recompute by. `hf` names
    the layer's torch Linear, which stores the weight [out, in]."""
    w = Param(weight, TensorType.of(*axes), hf=HFWeight(f"{LAYER}.{hf}.weight", transpose=True))
    return g.add(x.region, name, "linear", {"x": x}, {"w": w}, source=source, label=label, role=role)


def _norm(g: Graph, region: str, name: str, x: Node, norm: RMSNorm | LayerNorm, hf: str) -> Node:
    last = TensorType(x.type.axes[-1:], x.type.sizes[-1:])
    src = norm.origin.provenance("decoder.norm")
    if isinstance(norm, RMSNorm):
        params = {"scale": Param(name, last, init="ones", decay=False, hf=HFWeight(f"{hf}.weight"))}
        return g.add(region, name, "rms_norm", {"x": x}, params, source=src, label="norm", eps=norm.eps)
    params = {
        "scale": Param(f"{name}_scale", last, init="ones", decay=False, hf=HFWeight(f"{hf}.weight")),
        "bias": Param(f"{name}_bias", last, init="zeros", decay=False, hf=HFWeight(f"{hf}.bias")),
    }
    return g.add(region, name, "layer_norm", {"x": x}, params, source=src, label="norm", eps=norm.eps)
