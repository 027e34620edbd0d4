"""Collective bytes per device per step of a compiled train step's optimized HLO, counted by axgen's own
`axgen.analysis.hlo_cost` (each loop body as often as it runs; an all-reduce twice its result, as a ring sends
it), so that MaxText's HLO and axgen's are counted the same way. Prints one line:

    COLLECTIVE_GIB=<total> all-gather=<GiB> all-reduce=<GiB> ...

Usage (the project's virtualenv): .venv/bin/python bench/maxtext/collectives.py STEP.hlo
"""

import sys
from pathlib import Path

from axgen.analysis.hlo_cost import hlo_cost

GIB = 2**30


def main(path: str) -> None:
    collective = hlo_cost(Path(path).read_text()).collective_bytes
    kinds = " ".join(f"{kind}={value / GIB:.2f}" for kind, value in collective.items())
    print(f"COLLECTIVE_GIB={sum(collective.values()) / GIB:.2f} {kinds}")


if __name__ == "__main__":
    main(sys.argv[1])
