"""Memory-mapped token shards and their data-parallel slicing."""

import numpy as np
import pytest
import torch

from distlab.data.tokens import TokenShardLoader, write_token_bin


@pytest.fixture
def shards(tmp_path):
    a = np.arange(0, 300, dtype=np.int64)
    b = np.arange(1000, 1100, dtype=np.int64) * 7  # up to 7693, distinct from shard a
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    assert write_token_bin(a, paths[0]) == 300
    assert write_token_bin(torch.from_numpy(b), paths[1]) == 100
    return paths, [a, b]


def test_file_format_is_uint16_little_endian(tmp_path):
    path = tmp_path / "t.bin"
    write_token_bin([1, 258, 65535], path)
    assert path.read_bytes() == bytes([1, 0, 2, 1, 255, 255])


def test_out_of_range_ids_raise(tmp_path):
    with pytest.raises(ValueError, match="65535"):
        write_token_bin([1, 65536], tmp_path / "bad.bin")
    with pytest.raises(ValueError):
        write_token_bin([-1], tmp_path / "bad.bin")


def test_windows_equal_written_tokens(shards):
    paths, arrays = shards
    loader = TokenShardLoader(paths, seq_len=16, batch_size=32, seed=1)
    seen_shards = set()
    for step in range(3):
        x, y = loader.get_batch(step)
        assert x.shape == y.shape == (32, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            for i, array in enumerate(arrays):
                hits = np.flatnonzero(array == row_x[0])
                if hits.size:
                    start = int(hits[0])
                    assert row_x + [row_y[-1]] == array[start : start + 17].tolist()  # never crosses a shard end
                    seen_shards.add(i)
    assert seen_shards == {0, 1}


def test_batches_deterministic_per_seed_and_step(shards):
    paths, _ = shards
    a = TokenShardLoader(paths, 16, 4, seed=0)
    b = TokenShardLoader(paths, 16, 4, seed=0)
    assert torch.equal(a.get_batch(7)[0], b.get_batch(7)[0])
    assert not torch.equal(a.get_batch(7)[0], a.get_batch(8)[0])
    assert not torch.equal(a.get_batch(7)[0], TokenShardLoader(paths, 16, 4, seed=1).get_batch(7)[0])


def test_shards_concatenate_to_global_batch(shards):
    paths, _ = shards
    loader = TokenShardLoader(paths, seq_len=8, batch_size=12, seed=5)
    gx, gy = loader.get_batch(3)
    parts = [loader.shard(r, 4).get_batch(3) for r in range(4)]
    assert all(p[0].shape == (3, 8) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    with pytest.raises(ValueError, match="not divisible"):
        loader.shard(0, 5)
    with pytest.raises(ValueError, match="rank"):
        loader.shard(4, 4)


def test_short_shard_errors(tmp_path):
    write_token_bin(range(10), tmp_path / "short.bin")
    with pytest.raises(ValueError, match="holds 10 tokens; a window needs seq_len\\+1=17"):
        TokenShardLoader(tmp_path / "short.bin", seq_len=16, batch_size=2)
    write_token_bin(range(17), tmp_path / "exact.bin")
    x, y = TokenShardLoader(tmp_path / "exact.bin", seq_len=16, batch_size=2).get_batch(0)
    assert x[0].tolist() == list(range(16)) and y[1].tolist() == list(range(1, 17))
