"""`ember` entry point: dispatches to the subcommands."""

from __future__ import annotations

import argparse
import sys

from ember.version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """`ember` and its subcommands' flags."""
    from ember.cli import bench, build_kernels, doctor, embed, serve

    parser = argparse.ArgumentParser(
        prog="ember",
        description="CPU-native, OpenAI- and vLLM-compatible embedding and rerank server",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    doctor.add_parser(sub)
    embed.add_parser(sub)
    bench.add_parser(sub)
    build_kernels.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # unknown flags are an error, as in vLLM: never silently misparsed
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
