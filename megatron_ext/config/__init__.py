"""The run's typed config and its command line.

One dataclass per concern (``model``, ``training``, ``data``, ``outputs``, ``runtime`` here;
the engines' own in ``offload/config.py``, ``zenflow/config.py``, ``runtime/faults.py``),
composed by :class:`RunConfig`. Every field has a docstring (the string under it):
``--help`` and docs/flags.md are generated from them. Flag names and meanings follow
Megatron-LM where Megatron-LM has the flag. Bounds of a single field are checked in
``__post_init__``; checks that involve several sections or the world size live in
:mod:`megatron_ext.config.run`.
"""

from megatron_ext.config.cli import build_parser, parse_config
from megatron_ext.config.run import RunConfig

__all__ = ["RunConfig", "build_parser", "parse_config"]
