"""Runs an emitted program's `main()` on fake CPU devices, as its own target's mesh or as one device:

    python tests/run_program.py PROGRAM DEVICES [--single-device] -- --data DATASET --run-dir DIR --steps N

One process stands in for every host, and AXGEN_XLA_KERNELS=1 (the programs' one switch) takes the XLA path for
kernels that exist only on the chip. With --single-device the mesh is all ones: the same code, unsharded.
"""

import os
import sys

program_path, devices, *rest = sys.argv[1:]
single_device = rest[0] == "--single-device"
program_args = rest[rest.index("--") + 1 :]
os.environ.update(
    JAX_PLATFORMS="cpu",
    AXGEN_XLA_KERNELS="1",
    # the suite's own flags (tests/conftest.py: PROGRAM_ENV) and the device count
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={1 if single_device else devices}",
)

from axgen.interop import load_program  # noqa: E402  (after the environment is set)

program = load_program(program_path)
program.NUM_HOSTS = 1
if single_device:
    program.MESH_SHAPE = {axis: 1 for axis in program.MESH_SHAPE}
    program.DCN_MESH_SHAPE = None
    program.COMPILER_FLAGS = {}
program.main(program_args)
