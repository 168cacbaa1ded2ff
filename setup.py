"""Genie: run unmodified PyTorch programs on GPUs in other machines.

The daemon's code lives in ./daemon but installs as the import package
`genie_daemon`: PyPI already has a package whose module is called `daemon`.
torch is deliberately not in build requirements (see ARCHITECTURE.md): the
runtime pin is a lower bound so GPU nodes keep their own CUDA build, and CI
installs the CPU wheel explicitly before this package.
"""
from setuptools import find_packages, setup

setup(
    name="genie",
    version="0.1.0",
    description="Remote GPUs as a PyTorch device: lazy capture, semantic scheduling, ZeroMQ transport",
    python_requires=">=3.10",
    package_data={"genie": ["csrc/*.cpp"]},
    # Every package under genie/ (a hand-kept list once left genie.semantic out of wheels).
    packages=[*find_packages(include=["genie", "genie.*"]), "genie_daemon"],
    package_dir={"genie_daemon": "daemon"},
    install_requires=[
        "torch>=2.13",
        "pyzmq>=25",
        "msgpack>=1.0",
        "networkx>=3.0",
        "uvloop>=0.19; platform_system != 'Windows'",
        # Sealed bulk lanes under CURVE (AES-GCM through OpenSSL: genie/transport/sealed_lane.py).
        "cryptography>=42",
    ],
    extras_require={
        "gpu": ["cupy-cuda12x>=13"],
        "ucx": ["ucxx-cu12>=0.52"],  # the UCX lane (RDMA between nodes; see README)
        "viz": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3", "expecttest>=0.2", "hypothesis>=6",
                 "matplotlib>=3.7",
                 # tests/test_hf_models.py: the models users run (random-initialised, nothing downloaded)
                 "transformers>=4.46"],
    },
    entry_points={"console_scripts": ["genie-daemon=genie_daemon.entry:main"]},
)
