"""Shared helpers of the test suite: run pretrain_gpt.py as real processes.

A module of its own (not conftest.py): several conftest.py files would all be the
top-level module ``conftest``, and an import of one would find another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from megatron_ext.runtime.mcore_compat import null_vocab_size_flag

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "pretrain_gpt.py")

# A tiny GPT on megatron-core's mock data: 2 layers, hidden 64, sequence 32, 250 token ids
# plus the end-of-document id on every megatron-core version (NullTokenizer's --vocab-size
# counts the EOD from 0.18: a fixed 250 there is a model one id smaller, whose trajectory
# amplifies rounding ~8x more over the tests' 20 iterations). Everything with a Megatron-LM
# default that tests do not want is explicit (cosine decay, log every iteration, no
# evaluation, data loading in the main process).
TINY_VOCAB_IDS = 250
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
    "--mock-data", "--vocab-size", null_vocab_size_flag(TINY_VOCAB_IDS),
    "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--device", "cpu", "--wandb-mode", "disabled", "--seed", "1234",
]
# bf16 with bf16 gradient accumulation and reduction, as the offload and ZenFlow tests were
# written for (Megatron-LM's default with --bf16 alone is fp32 gradients).
BF16 = ["--bf16", "--grad-reduce-in-bf16"]
# The same tiny GPT on the GPU (tests/gpu).
GPU_TINY = [a if a != "cpu" else "cuda" for a in TINY]


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> List[int]:
    """COUNT distinct TCP ports free on 127.0.0.1 now, below the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: between this check and the server's bind,
    any process's outgoing connection (gloo ranks of a concurrent test) may take it as its
    source port (seen in CI: EADDRINUSE on torchrun's store). Below the range only an
    explicit bind can take it, and the picks are random.
    """
    lo = 10000
    hi = max(lo + 1000, _ephemeral_range()[0])
    rng = random.SystemRandom()
    socks: List[socket.socket] = []
    try:
        while len(socks) < count:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", rng.randrange(lo, hi)))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


@contextlib.contextmanager
def single_process_runtime(argv: Sequence[str]):
    """megatron_ext's runtime of one process (rank 0 of 1, gloo on a free port).

    ``argv``: pretrain_gpt.py's flags, parsed once the process-group variables are set (for
    the block; they are restored after it).
    """
    from megatron_ext.config import parse_config
    from megatron_ext.runtime import distributed

    layout = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
              "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in layout}
    os.environ.update(layout)
    try:
        yield distributed.initialize(parse_config(argv))
    finally:
        distributed.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": path})
    # A test process that initialized torch.distributed itself must not leak its layout.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def launch(args: Sequence[str], nproc: int = 1, env: Optional[dict] = None,
           script: str = PRETRAIN, **popen_kwargs) -> subprocess.Popen:
    """Starts pretrain_gpt.py, or another ``script``, (through torchrun when nproc > 1)."""
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), script, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=test_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen_kwargs)


def run_pretrain(args: Sequence[str], nproc: int = 1, env: Optional[dict] = None,
                 timeout: int = 300, check: bool = True,
                 script: str = PRETRAIN) -> subprocess.CompletedProcess:
    proc = launch(args, nproc=nproc, env=env, script=script)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"pretrain_gpt.py timed out after {timeout} s:\n{out[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py exited {proc.returncode}:\n{out[-6000:]}")
    return result


# Not a test, though its name says so (every module that imports it would collect it).
test_env.__test__ = False


def read_metrics(path) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(path) -> List[float]:
    """lm loss of each logged training iteration (log interval 1), in order."""
    return losses_of(read_metrics(path))


@dataclasses.dataclass
class SharedRun:
    """A finished pretrain_gpt.py run of a :class:`RunCache`.

    Attributes:
        records: its metrics records (--metrics-path).
        stdout: its output (stdout and stderr).
        directory: its own directory (the ``{run}`` of its arguments).
    """

    records: List[dict]
    stdout: str
    directory: Path

    @property
    def losses(self) -> List[float]:
        """lm loss of each logged training iteration."""
        return losses_of(self.records)


class RunCache:
    """Runs of pretrain_gpt.py that the tests of one session share, across xdist workers.

    Many tests start the same run: the plain optimizer's curve that several modules compare
    against, the straight run of a resume test that is also an equality test's run. Each
    distinct run (its arguments, launch size, environment and the ``MEGATRON_EXT_*``
    variables of this process) runs once per session, whichever worker asks first; the
    others wait for it (a file lock) and read its files. Only runs whose files are not
    changed by a test may be shared (metrics, output; not a checkpoint a test damages).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def once(self, name: str, make: Callable[[Path], None]) -> Path:
        """The directory ``name`` of the session, filled by ``make(directory)`` once.

        The first caller makes it (the others wait); a ``make`` that failed is tried again
        by the next caller.
        """
        import fcntl

        directory = self.root / name
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (directory / ".done").is_file():
                if directory.exists():
                    shutil.rmtree(directory)
                directory.mkdir()
                make(directory)
                (directory / ".done").touch()
        return directory

    def run(self, args: Sequence[str], nproc: int = 1, env: Optional[dict] = None,
            base: Optional[Path] = None, timeout: int = 300) -> SharedRun:
        """``args`` run (or its earlier run's files), with ``--metrics-path`` added.

        ``{run}`` in ``args`` and in ``env``'s values is the run's own directory (e.g. a
        trace file there). ``base``: a test's directory that ``args`` name (tier paths):
        it is read as ``{run}``, and the run's directory gets the subdirectories that
        ``args`` name in it (so the test's directory does not make the run a different one).
        """
        import hashlib

        text = [str(a) for a in args]
        if base is not None:
            text = [a.replace(str(base), "{run}") for a in text]
        inherited = {k: v for k, v in os.environ.items() if k.startswith("MEGATRON_EXT_")}
        env = {k: str(v) if base is None else str(v).replace(str(base), "{run}")
               for k, v in (env or {}).items()}
        key = json.dumps([text, nproc, sorted({**inherited, **env}.items())])

        def start(directory: Path) -> None:
            for arg in text:
                if base is not None and arg.startswith("{run}/"):
                    relative = arg[len("{run}/"):].split("@")[0]
                    if (Path(base) / relative).is_dir():
                        (directory / relative).mkdir(parents=True, exist_ok=True)
            argv = [a.replace("{run}", str(directory)) for a in text]
            result = run_pretrain([*argv, "--metrics-path", str(directory / "m.jsonl")],
                                  nproc=nproc, timeout=timeout,
                                  env={k: v.replace("{run}", str(directory))
                                       for k, v in env.items()})
            (directory / "stdout.txt").write_text(result.stdout)

        directory = self.once(hashlib.sha256(key.encode()).hexdigest()[:20], start)
        return SharedRun(read_metrics(directory / "m.jsonl"),
                         (directory / "stdout.txt").read_text(), directory)


def precision_flags(precision: str) -> List[str]:
    # bf16 gradients as these tests were written for (Megatron-LM's default is fp32).
    return {"fp32": [], "bf16": BF16, "fp16": ["--fp16"]}[precision]


def baseline_losses(runs: RunCache, base: Sequence[str]):
    """A function: precision -> losses of the plain distributed optimizer on ``base``.

    Each precision runs once per session (``runs``: the ``run_cache`` fixture).
    """
    def get(precision: str):
        return runs.run([*base, *precision_flags(precision)]).losses
    return get


def straight_and_resumed(tmp_path, flags: Sequence[str], stop_at: int, nproc: int = 1,
                         load_flags: Sequence[str] = (),
                         runs: Optional[RunCache] = None) -> tuple:
    """Runs ``flags`` straight, and again stopped by --exit-interval ``stop_at`` + --load.

    ``runs``: the session's :class:`RunCache`, which may hold the straight run already
    (another test's); the stopped and resumed runs are this test's own.

    Returns:
        (records of the straight run, records of the stopped run followed by the resumed one)
    """
    if runs is not None:
        straight_records = runs.run(flags, nproc=nproc, base=tmp_path).records
    else:
        straight = tmp_path / "straight.jsonl"
        run_pretrain([*flags, "--metrics-path", str(straight)], nproc=nproc)
        straight_records = read_metrics(straight)
    return straight_records, stopped_and_resumed(tmp_path, flags, stop_at, nproc, load_flags)


def stopped_and_resumed(tmp_path, flags: Sequence[str], stop_at: int, nproc: int = 1,
                        load_flags: Sequence[str] = ()) -> List[dict]:
    """Runs ``flags`` stopped by --exit-interval ``stop_at`` (saved in ``tmp_path``/ckpt),
    then resumed with --load; the records of both, in order."""
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_pretrain([*flags, "--save", str(ckpt), "--exit-interval", str(stop_at),
                  "--metrics-path", str(first)], nproc=nproc)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(stop_at)
    run_pretrain([*flags, "--load", str(ckpt), *load_flags, "--metrics-path", str(second)],
                 nproc=nproc)
    return read_metrics(first) + read_metrics(second)


def assert_loss_falls(losses: Sequence[float]) -> None:
    """The mean of the last three losses is at least 10% below that of the first three."""
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


def losses_of(records) -> List[float]:
    return [r["lm_loss"] for r in records if "lm_loss" in r]


def write_indexed_dataset(prefix, documents) -> None:
    """Writes megatron-core PREFIX.bin/.idx (uint16 tokens) holding ``documents``."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)])
    builder.finalize(str(prefix) + ".idx")


def assert_one_error_line(status, stdout: str, stderr: str, expected: str) -> None:
    """Bad input failed as it must: exit status 2, on stderr exactly one line, which starts
    with ``error: `` and holds ``expected``, and no traceback anywhere."""
    assert status == 2, f"exit status {status}\n{stdout}{stderr}"
    assert "Traceback" not in stdout + stderr, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"


def ramp_batch(consumed: int, start: int, incr: int, samples: int, gbs: int) -> int:
    """The batch after ``consumed`` samples, by the rule of Megatron-LM's --help text.

    (gbs - start) / incr increments spread evenly over ``samples``; past them the full batch.
    """
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // incr)
    return start + incr * int(consumed / per_increment)


def ramp_batches(train_samples: int, start: int, incr: int, samples: int, gbs: int) -> list:
    """The batch of every iteration of a --train-samples run with the ramp.

    Megatron-LM's count (update_train_iters): ramp iterations while the consumed samples
    are within the ramp and the training samples, then whole full batches.
    """
    batches, consumed = [], 0
    while consumed <= samples and consumed <= train_samples:
        batches.append(ramp_batch(consumed, start, incr, samples, gbs))
        consumed += batches[-1]
    batches += [gbs] * (max(0, train_samples - consumed) // gbs)
    return batches
