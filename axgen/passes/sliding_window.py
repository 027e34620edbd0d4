"""Sliding-window attention: every attention of the decoder sees only the last `window` positions. With
`global_every=k` the decoder block splits in two, local and global, scanned in turn; the global copy (the last
layer of each group of k) keeps full attention. Layers after the last whole group (k not dividing the layers, as in
Gemma 3) are windowed, in a block and scan of their own."""

from axgen.ir import Graph
from axgen.passes.manager import FeatureConflict, register
from axgen.spec import SlidingWindow


@register("sliding_window", after=("moe",))
def sliding_window(g: Graph, cfg: SlidingWindow) -> None:
    for scan in list(g.nodes(op="scan")):
        local = scan.attrs.blocks
        if cfg.global_every:
            if len(local) > 1:
                raise FeatureConflict("moe", f"{scan} already alternates {', '.join(local)}")
            tail = g.regions[local[0]].repeat % cfg.global_every
            if tail:  # the layers after the last whole group are windowed, and scanned apart
                # Scanned apart, they run the same layer function with params of their own.
                g.split_tail(scan, tail, f"tail_{local[0]}", g.regions[local[0]].function)
                local = (*local, f"tail_{local[0]}")
            g.split_block(scan, cfg.global_every, f"global_{local[0]}", "global_decoder_layer")
        for block in local:
            for attn in list(g.nodes(op="attention", region=block)):
                g.update(attn, window=cfg.window)
