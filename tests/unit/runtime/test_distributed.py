"""megatron_ext.runtime.distributed: the CUDA allocator's default settings."""

from megatron_ext.runtime.distributed import ALLOCATOR_DEFAULT, cuda_allocator_default


def test_allocator_default_when_the_job_sets_none():
    env = {}
    assert cuda_allocator_default(env) == ALLOCATOR_DEFAULT
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_the_jobs_own_allocator_settings_are_kept():
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {name: "expandable_segments:False"}
        assert cuda_allocator_default(env) == ""
        assert env == {name: "expandable_segments:False"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}  # set empty: torch's defaults, on purpose
    assert cuda_allocator_default(env) == ""
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": ""}
