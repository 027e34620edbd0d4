"""Both sides' buffer assignments side by side, from XLA dumps of the train step (docs/maxtext.md, "The rows that
miss 0.9x"): the bytes of each kind of allocation by memory space, then the largest temporaries in HBM by shape.

Usage: bench/maxtext/buffers.py AXGEN_DUMP MAXTEXT_DUMP [ROWS]
  AXGEN_DUMP    a program's folder of `axgen aot SPEC --target TARGET --dump-to DIR`: DIR/SPEC/TARGET
  MAXTEXT_DUMP  a folder XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_dump_to=DIR
                --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text" bench/maxtext/run_maxtext.sh ... wrote
  ROWS          how many shapes to list [16]
"""

import collections
import re
import sys
from pathlib import Path

GIB, MIB = 2**30, 2**20
ALLOCATION = re.compile(r"allocation \d+: size (\d+), (.*)")
VALUE = re.compile(r" value: <\d+ \S+ @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def buffer_assignment(dump: Path) -> Path:
    (path,) = dump.glob("*train_step*after_optimizations-buffer-assignment.txt")
    return path


def read(dump: Path) -> tuple[collections.Counter, dict]:
    """{(kind, memory space): bytes}, and {(bytes, shape): offsets} of the HBM temporaries of 32 MiB or more."""
    kinds, large, in_hbm_temp = collections.Counter(), collections.defaultdict(set), False
    for line in buffer_assignment(dump).open():
        if allocation := ALLOCATION.match(line):
            rest = allocation[2]
            kind = next((k for k in ("parameter", "preallocated-temp", "thread-local") if k in rest), "other")
            space = re.search(r"color (\d+)", rest)
            kinds[kind, int(space[1]) if space else 0] += int(allocation[1])
            in_hbm_temp = kind == "preallocated-temp" and not space
        elif (value := VALUE.match(line)) and in_hbm_temp and int(value[1]) >= 32 * MIB:
            large[int(value[1]), re.sub(r"\{.*", "", value[3])].add(int(value[2]))
    return kinds, large


def main(axgen_dump: str, maxtext_dump: str, rows: str = "16") -> None:
    (ax_kinds, ax_large), (mt_kinds, mt_large) = read(Path(axgen_dump)), read(Path(maxtext_dump))
    print("allocation (kind, memory space)        axgen GiB   MaxText GiB")
    for key in sorted(set(ax_kinds) | set(mt_kinds), key=lambda k: -max(ax_kinds[k], mt_kinds[k])):
        if max(ax_kinds[key], mt_kinds[key]) >= MIB:
            print(f"{str(key):38s} {ax_kinds[key] / GIB:9.2f} {mt_kinds[key] / GIB:13.2f}")

    def listed(large):
        ordered = sorted(large.items(), key=lambda item: -item[0][0])[: int(rows)]
        return [f"{size / MIB:8.0f} MiB {shape} x{len(offsets)}" for (size, shape), offsets in ordered]

    ax, mt = listed(ax_large), listed(mt_large)
    print("\nlargest HBM temporaries (bytes, shape, at how many offsets): axgen | MaxText")
    for left, right in zip(ax + [""] * (len(mt) - len(ax)), mt + [""] * (len(ax) - len(mt))):
        print(f"{left:58s} | {right}")


if __name__ == "__main__":
    main(*sys.argv[1:])
