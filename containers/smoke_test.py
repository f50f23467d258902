"""Smoke test of the GPU image: the pinned versions, the imports, and one TE layer on the GPU.

    python3 containers/smoke_test.py                 # on a GPU node, inside the image
    python3 containers/smoke_test.py --imports-only  # at image build time (no GPU there)

Checks, one line each: the installed torch, vllm, megatron-core and transformer-engine are the
versions in containers/pins.txt (torch unchanged under TE and apex); ``transformer_engine.pytorch``,
``vllm``, ``megatron.core`` and apex's ``fused_weight_gradient_mlp_cuda`` import; then, on the
GPU, one ``te.TransformerLayer`` runs forward and backward in bf16 with finite outputs and
grads, and a ``te.Linear`` equals ``torch.nn.functional.linear`` with the same weights within
bf16 rounding. The last line is JSON ``{"ok": bool, "failed": [...]}``. Exit status: 0 all
passed, 2 a check failed (the line says which), or no GPU is visible without --imports-only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from importlib import metadata
from pathlib import Path

PINS = Path(__file__).resolve().parent / "pins.txt"
CHECKED_DISTRIBUTIONS = ("torch", "vllm", "megatron-core", "transformer-engine")
"""Distributions whose installed version must equal its pin."""
IMPORTS = ("transformer_engine.pytorch", "vllm", "megatron.core", "fused_weight_gradient_mlp_cuda")
"""Modules the trainer needs on a GPU (the last: apex, for gpu.gradient_accumulation_fusion)."""


def read_pins(path: Path = PINS) -> dict[str, str]:
    """``name==version`` lines of a pip constraints file -> {name: version}."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'ok' if ok else 'FAIL':<5} {name}: {detail}")
        if not ok:
            self.failed.append(name)


def check_versions(report: Report) -> None:
    pins = read_pins()
    for dist in CHECKED_DISTRIBUTIONS:
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            report.check(dist, False, f"not installed; containers/pins.txt wants {pins[dist]}")
            continue
        base = installed.split("+")[0]  # torch 2.13.0+cu130 is torch 2.13.0
        report.check(dist, base == pins[dist], f"{installed} (pinned {pins[dist]})")


def check_imports(report: Report) -> None:
    for module in IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as err:  # an ImportError, or an extension that fails to load
            report.check(f"import {module}", False, f"{type(err).__name__}: {err}")
        else:
            report.check(f"import {module}", True, "imported")


def check_te_on_gpu(report: Report) -> None:
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    hidden, ffn, heads, seq, batch = 256, 1024, 4, 32, 2
    layer = te.TransformerLayer(
        hidden, ffn, heads, params_dtype=torch.bfloat16, device="cuda", hidden_dropout=0.0,
        attention_dropout=0.0, self_attn_mask_type="causal",
    )  # fmt: skip
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    grads_finite = all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    report.check(
        "te.TransformerLayer",
        tuple(y.shape) == (seq, batch, hidden) and bool(y.isfinite().all()) and grads_finite,
        f"forward {tuple(y.shape)} and backward in bf16 on {torch.cuda.get_device_name()}",
    )
    linear = te.Linear(hidden, ffn, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ours = linear(x)
        reference = torch.nn.functional.linear(x, linear.weight, linear.bias)
    # Both round one bf16 GEMM; they may accumulate in another order.
    tolerance = 2 * torch.finfo(torch.bfloat16).eps * float(reference.abs().max())
    diff = float((ours.float() - reference.float()).abs().max())
    report.check("te.Linear", diff <= tolerance, f"max |te - torch| {diff:.3g} <= {tolerance:.3g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--imports-only", action="store_true", help="versions and imports only")
    args = parser.parse_args(argv)
    if not args.imports_only:
        import torch

        if not torch.cuda.is_available():
            print(
                "no CUDA GPU visible: run this on a GPU node (e.g. srun --gpus=1 "
                "--container-image=IMAGE python3 containers/smoke_test.py), or pass "
                "--imports-only to check versions and imports alone",
                file=sys.stderr,
            )
            return 2
    report = Report()
    check_versions(report)
    check_imports(report)
    if not args.imports_only and "import transformer_engine.pytorch" not in report.failed:
        check_te_on_gpu(report)
    print(json.dumps({"ok": not report.failed, "failed": report.failed}))
    return 2 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
