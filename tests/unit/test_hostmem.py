"""The recycled host buffer pool (no sockets)."""
import torch

from genie.transport.hostmem import POOL_MIN_BYTES, HostBufferPool


def test_blocks_are_reused_only_once_every_view_is_gone():
    pool = HostBufferPool(64 << 20)
    a = pool.take(3 << 20)
    b = pool.take(3 << 20)
    assert pool.allocations == 2 and a.data_ptr() != b.data_ptr()
    shaped = a.view(torch.float32).view(3, -1)  # a view of a view keeps the block in use
    address = a.data_ptr()
    del a
    c = pool.take(3 << 20)
    assert pool.allocations == 3 and c.data_ptr() != address
    del shaped
    d = pool.take(3 << 20)
    assert pool.reuses == 1 and d.data_ptr() == address and d.nbytes == 3 << 20


def test_idle_blocks_beyond_the_bound_are_released():
    pool = HostBufferPool(4 << 20)
    blocks = [pool.take(2 << 20) for _ in range(4)]
    assert pool.held_bytes() == 8 << 20
    del blocks
    assert pool.idle_bytes() == 8 << 20
    new = pool.take(6 << 20)  # idle 8 MiB + 6 MiB new > 4 MiB bound: the idle blocks go
    assert pool.idle_bytes() == 0 and pool.held_bytes() == 6 << 20 and new.nbytes == 6 << 20


def test_small_payloads_are_not_pooled():
    pool = HostBufferPool(64 << 20)
    t = pool.take(POOL_MIN_BYTES - 1)
    assert t.nbytes == POOL_MIN_BYTES - 1 and pool.allocations == 0


def test_huge_pages_are_asked_for_only_where_a_fault_never_compacts_memory(tmp_path, monkeypatch):
    from genie.transport import hostmem

    setting = tmp_path / "defrag"
    monkeypatch.setattr(hostmem, "THP_DEFRAG", str(setting))
    expected = {"always defer defer+madvise [madvise] never": False, "[always] defer defer+madvise madvise never": False,
                "always defer [defer+madvise] madvise never": False, "always [defer] defer+madvise madvise never": True,
                "always defer defer+madvise madvise [never]": True}
    for line, safe in expected.items():
        setting.write_text(line + "\n")
        assert hostmem._huge_pages_without_stalls() is safe, line
    setting.unlink()
    assert hostmem._huge_pages_without_stalls() is False  # no THP in this kernel: nothing to ask for


def test_snapshots_copy_and_recycle_their_blocks_only_when_free():
    from genie.transport.hostmem import snapshot

    source = torch.randn(64, 1024).t()  # 256 KiB, dense but not row-major
    first = snapshot(source)
    assert first.stride() == source.stride() and torch.equal(first, source)
    address = first.data_ptr()
    source.add_(1)
    assert not torch.equal(first, source)  # a copy, not a view
    second = snapshot(source)
    assert second.data_ptr() != address  # `first` still views its block
    del first
    third = snapshot(source)
    assert third.data_ptr() == address and torch.equal(third, source)  # the free block again
    small = torch.arange(4.0)
    assert torch.equal(snapshot(small), small)
