"""preprocess_data.py's output: the indexed datasets, written under temporary names.

:class:`DatasetWriter` writes one megatron-core ``.bin``/``.idx`` pair per json key to
``{prefix}.tmp-PID.bin/.idx`` and renames them once every document is written; on any
failure (a full disk included: :data:`WRITE_ERRNOS`) it removes them, so nothing is left
under the output prefix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from typing import Dict, List, Optional, Sequence

from _common import remove_quietly, temporary_path
from _tokenize_chunks import ChunkResult

# Errors of the output's storage, reported in one line (the temporary files removed).
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def output_prefixes(output_prefix: str, keys: Sequence[str]) -> Dict[str, str]:
    """Megatron-LM's dataset prefix per json key: ``{output_prefix}_{key}_document``."""
    return {key: f"{output_prefix}_{key}_document" for key in keys}


class DatasetWriter:
    """Writes one megatron-core indexed dataset per json key, under temporary names.

    ``commit`` renames the files to their final names; ``abort`` removes them. megatron-core
    is imported only when the first document is written: the import takes seconds, and a
    run that stops at a malformed first chunk does not need it.
    """

    def __init__(self, prefixes: Dict[str, str], vocab_size: int):
        self._prefixes = prefixes
        self._vocab_size = vocab_size
        self._tmp_prefixes = {key: temporary_path(p) for key, p in prefixes.items()}
        self._builders: Optional[dict] = None
        self.documents = {key: 0 for key in prefixes}
        self.sequences = {key: 0 for key in prefixes}
        self.tokens = {key: 0 for key in prefixes}
        self.dtype = None

    def _open(self) -> None:
        with warnings.catch_warnings():
            # megatron.core warns at import about optional GPU packages, irrelevant here.
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
        # uint16 below 65500 ids halves the file; megatron-core picks the same on read.
        self.dtype = DType.optimal_dtype(self._vocab_size)
        self._builders = {}
        for key, tmp in self._tmp_prefixes.items():
            self._builders[key] = IndexedDatasetBuilder(tmp + ".bin", dtype=self.dtype)

    @property
    def is_open(self) -> bool:
        return self._builders is not None

    def add(self, result: ChunkResult) -> None:
        """Appends the documents of a tokenized chunk."""
        if not any(len(sequences) for sequences in result.sequences.values()):
            return
        if self._builders is None:
            self._open()
        for key, builder in self._builders.items():
            tokens, lengths = result.tokens[key], result.lengths[key].tolist()
            start = first = 0
            for count in result.sequences[key].tolist():
                doc_lengths = lengths[first:first + count]
                end = start + sum(doc_lengths)
                builder.add_document(tokens[start:end], doc_lengths)
                start, first = end, first + count
            self.documents[key] += len(result.sequences[key])
            self.sequences[key] += len(lengths)
            self.tokens[key] += start

    def commit(self) -> List[str]:
        """Writes the indexes and moves the files to their final names.

        Returns:
            The final paths written.
        """
        if self._builders is None:
            self._open()
        for key, builder in self._builders.items():
            builder.finalize(self._tmp_prefixes[key] + ".idx")
        written = []
        for key, tmp in self._tmp_prefixes.items():
            # Each rename makes one whole file appear; the pair is not replaced in one step,
            # so a prefix must not be read while it is being rewritten.
            for suffix in (".bin", ".idx"):
                os.replace(tmp + suffix, self._prefixes[key] + suffix)
                written.append(self._prefixes[key] + suffix)
        self._builders = None
        return written

    def abort(self) -> None:
        """Closes and removes every temporary file (also when the disk is full)."""
        builders, self._builders = self._builders, None
        try:
            for builder in (builders or {}).values():
                # Closing flushes the buffer, which fails on a full disk; the file is
                # closed all the same, and removed below.
                with contextlib.suppress(OSError):
                    builder.data_file.close()
        finally:
            remove_quietly([tmp + suffix for tmp in self._tmp_prefixes.values()
                            for suffix in (".bin", ".idx")])

