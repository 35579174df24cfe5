"""The run's typed config and its command line."""

from megatron_ext.config.cli import build_parser, parse_config
from megatron_ext.config.run import RunConfig

__all__ = ["RunConfig", "build_parser", "parse_config"]
