"""hvd_acp: ACP-SGD gradient compression as a drop-in Horovod optimizer."""
from setuptools import find_packages, setup

setup(
    name="hvd_acp",
    version="0.1.0",
    description=(
        "Drop-in replacement for horovod.torch.DistributedOptimizer that "
        "trains with ACP-SGD (alternate compressed Power-SGD)"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_acp", "hvd_acp.*"]),
    python_requires=">=3.9",
    # Horovod is needed by hvd_acp.DistributedOptimizer and the benchmark, not
    # by the DDP hook (hvd_acp.ddp): an extra. It must be built against the
    # installed torch (scripts/install.sh does it: --no-build-isolation).
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "horovod": ["horovod>=0.28"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
        # The planner's built-in models and plots, and the benchmark of the
        # checkout (python -m benchmarks; not installed).
        "bench": ["transformers", "tqdm", "matplotlib"],
        "test": ["pytest", "pytest-timeout", "scikit-learn"],
    },
    entry_points={"console_scripts": ["hvd-acp-plan=hvd_acp.plan.__main__:main"]},
)
