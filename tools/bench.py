"""Benchmarks. Each prints a table and, as its last line, one JSON object.

    python tools/bench.py gae|model|convert|sync|step|scale

Timings are ratios against a reference measured in the same run, so a noisy shared machine
moves both sides together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCHES = {
    "gae": "bench_gae",
    "model": "bench_model",
    "convert": "bench_convert",
    "sync": "bench_sync",
    "step": "bench_step",
    "scale": "bench_scale",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("bench", choices=sorted(BENCHES))
    parser.add_argument("--quick", action="store_true", help="smaller shapes, for tests")
    args = parser.parse_args()
    module = __import__(BENCHES[args.bench])
    module.run(quick=args.quick)


if __name__ == "__main__":
    main()
