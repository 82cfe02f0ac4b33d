"""hvd_acp: ACP-SGD gradient compression as a drop-in Horovod optimizer."""
import re
from pathlib import Path

from setuptools import find_packages, setup

#: One version, hvd_acp.__version__, read without importing the package (torch).
INIT = (Path(__file__).parent / "hvd_acp" / "__init__.py").read_text(encoding="utf-8")
VERSION = re.search(r'^__version__ = "([^"]+)"$', INIT, re.M).group(1)
#: The framework integrations (hvd_acp.integrations), at the versions tested
#: with torch 2.13.0 (CPU) on Python 3.11; none of them asks for another torch.
INTEGRATIONS = {
    "lightning": ["lightning>=2.6.6,<2.7"],
    "accelerate": ["accelerate>=1.16.0,<1.17"],
    "transformers": ["transformers>=5.24.0,<5.25", "accelerate>=1.16.0,<1.17"],
}

setup(
    name="hvd_acp",
    version=VERSION,
    description=(
        "Drop-in replacement for horovod.torch.DistributedOptimizer that "
        "trains with ACP-SGD (alternate compressed Power-SGD)"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_acp", "hvd_acp.*"]),
    python_requires=">=3.9",
    license="Apache-2.0",
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
        **INTEGRATIONS,
        "test": ["pytest", "pytest-timeout", "scikit-learn",
                 *sorted({req for reqs in INTEGRATIONS.values() for req in reqs})],
    },
    entry_points={"console_scripts": ["hvd-acp-plan=hvd_acp.plan.__main__:main",
                                      "hvd-acp-ab=hvd_acp.ab.__main__:main"]},
)
