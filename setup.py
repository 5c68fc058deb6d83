"""Builds the optional C kernels of `sparse_embed.preprocess` (metadata: pyproject.toml).

`optional=True`: if there is no C compiler, the install still succeeds and
`preprocess` runs its numpy path (`sparse_embed.host.native.extension()` is None).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sparse_embed.host._native",
            ["sparse_embed/host/_native.c"],
            # portable -O3 (no -march); no FMA contraction, so float sums match numpy's bit for bit
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
