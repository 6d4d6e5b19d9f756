from setuptools import find_packages, setup

setup(
    name="mode",
    version="0.1.0",
    description="Mixture-of-Depths-and-Experts language models on DeepSpeed",
    packages=find_packages(include=["mode", "mode.*", "analysis", "analysis.*", "launch", "launch.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned by the Makefile (CPU build); a range here never pulls a CUDA build.
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "datasets>=2.19",
        "tensorboard>=2.15",
        "pyyaml>=6",
        "tqdm>=4.60",
        "tokenizers>=0.15",  # Hugging Face tokenizers from a local directory (light: no transformers)
        "matplotlib>=3.7",
        "numpy",
        "safetensors>=0.4",  # `mode export`: weights without pickle
    ],
    extras_require={
        # dev includes the eval and wandb extras: the tests drive lm-evaluation-harness and W&B (offline) themselves.
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "lm-eval>=0.4.5", "wandb>=0.16"],
        # `mode eval`: EleutherAI's lm-evaluation-harness (keeps the installed torch).
        "eval": ["lm-eval>=0.4.5"],
        # GPU nodes only: MegaBlocks pins its own torch and needs CUDA extensions.
        "megablocks": ["megablocks>=0.10", "grouped_gemm"],
        # Weights & Biases logger (log.wandb=true); works offline (log.wandb_mode=offline).
        "wandb": ["wandb>=0.16"],
    },
    entry_points={"console_scripts": ["mode=mode.cli:main"]},
)
