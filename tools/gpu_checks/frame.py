"""The frame around each part: its verdict, its seconds and numbers, one printed line, and
the JSON summary that ends the run."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

import torch


class Skipped(Exception):
    """A part that cannot run here; its message says why. ``missing``: what is absent that
    the part needs, a library (``"transformer_engine"``, ``"vllm"``, ``"transformers"``) or
    ``"devices"`` (fewer GPUs than it launches on); None where the part is not meant to run
    at all (``--cpu``: no CUDA). On a GPU a skip with ``missing`` set fails the check when the
    recipe needs the part (``verdict.py``)."""

    def __init__(self, reason: str, *, missing: str | None = None) -> None:
        super().__init__(reason)
        self.missing = missing


class CheckFailed(Exception):
    """A part ran but a number is out of bounds."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Results:
    """Each part's verdict and numbers, in run order, and the part running now (for the
    watchdog)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, dict] = {}
        self.current: str | None = None
        self.current_start = 0.0

    def need(self, *names: str) -> None:
        """CheckFailed unless every part ``names`` passed (what this part builds on)."""
        for name in names:
            if self.parts.get(name, {}).get("status") != "ok":
                raise CheckFailed(f"not run: needs part {name!r}, which did not pass")

    def passed(self, name: str) -> bool:
        return self.parts.get(name, {}).get("status") == "ok"

    def run(self, name: str, part: Callable[[dict], None]) -> None:
        """Run ``part(numbers)``; a failure is recorded and printed, never raised."""
        self.current, self.current_start = name, time.perf_counter()
        numbers: dict = {}
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        status, error, missing = "ok", None, None
        try:
            part(numbers)
            if cuda:
                torch.cuda.synchronize(self.device)  # a kernel's error shows here
        except Skipped as skip:
            status, error, missing = "skipped", str(skip), skip.missing
        except CheckFailed as err:  # a number out of bounds: the line says it all
            status, error = "failed", f"CheckFailed: {err}"
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        seconds = time.perf_counter() - start
        if cuda:
            try:
                numbers["peak_cuda_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            except Exception as err:  # after a CUDA error the context may be gone
                numbers["peak_cuda_gib"] = f"unreadable ({type(err).__name__})"
        self.parts[name] = {"status": status, "seconds": round(seconds, 3), **numbers}
        if error is not None:
            self.parts[name]["error"] = error[:2000]
        if missing is not None:
            self.parts[name]["missing"] = missing
        shown = "  ".join(f"{k}={fmt(v)}" for k, v in numbers.items())
        line = f"{name:<20} {status:<8} {seconds:7.2f} s  {shown}"
        if error is not None:
            line += f"  [{error.splitlines()[0][:300]}]"
        print(line, flush=True)

    def time_out(self, limit: float) -> None:
        """Mark the running part failed by the watchdog (and print its line)."""
        name = self.current or "distributed"
        self.parts[name] = {
            "status": "failed",
            "seconds": round(time.perf_counter() - self.current_start, 3),
            "error": f"timed out: the check passed --timeout {limit:g} s in this part",
        }
        print(f"{name:<20} failed   (timed out after --timeout {limit:g} s)", flush=True)


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
