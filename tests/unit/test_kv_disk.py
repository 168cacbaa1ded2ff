"""KVDisk / KVStore persistence: appends along any axis come back equal; bad records are refused."""
import json

import pytest
import torch

from genie_daemon.handles import MemoryAccount
from genie_daemon.kv_store import KVDisk, KVStore


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_appends_reload_equal_after_a_restart(tmp_path, dim):
    store = KVStore(MemoryAccount(), KVDisk(str(tmp_path)))
    shape = [2, 3, 4, 5]
    parts_k, parts_v = [], []
    for n in (3, 1, 1, 2):
        shape[dim] = n
        k, v = torch.randn(shape), torch.randn(shape)
        store.append("s1", 7, k, v, dim)
        parts_k.append(k)
        parts_v.append(v)
    fresh = KVStore(MemoryAccount(), KVDisk(str(tmp_path)))  # a new daemon process on the same directory
    keys, values, got_dim = fresh.get("s1", 7)
    assert got_dim == dim
    assert torch.equal(keys, torch.cat(parts_k, dim)) and torch.equal(values, torch.cat(parts_v, dim))


def test_an_evicted_session_reloads_instead_of_failing(tmp_path):
    account = MemoryAccount()
    store = KVStore(account, KVDisk(str(tmp_path)))
    k = torch.randn(1, 2, 5, 4)
    store.append("s2", 0, k, -k, 2)
    store.begin_request()  # the session is idle in the next request
    assert store.evict_for(1) > 0 and "s2" not in store.sessions
    keys, values, _ = store.get("s2", 0)
    assert torch.equal(keys, k) and torch.equal(values, -k)


def test_a_tampered_record_is_refused(tmp_path):
    store = KVStore(MemoryAccount(), KVDisk(str(tmp_path)))
    store.append("s3", 0, torch.ones(1, 2, 3), torch.ones(1, 2, 3), 2)
    record = tmp_path / "s3" / "0.json"
    data = json.loads(record.read_text())
    data["length"] = 10_000  # claims more than the file holds
    record.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bytes on disk"):
        KVStore(MemoryAccount(), KVDisk(str(tmp_path))).get("s3", 0)
    data["dtype"] = "object"
    record.write_text(json.dumps(data))
    with pytest.raises(Exception, match="dtype"):
        KVStore(MemoryAccount(), KVDisk(str(tmp_path))).get("s3", 0)
