"""The run's typed config and its command line.

The names are loaded on first use: engines' own configs (e.g. ``offload/config.py``)
import :mod:`megatron_ext.config.fields`, and the run config imports them back.
"""

import importlib

__all__ = ["RunConfig", "build_parser", "parse_config", "parse_data_path"]
_HOME = {"RunConfig": "run", "build_parser": "cli", "parse_config": "cli",
         "parse_data_path": "cli"}


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"megatron_ext.config.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
