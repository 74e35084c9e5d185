"""The pinned allocator's setting: several register threads unless the user chose the pinned path."""

from ninfer.engine.pinned_allocator import MAX_REGISTER_THREADS, pinned_allocator_settings


def test_threads_follow_the_cpus_up_to_the_cap(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert pinned_allocator_settings(2) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:1"
    assert pinned_allocator_settings(6).endswith("pinned_num_register_threads:3")
    assert pinned_allocator_settings(128).endswith(f"pinned_num_register_threads:{MAX_REGISTER_THREADS}")


def test_a_users_pinned_setting_wins(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:False")
    assert pinned_allocator_settings(16) is None
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # other settings: ours still applies
    assert pinned_allocator_settings(16) is not None
