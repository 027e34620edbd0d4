"""Runs MaxText 0.2.5's own deviceless compile (maxtext.trainers.pre_train.train_compile.main) unchanged, and
additionally prints every field of the compiled train step's memory_analysis() as one JSON line:
  MAXTEXT_MEMORY_JSON {"argument_size_in_bytes": ..., "peak_memory_in_bytes": ..., ...}
(MaxText itself prints `Memory analysis: CompiledMemoryStats(...)`, whose repr omits peak_memory_in_bytes.)
With HLO_OUT set, it also writes the compiled step's optimized HLO there, for collectives.py to count.
Usage: python mt_compile.py <maxtext base.yml> key=value ...   (the same argv train_compile takes)
"""

import json
import os
import sys

from absl import app
from maxtext.trainers.pre_train import train_compile

_jit_and_compile = train_compile.jit_and_compile


def _jit_and_compile_and_report(*args, **kwargs):
    compiled = _jit_and_compile(*args, **kwargs)
    stats = compiled.memory_analysis()
    fields = {name: int(getattr(stats, name)) for name in dir(stats) if name.endswith("_in_bytes")}
    print("MAXTEXT_MEMORY_JSON " + json.dumps(fields, sort_keys=True), flush=True)
    if os.environ.get("HLO_OUT"):
        with open(os.environ["HLO_OUT"], "w") as f:
            f.write(compiled.as_text())
    return compiled


train_compile.jit_and_compile = _jit_and_compile_and_report  # main() looks it up in the module at call time

if __name__ == "__main__":
    app.run(train_compile.main, argv=[sys.argv[0], *sys.argv[1:]])
