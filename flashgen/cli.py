"""The flashgen command line: one group, verbs named for what the user wants."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .config import LOOP_ORDERS, ConfigError, KernelConfig, default_config
from .render import render, write_atomic
from .spec import AttentionSpec, SpecError


def _load_spec(path: str) -> AttentionSpec:
    try:
        return AttentionSpec.from_yaml(path)
    except SpecError as err:
        raise click.UsageError(str(err)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashgen")
def main():
    """flashgen: compile attention specs into tuned Triton kernels."""


@main.command()
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="The attention spec (YAML).")
@click.option("-o", "--output", default="-", type=click.Path(dir_okay=False, allow_dash=True),
              help="Where to write the module ('-' for standard output).")
@click.option("--loop-order", type=click.Choice(LOOP_ORDERS), help="Override the config's loop order.")
@click.option("--block-m", type=int, help="Override BLOCK_M.")
@click.option("--block-n", type=int, help="Override BLOCK_N.")
@click.option("--num-warps", type=int, help="Override num_warps.")
@click.option("--num-stages", type=int, help="Override num_stages.")
@click.option("--target", help="GPU to pick the default config for (default: the spec's target, "
                               "or this machine's GPU when it is 'auto').")
def generate(spec_path, output, loop_order, block_m, block_n, num_warps, num_stages, target):
    """Write the rendered Triton module for a spec as a standalone file.

    The file imports only torch and triton; call its forward(q, k, v) directly.
    """
    spec = _load_spec(spec_path)
    config = default_config(spec, target=target)
    changes = {"loop_order": loop_order, "BLOCK_M": block_m, "BLOCK_N": block_n,
               "num_warps": num_warps, "num_stages": num_stages}
    try:
        config = config.replace(**{k: v for k, v in changes.items() if v is not None})
    except ConfigError as err:
        raise click.UsageError(str(err)) from None
    source = render(spec, config)
    if output == "-":
        sys.stdout.write(source)
    else:
        write_atomic(Path(output), source)
        click.echo(f"wrote {output}: {spec.uri} with {config}", err=True)


if __name__ == "__main__":
    main()
