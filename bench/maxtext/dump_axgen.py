"""`axgen aot SPEC --target TARGET --json`, with XLA's dumps of the train step written to DIR (buffer assignment,
live ranges, optimized HLO), for bench/maxtext/buffers.py. `axgen aot` compiles in a process of its own whose
XLA_FLAGS it sets itself; this adds the dump flags to them.

Usage: bench/maxtext/dump_axgen.py SPEC TARGET DIR   (from the project root, with its .venv's python)
"""

import sys

import axgen.analysis.aot as aot
from axgen.cli import main


def with_dumps(environment, directory):
    def dumping(plan):
        env = environment(plan)
        flags = f"--xla_dump_to={directory} --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_as_text"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
        return env

    return dumping


if __name__ == "__main__":
    spec, target, directory = sys.argv[1:4]
    aot._environment = with_dumps(aot._environment, directory)
    sys.exit(main(["aot", spec, "--target", target, "--json"]))
