"""One training step as its phases (docs/design.md, "One training step"): ``run.py::run_step``
reads as the eight rows; one module per phase."""
