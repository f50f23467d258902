"""Benchmarks. Each prints a table and, as its last line, one JSON object.

    python tools/bench.py gae|model|convert|sync|step|scale  (scale --mixed: the policy and
    the critic on different DP sizes)

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
    parser.add_argument(
        "--mixed", action="store_true", help="scale: the policy TP2 x the critic DP2 (routed)"
    )
    args = parser.parse_args()
    if args.mixed and args.bench != "scale":
        parser.error(f"--mixed is an option of scale, not of {args.bench}")
    module = __import__(BENCHES[args.bench])
    module.run(quick=args.quick, **({"mixed": True} if args.mixed else {}))


if __name__ == "__main__":
    main()
