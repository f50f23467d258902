import os

# One thread per process: tests and distributed workers share 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
