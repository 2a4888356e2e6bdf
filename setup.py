"""Build of zerokit's native extensions.

Every native module is listed in NATIVE_EXTENSIONS with its sources and flags: that table is the
only place build switches live. Extensions are optional: where no compiler exists the install
still succeeds and zerokit falls back to pure-torch code that gives the same numbers (and says so
once at run time). No torch headers are used, so the build never needs torch.
"""
import os

from setuptools import Extension, setup

try:
    import pybind11

    PYBIND_INCLUDE = [pybind11.get_include()]
except ImportError:  # pragma: no cover - pybind11 is a build requirement
    PYBIND_INCLUDE = []

CSRC = os.path.join("src", "zerokit", "csrc")
COMMON_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno"]

# name -> (sources, extra compile flags, extra link flags)
NATIVE_EXTENSIONS = {
    "zerokit.io._aio": (
        [os.path.join(CSRC, "aio_bindings.cpp")]
        + [os.path.join(CSRC, "aio", f) for f in
           ("engine.cpp", "block_io.cpp", "kernel_aio.cpp", "crc32c.cpp", "activity.cpp")],
        ["-pthread"],
        ["-pthread"],
    ),
    "zerokit.optim._host_kernels": (
        [os.path.join(CSRC, "optim_bindings.cpp")]
        + [os.path.join(CSRC, "kernels", f) for f in
           ("dispatch.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp")],
        # fp-contract off: fused multiply-adds only where the kernels write them, so every ISA
        # rounds as torch does (GCC would otherwise fuse p * decay + update).
        ["-fopenmp", "-ffp-contract=off"],
        ["-fopenmp"],
    ),
}


def _extensions():
    exts = []
    for name, (sources, cflags, lflags) in NATIVE_EXTENSIONS.items():
        exts.append(
            Extension(
                name,
                sources=sources,
                include_dirs=PYBIND_INCLUDE + [CSRC],
                extra_compile_args=COMMON_FLAGS + cflags,
                extra_link_args=lflags,
                language="c++",
                optional=os.environ.get("ZEROKIT_REQUIRE_NATIVE") != "1",
            )
        )
    return exts


setup(ext_modules=_extensions())
