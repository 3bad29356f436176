"""The chunk checksum: one pure function of the bytes, the same from torch (as a GPU computes it) and numpy."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from baft.snapshot import checksum as cs

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(data: bytes) -> str:
    """The definition, word by word in Python integers (``docs/persisted-format.rst``)."""
    total = len(data)
    padded = data + bytes(-len(data) % 8)
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        a = splitmix64(i % cs.BLOCK_WORDS) | 1
        c = splitmix64(cs.BLOCK_WORDS + i // cs.BLOCK_WORDS) | 1
        total += word * a * c
    return f"{total & MASK:016x}"


def from_torch(data: bytes, sums=cs.TorchSums()) -> str:
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return cs.hexdigest(int(sums.of(tensor)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_torch_and_numpy_give_the_reference_value_on_any_length(data):
    assert cs.digest(data) == reference(data) == from_torch(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=600), st.data())
def test_any_single_byte_change_changes_it(data, draw):
    i = draw.draw(st.integers(0, len(data) - 1))
    new = draw.draw(st.integers(0, 255).filter(lambda b: b != data[i]))
    changed = data[:i] + bytes([new]) + data[i + 1:]
    assert cs.digest(changed) != cs.digest(data)
    assert from_torch(changed) != from_torch(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(2, 12), st.data())
def test_swapping_two_distinct_blocks_changes_it(size, count, draw):
    blocks = draw.draw(st.lists(st.binary(min_size=size, max_size=size), min_size=count, max_size=count))
    i, j = draw.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
    if blocks[i] == blocks[j]:
        blocks[i] = bytes([(blocks[i][0] + 1) % 256]) + blocks[i][1:]
    swapped = list(blocks)
    swapped[i], swapped[j] = blocks[j], blocks[i]
    assert cs.digest(b"".join(swapped)) != cs.digest(b"".join(blocks))


def test_several_blocks_and_an_unaligned_buffer_agree_with_the_reference():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 2 * cs.BLOCK_WORDS * 8 + 13, dtype=np.uint8).tobytes()
    assert cs.digest(data) == reference(data) == from_torch(data)
    shifted = memoryview(bytearray(b"x" + data))[1:]  # numpy reads words at an odd address
    assert cs.digest(shifted) == cs.digest(data)
    unaligned = torch.frombuffer(bytearray(b"xyz" + data), dtype=torch.uint8)[3:]
    assert cs.hexdigest(int(cs.TorchSums().of(unaligned))) == cs.digest(data)


@pytest.mark.parametrize("nbytes", [0, 5, 4096, 4096 * 3, 4096 * 3 + 8, 4096 * 3 + 1003])
def test_a_run_of_chunks_gets_each_chunks_own_checksum(nbytes):
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    sums = cs.TorchSums().of_chunks(torch.from_numpy(data), 4096) if nbytes else torch.zeros(0, dtype=torch.int64)
    expected = [cs.digest(data[i:i + 4096].tobytes()) for i in range(0, nbytes, 4096)]
    assert [cs.hexdigest(int(s)) for s in sums] == expected


def test_pieces_summed_side_by_side_get_each_pieces_own_checksum():
    """of_many (the seal's small chunks): unaligned and empty pieces, and a set asked for again after another."""
    rng = np.random.default_rng(3)
    sums = cs.TorchSums()
    sets = [[4096, 4096, 8], [5, 0, 4096 * 3 + 1003, 1, 16], [4096, 4096, 8], []]
    for lengths in sets:
        pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
        got = sums.of_many([torch.from_numpy(p) for p in pieces])
        assert cs.hexdigests(got) == [cs.digest(p.tobytes()) for p in pieces]
    slot = torch.from_numpy(rng.integers(0, 256, 1000, dtype=np.uint8))
    views = [slot[3:100], slot[101:613]]  # views into one buffer at unaligned offsets, as a slot's are
    assert cs.hexdigests(sums.of_many(views)) == [cs.digest(v.numpy().tobytes()) for v in views]


def test_hexdigests_formats_each_sum_as_hexdigest_does():
    values = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789012345])
    assert cs.hexdigests(values) == [cs.hexdigest(int(v)) for v in values] and cs.hexdigests(values[:0]) == []


def test_the_cuda_formulation_gives_the_same_sum_as_the_cpu_one():
    """A GPU sums products (no integer dot product there); on CPU both formulations must agree."""
    words = torch.from_numpy(np.random.default_rng(1).integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64))
    w = torch.from_numpy(cs.weights(50_000).view(np.int64))
    assert int(torch.dot(words, w)) == int(torch.mul(words, w).sum()) == int(torch.mul(words, w).flip(0).cumsum(0)[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_computes_the_hosts_checksum(monkeypatch):
    data = np.random.default_rng(2).integers(0, 256, (1 << 22) + 77, dtype=np.uint8)
    sums = cs.TorchSums()
    device = torch.from_numpy(data).cuda()
    assert cs.hexdigest(int(sums.of(device))) == cs.digest(data.tobytes())
    expected = [cs.digest(data[i:i + (1 << 20)].tobytes()) for i in range(0, data.size, 1 << 20)]
    assert cs.hexdigests(sums.of_chunks(device, 1 << 20).cpu()) == expected
    monkeypatch.setattr(cs, "PRODUCT_BYTES", 3 << 20)  # the four whole chunks summed three, then one, at a time
    assert cs.hexdigests(sums.of_chunks(device, 1 << 20).cpu()) == expected
    pieces = [device[3:4099], device[5000:5005], device[8192:8192 + 65536]]
    assert cs.hexdigests(sums.of_many(pieces).cpu()) == [cs.digest(p.cpu().numpy().tobytes()) for p in pieces]


def test_the_definition_in_the_persisted_format_doc_is_this_checksum():
    text = (Path(__file__).parent.parent / "docs" / "persisted-format.rst").read_text()
    code = text[text.index("    MASK = 2**64 - 1"):text.index("``baft.snapshot.checksum.digest``")]
    namespace = {}
    exec("\n".join(line[4:] for line in code.splitlines()), namespace)
    rng = np.random.default_rng(4)
    for n in (0, 1, 7, 8, 9, 1000, 8 * cs.BLOCK_WORDS + 13):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert namespace["chunk_checksum"](data) == cs.digest(data)
