"""spdkfac: distributed K-FAC optimizer for PyTorch (SPD-KFAC)."""
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
setup(
    name="spdkfac",
    version="0.1.0",
    description="Distributed K-FAC with pipelined factor communication and load-balanced inversion (SPD-KFAC)",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["spdkfac", "spdkfac.*"]),
    python_requires=">=3.9",
    # torch is deliberately a range the CPU build on disk (2.13.0) satisfies; scripts/setup.sh pins it.
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "horovod": ["horovod==0.28.1", "cloudpickle", "psutil", "pyyaml", "packaging"],
        "gpu": ["cupy-cuda12x"],
        "mpi": ["mpi4py"],
        "dev": ["pytest", "ruff", "scikit-learn", "matplotlib", "pillow", "mlxtend"],
        "examples": ["scikit-learn", "matplotlib", "mlxtend"],
    },
    entry_points={"console_scripts": ["spdkfac-train=spdkfac.train:main"]},
    license="Apache-2.0",
)
