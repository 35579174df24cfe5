"""GPT datasets through megatron-core's BlendedMegatronDatasetBuilder, and their loaders."""

from __future__ import annotations

import os
import signal
import struct
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from megatron_ext.config.data import split_shares
from megatron_ext.data.data_path import parse_data_path
from megatron_ext.errors import UsageError
from megatron_ext.runtime.batch_schedule import train_samples_total
from megatron_ext.runtime.signals import SHIELDED

_IDX_MAGIC = b"MMIDIDX\x00\x00"
# Scanning a corpus for its largest token id costs one read of it, on every rank: past this
# size, _SCAN_WINDOWS evenly spaced windows of it are read (the first and the last bytes
# among them), so a corpus of another tokenizer shows wherever its ids are.
_MAX_SCAN_BYTES = 256 << 20
_SCAN_WINDOWS = 64


def check_data(data, vocab_size: int, tokenizer_type: Optional[str]) -> None:
    """Checks every --data-path prefix and the --split of them, before anything is built.

    ``data``: the run's DataConfig; ``vocab_size``: the tokenizer's (unpadded) vocabulary.

    Raises:
        UsageError: see :func:`check_data_prefix` and :func:`check_split_sizes`.
    """
    if not data.data_path:
        return
    prefixes = [prefix for _, prefix in parse_data_path(data.data_path)]
    for prefix in prefixes:
        check_data_prefix(prefix, vocab_size, tokenizer_type)
    check_split_sizes(data.split, [(prefix, read_index(prefix, _index_dtype(prefix))[0])
                                   for prefix in prefixes])


def largest_token_id(path: str, dtype: np.dtype) -> int:
    """The largest token id of the .bin ``path``, read within a bound.

    All of it up to :data:`_MAX_SCAN_BYTES`; a larger file by :data:`_SCAN_WINDOWS` evenly
    spaced windows of that many bytes in all, the first and the last among them.
    """
    tokens = np.memmap(path, dtype=dtype, mode="r")
    budget = _MAX_SCAN_BYTES // dtype.itemsize
    if tokens.shape[0] <= budget:
        return int(tokens.max())
    window = budget // _SCAN_WINDOWS
    starts = np.linspace(0, tokens.shape[0] - window, _SCAN_WINDOWS).astype(np.int64)
    return max(int(tokens[start:start + window].max()) for start in starts)


def check_data_prefix(prefix: str, vocab_size: int,
                      tokenizer_type: Optional[str] = None) -> None:
    """Checks that PREFIX.bin/.idx exist, are readable, and fit the tokenizer's vocab.

    ``tokenizer_type``: named in the refusal of ids beyond ``vocab_size``.

    Raises:
        UsageError: a file is missing or unreadable, the index is not megatron-core's
            format, or the data holds token ids the tokenizer does not have.
    """
    from megatron.core.datasets.indexed_dataset import DType

    for suffix in (".idx", ".bin"):
        path = prefix + suffix
        if os.path.exists(path) and not os.path.isfile(path):
            raise UsageError(f"--data-path {prefix}: {path} is not a regular file")
        if not os.path.isfile(path):
            raise UsageError(f"--data-path {prefix}: {path} not found (make it with "
                             "tools/preprocess_data.py; give the prefix without .bin/.idx)")
        if not os.access(path, os.R_OK):
            raise UsageError(f"--data-path {prefix}: {path} is not readable")
    with open(prefix + ".idx", "rb") as stream:
        # magic (9 bytes), version (8, little-endian), dtype code (1)
        header = stream.read(18)
    if len(header) < 18 or header[:9] != _IDX_MAGIC or struct.unpack("<Q", header[9:17])[0] != 1:
        raise UsageError(f"--data-path {prefix}: {prefix}.idx is not a megatron-core index")
    try:
        dtype = np.dtype(DType.dtype_from_code(header[17]))
    except ValueError:
        raise UsageError(f"--data-path {prefix}: {prefix}.idx has an unknown token dtype code "
                         f"{header[17]}")
    nbytes = os.path.getsize(prefix + ".bin")
    if nbytes == 0:
        raise UsageError(f"--data-path {prefix}: {prefix}.bin is empty")
    lengths = read_index(prefix, dtype)[0]
    expected = int(lengths.sum(dtype=np.int64)) * dtype.itemsize
    if nbytes != expected:
        raise UsageError(
            f"--data-path {prefix}: {prefix}.bin has {nbytes} bytes, its index describes "
            f"{expected} ({len(lengths)} sequences of {dtype.name}): the .bin is "
            f"{'truncated' if nbytes < expected else 'longer'} or the pair does not belong "
            "together; make both again with tools/preprocess_data.py")
    largest = largest_token_id(prefix + ".bin", dtype)
    if largest >= vocab_size:
        # tools/preprocess_data.py writes no record of its tokenizer beside the pair (nor
        # does Megatron-LM's): the ids are what can be compared.
        of = f" of --tokenizer-type {tokenizer_type}" if tokenizer_type else ""
        raise UsageError(
            f"--data-path {prefix}: {prefix}.bin holds token id {largest}, outside the "
            f"vocabulary of {vocab_size} ids{of}: give --tokenizer-type/--tokenizer-model/"
            "--vocab-file matching the one tools/preprocess_data.py used")


def read_index(prefix: str, dtype: np.dtype) -> Tuple[np.ndarray, np.ndarray]:
    """(sequence lengths, document indices) of PREFIX.idx, checked for consistency.

    Layout (megatron-core's): 18 header bytes, sequence count and document count (8 bytes
    each), int32 lengths, int64 byte pointers into the .bin, int64 document indices.

    Raises:
        UsageError: the index is truncated, or its pointers do not describe one
            contiguous .bin (pointing past it, overlapping, or out of order).
    """
    path = prefix + ".idx"
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        stream.seek(18)
        counts = stream.read(16)
        if len(counts) < 16:
            raise UsageError(f"--data-path {prefix}: {path} is truncated (no sequence counts)")
        seqs, docs = struct.unpack("<QQ", counts)
        needed = 34 + seqs * 12 + docs * 8
        if size < needed:
            raise UsageError(f"--data-path {prefix}: {path} is truncated ({size} bytes, its "
                             f"header announces {seqs} sequences and {docs - 1} documents: "
                             f"{needed} bytes); make it again with tools/preprocess_data.py")
        lengths = np.fromfile(stream, dtype=np.int32, count=seqs)
        pointers = np.fromfile(stream, dtype=np.int64, count=seqs)
        doc_idx = np.fromfile(stream, dtype=np.int64, count=docs)
    if seqs:
        if (lengths < 0).any():
            raise UsageError(f"--data-path {prefix}: {path} holds negative sequence lengths")
        starts = np.zeros(seqs, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=starts[1:])
        if not np.array_equal(starts, pointers):
            raise UsageError(f"--data-path {prefix}: {path} points into {prefix}.bin at offsets "
                             "that do not follow the sequence lengths (a damaged or foreign "
                             "index); make it again with tools/preprocess_data.py")
    if docs == 0 or doc_idx[0] != 0 or doc_idx[-1] != seqs or (np.diff(doc_idx) < 0).any():
        raise UsageError(f"--data-path {prefix}: {path} has an inconsistent document table")
    return lengths, doc_idx


# megatron-core's split names, in --split order.
_SPLIT_NAMES = ("train", "validation", "test")


def check_split_sizes(split: str, lengths_per_prefix: List[Tuple[str, np.ndarray]]) -> None:
    """Refuses a split that gets no tokens of a corpus (megatron-core would loop forever).

    megatron-core cuts each corpus by sequence at round(share x count); a split with a
    non-zero share that gets no sequence (a small corpus, e.g. 120 documents with the
    default 969,30,1) makes its epoch count loop in GPTDataset._get_num_epochs.

    Raises:
        UsageError: naming the empty split and what to change.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix, lengths in lengths_per_prefix:
        n = len(lengths)
        for name, bounds in zip(_SPLIT_NAMES, matrix):
            if bounds is None:
                continue
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            if int(lengths[beg:end].sum(dtype=np.int64)) == 0:
                share = bounds[1] - bounds[0]
                zero = ",".join("0" if other == name else part
                                for other, part in zip(_SPLIT_NAMES, _split_parts(split)))
                advice = (f"give it 0 (--split {zero}), a share of at least {1.0 / n:.3g} of "
                          "the total, or use more data" if name != "train" else
                          "give it a larger share, or use more data")
                raise UsageError(
                    f"--split {split}: the {name} split of {prefix} is empty ({n} sequences x "
                    f"{share:.3g} rounds to {end - beg} with tokens); {advice}")


def _split_parts(split: str) -> List[str]:
    return [f"{share:g}" for share in split_shares(split)]


def _dataset_config(cfg, tokenizer, dp_size: int):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    data = cfg.data
    blend = None
    if data.data_path:
        pairs = parse_data_path(data.data_path)
        prefixes = [p for _, p in pairs]
        weights = [w for w, _ in pairs] if len(pairs) > 1 else None
        blend = (prefixes, weights)
    return GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=data.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data.eod_mask_loss,
        # Attention is causal by construction (SDPA / TE); no dense mask needed.
        create_attention_mask=False,
        mmap_bin_files=data.mmap_bin_files,
        data_parallel_size=dp_size,
    )


def build_datasets(cfg, runtime, tokenizer) -> Tuple:
    """Builds (train, valid, test) GPT datasets sized for the run.

    The files are checked by :func:`check_data` first (the Trainer does it before the
    memory plan, so that a corpus that cannot be read is refused before anything else).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    data = cfg.data
    gbs = cfg.training.global_batch_size
    eval_samples = cfg.training.eval_iters * gbs
    iters = cfg.training.train_iters
    trains = not cfg.training.skip_train and (iters is None or iters > 0)
    sizes = [train_samples_total(cfg.training) if trains else 0, eval_samples, eval_samples]
    cls = MockGPTDataset if data.mock_data else GPTDataset
    config = _dataset_config(cfg, tokenizer, runtime.dp)
    try:
        train, valid, test = BlendedMegatronDatasetBuilder(
            cls, sizes, lambda: True, config).build()
    except (AssertionError, ValueError) as err:
        raise UsageError(f"cannot build datasets from --data-path/--split: {err}")
    if trains and (train is None or len(train) == 0):
        raise UsageError("the training split is empty: give the train part of --split a "
                         "non-zero share, or more data")
    return train, valid, test


def _index_dtype(prefix: str) -> np.dtype:
    from megatron.core.datasets.indexed_dataset import DType

    with open(prefix + ".idx", "rb") as stream:
        stream.seek(17)
        return np.dtype(DType.dtype_from_code(stream.read(1)[0]))


class PretrainingSampler:
    """Sequential micro-batches of sample indices for one data-parallel rank.

    Global batches are consecutive runs of ``micro_batch_size * dp_size`` indices; each
    rank takes its slice. Starting from ``consumed_samples`` makes resume exact.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = dp_rank
        self.size = dp_size

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.mbs * self.size))

    def __iter__(self) -> Iterator[List[int]]:
        step = self.mbs * self.size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.rank * self.mbs
            yield list(range(first, first + self.mbs))


def _worker_ignores_exit_signals(worker_id: int) -> None:
    """A DataLoader worker ignores the exit signals that reach the whole process group.

    ``kill -TERM -- -PGID``, ``scancel`` and Slurm's requeue signal every process of the
    job: a worker killed by it breaks the batch the main process is fetching
    (ConnectionResetError) and with it the save at the signal. The main process decides
    when to stop; its workers end with it (torch's shutdown, or their watch on the parent).
    """
    for sig in SHIELDED:
        signal.signal(sig, signal.SIG_IGN)


class _CrashingDataset(torch.utils.data.Dataset):
    """``dataset`` whose samples of an iteration raise the ``data`` crash (tests' faults).

    It runs where the samples are loaded: in the loader's worker processes.
    """

    def __init__(self, dataset, crashes, global_batch_size: int):
        self.dataset, self.crashes, self.gbs = dataset, crashes, global_batch_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        self.crashes.check("data", index // self.gbs + 1)
        return self.dataset[index]


def build_loader(dataset, consumed_samples: int, cfg, runtime,
                 crashes=None) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader over ``dataset`` starting at ``consumed_samples``.

    ``crashes``: the run's injected crashes (:class:`~megatron_ext.runtime.faults.Crashes`),
    whose ``data`` place fires in the loader's workers; None or no rule: none.
    """
    if dataset is None or len(dataset) == 0:
        return None
    if crashes is not None and any(rule[0] == "data" for rule in crashes.rules):
        dataset = _CrashingDataset(dataset, crashes, cfg.training.global_batch_size)
    sampler = PretrainingSampler(len(dataset), consumed_samples, cfg.training.micro_batch_size,
                                 runtime.dp_rank, runtime.dp)
    # A generator of its own: DataLoader draws its worker seed at every iter() from the
    # global generator otherwise, which would shift dropout after a resume or an eval.
    generator = torch.Generator()
    generator.manual_seed(cfg.training.seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        generator=generator,
        num_workers=cfg.data.num_workers,
        pin_memory=not runtime.is_cpu,
        persistent_workers=cfg.data.num_workers > 0,
        worker_init_fn=_worker_ignores_exit_signals if cfg.data.num_workers > 0 else None,
    )
