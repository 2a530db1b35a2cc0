#!/usr/bin/env python3
"""Builds our CPU kernels ahead of the first run (a container image, a job before a server starts),
for every ISA this CPU runs, or those named; then a run finds them built and starts in seconds.

    utils/build_kernels.py              # every build this CPU runs (on an AVX512-BF16 CPU, AVX2's too)
    utils/build_kernels.py --isa avx2   # that one

The builds land where a run looks for them (``$BLOOM_KERNELS_DIR``, else ``$TORCH_EXTENSIONS_DIR``,
else ``~/.cache/torch_extensions``), in a folder named by what determines the binary; it prints
each one. Exits non-zero if one could not be built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find bloom_hpu

from bloom_hpu.runtime.cpu import capability  # noqa: E402
from bloom_hpu.runtime.cpu.kernels import FLAGS, KernelsUnavailable, load, recipe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", action="append", choices=list(FLAGS), help="a build to make (repeatable); "
                   "default: every one this CPU runs")
    args = p.parse_args(argv)
    cap = capability.detect()
    isas = args.isa or [isa for isa in FLAGS if cap.can_run(isa)]
    if not isas:
        print(f"no kernel build runs on this CPU ({cap.why}): runs use PyTorch's operations", file=sys.stderr)
        return 0
    failed = 0
    for isa in isas:
        if not cap.can_run(isa):  # its probe call would stop the process (an illegal instruction)
            print(f"{isa}: this CPU cannot run it ({cap.why})", file=sys.stderr)
            failed += 1
            continue
        try:
            load(isa)  # built if needed, then checked by its probe call (which needs a CPU that runs it)
            print(f"{isa}: {recipe(isa).folder()}")
        except KernelsUnavailable as error:
            print(f"{isa}: the kernels {error}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
