"""How much device memory a compiled step needs: one formula, for a program's check before it allocates and for
`axgen aot`'s report."""


def step_peak_bytes(memory) -> int:
    """Per-device bytes a compiled step holds at its peak, from XLA's `memory_analysis()`: its arguments and
    outputs (donated ones once) and its temporaries. XLA's own peak counts buffers offloaded to pinned host memory
    as well (mistral-7b on v5e-256: its peak was the arguments plus the host bytes, to 37 KB), so it is taken as a
    device figure only when nothing is offloaded."""
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    if not host_bytes(memory):
        peak = max(peak, memory.peak_memory_in_bytes)
    return peak


def host_bytes(memory) -> int:
    """Bytes of the step's arguments and temporaries in host memory (offloaded activations or optimizer state)."""
    return memory.host_argument_size_in_bytes + memory.host_temp_size_in_bytes
