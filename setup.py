"""Build Leasehold: pure-Python packages plus the Cython hot path in ``cext/``.

One directive set for every extension. ``LEASEHOLD_DEBUG=1`` turns bounds and
initialisation checks on (and drops ``-O3``), so the test suite can run against a
build that traps out-of-range indexing. Wraparound stays off in both builds: with
it on, a stray -1 row would silently read the last row instead of tripping the
bounds check (and the release build, which has no check, reads before the buffer).
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("LEASEHOLD_DEBUG", "") not in ("", "0")

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

COMPILE_ARGS = ["-O0", "-g"] if DEBUG else ["-O3"]

MODULES = ["_types", "_gate", "_tick", "_eta", "_lease", "_records", "_tree", "_bulk",
           "_digest", "_retained"]

extensions = [
    Extension(
        f"cext.{name}",
        [f"cext/{name}.pyx"],
        include_dirs=[numpy.get_include()],
        # LEASEHOLD_DEBUG: cext._types.DEBUG, so tests know which build they run against.
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                       ("LEASEHOLD_DEBUG", "1" if DEBUG else "0")],
        extra_compile_args=COMPILE_ARGS,
    )
    for name in MODULES
]

# The Makefile installs the package (editable) with LEASEHOLD_NO_EXT=1 and then builds the
# extensions in place once; an editable install would otherwise compile them all a first time.
BUILD_EXT = os.environ.get("LEASEHOLD_NO_EXT", "") in ("", "0")

setup(
    name="leasehold",
    version="0.1.0",
    description="A resource-aware, lease-based scheduling engine",
    packages=["engine", "cext", "transport", "storage"],
    package_data={"cext": ["*.pxd", "*.pyx"], "engine": ["examples/*"]},
    ext_modules=cythonize(
        extensions,
        compiler_directives=DIRECTIVES,
        # A debug build must not reuse release C files (and vice versa).
        force=True,
        annotate=False,
        nthreads=min(4, os.cpu_count() or 1),
    ) if BUILD_EXT else [],
    python_requires=">=3.11",
    install_requires=["numpy>=1.26", "pyzmq>=25", "lmdb>=1.4", "psutil>=5.9", "msgpack>=1.0",
                      "prometheus-client>=0.17", "rich>=13"],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-benchmark>=4",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "ruff>=0.5",
            "cython-lint>=0.16",
            "pycodestyle>=2.11",
            "matplotlib>=3.8",
        ],
        # Flyte 2 declarations (engine.flyte, docs/flyte.md): the SDK with its pinned flyteidl2,
        # and the plugins whose gang shapes the engine reads, so their tests build real tasks.
        # kubernetes: the SDK's pod templates (a Ray group's own requests) need its client.
        "flyte": [
            "flyte==2.12.1",
            "flyteplugins-ray==2.12.1",
            "flyteplugins-dask==2.12.1",
            "kubernetes>=30",
        ],
    },
    entry_points={"console_scripts": ["leasehold = engine.cli:main"]},
    zip_safe=False,
)
