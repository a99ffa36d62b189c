"""Package metadata for pipemark. `make test` and `make demo` install it editable."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="pipemark",
    version="0.1.0",
    description="Pipeline-stage markers for JAX jaxprs: a marker primitive that survives "
    "every transform, and passes that insert, slice and rewrite them into stage programs.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # kernels/*.cu ship inside the package as pipemark/kernels (see pipemark.custom_call).
    packages=[*find_packages(include=["pipemark", "pipemark.*"]), "pipemark.kernels"],
    package_dir={"pipemark.kernels": "kernels"},
    # The planner's measured TPU v5e layer costs (pipemark.runtime.planning.measured).
    package_data={"pipemark.kernels": ["*.cu"], "pipemark.runtime.planning": ["*.json"]},
    install_requires=[
        # The tested range: JAX 0.10 (Python 3.11, `make test`) to 0.12 (Python 3.12,
        # `make test-newest`). Raise the bound after the suite passes on the next minor.
        "jax>=0.10,<0.13",
        "jaxlib>=0.10,<0.13",
        "numpy>=1.26",
        "networkx>=3.2",
        # jax.export serializes programs with it (StagedJaxpr.export, pm.load_staged);
        # JAX itself leaves it optional.
        "flatbuffers>=24",
    ],
    extras_require={
        # The GPU image runs CUDA 13; on CUDA 12 install cupy-cuda12x instead.
        "gpu": ["cupy-cuda13x>=13"],
        "viz": ["matplotlib>=3.7", "rich>=13"],
        # Checkpoints of pipelined training runs with orbax, in one process or many
        # (pipemark.runtime.training.orbax_arrays; docs/training.md).
        "checkpoint": ["orbax-checkpoint>=0.12"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "ruff>=0.6",
            # tests/test_custom_call.py builds the package with setup.py (Python 3.12
            # venvs come without setuptools).
            "setuptools>=68",
            # docs/tutorial.ipynb is executed by tests/test_tutorial.py.
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            # Real models in the tests (tests/test_model_zoo.py): penzai's transformers,
            # flax linen and nnx, equinox, optax steps. flax before 0.12.12 fails to
            # import on JAX 0.12; 0.12.12 needs Python 3.12, where pip resolves JAX 0.12.
            "penzai>=0.2.5",
            "flax>=0.10; python_version < '3.12'",
            "flax>=0.12.12; python_version >= '3.12'",
            "equinox>=0.11",
            "optax>=0.2.4",
            "orbax-checkpoint>=0.12",
        ],
        "docs": [
            "mkdocs>=1.6",
            # docs/api.md: the API reference, generated from the docstrings (numpy style),
            # with the Griffe extension in docs/hooks/griffe_docstrings.py.
            "mkdocstrings[python]>=1.0",
            "mkdocstrings-python>=2.0",
            # Code highlighted at build time (no highlight.js from a CDN: works offline).
            "pymdown-extensions>=10.0",
            "Pygments>=2.16",
            # docs/hooks/notebook_page.py renders docs/tutorial.ipynb as a page.
            "nbconvert>=7.16",
            "nbformat>=5.10",
        ],
    },
    entry_points={"console_scripts": ["pipemark = pipemark.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
