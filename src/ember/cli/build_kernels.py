"""`ember build-kernels`: build ember's native kernels ahead of time (at image build, where a compiler is), so the
service loads them at start with no compiler and no build time."""

from __future__ import annotations

import argparse
import logging
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from ember.cli.runtime import native_config
from ember.errors import ConfigError

__all__ = ["add_parser"]

log = logging.getLogger("ember.cli")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "build-kernels",
        allow_abbrev=False,
        help="build the native kernels for every CPU tier into the cache directory (for images without a compiler)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="where to put them (default: EMBER_CACHE_DIR, else ~/.cache/ember)"
    )
    p.add_argument(
        "--tier",
        action="append",
        default=None,
        choices=["amx", "avx512_bf16", "avx512", "avx2", "aarch64"],
        help="a CPU tier to build for; repeat for several (default: every tier of this machine's architecture: the "
        "four x86-64 ones, or aarch64; avx512, avx2 and aarch64 build attention only)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return _build(args)
    except ConfigError as e:
        log.error("%s", e)
        return 2


def _build(args: argparse.Namespace) -> int:
    from ember.hardware import find_compiler
    from ember.ops.native import prebuild, prebuilt_tiers_here

    here = prebuilt_tiers_here()
    if not here:
        raise ConfigError(f"ember's native kernels are built for x86-64 and aarch64, not {platform.machine()}")
    tiers = args.tier or here
    foreign = [t for t in tiers if t not in here]
    if foreign:
        raise ConfigError(
            f"--tier {foreign[0]} is built on {'an aarch64' if foreign[0] == 'aarch64' else 'an x86-64'} machine "
            f"(this one builds {', '.join(here)})"
        )
    config = native_config()
    cache = Path(args.cache_dir or config.cache_dir or Path.home() / ".cache" / "ember")
    compiler = find_compiler(config.compiler)
    if compiler is None:
        raise ConfigError("no C++ compiler (g++, c++ or clang++; or CXX) to build the kernels with")
    try:
        built = prebuild(cache, tiers, compiler)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"building the kernels into {cache} failed: {e}") from None
    for kernel, tier, path in built:
        print(f"{kernel:12s} {tier:12s} {path}")
    print(f"set EMBER_CACHE_DIR={cache} where ember serves (if that is not its default) to load them")
    return 0
