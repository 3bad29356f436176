"""Reed–Solomon shares rebuild the input from any k of n, and node bundles round-trip verified."""

import os

import pytest
from hypothesis import given, settings, strategies as st

from baft.errors import BaftError
from baft.manager import erasure
from baft.snapshot.layout import CommitRecord, TensorEntry, checksum, plan_layout


@st.composite
def coded(draw):
    n = draw(st.integers(2, 12))
    k = draw(st.integers(1, n - 1))
    data = draw(st.binary(min_size=0, max_size=4096))
    survivors = draw(st.permutations(range(n)))[:k]
    return k, n, data, survivors


@settings(max_examples=200, deadline=None)
@given(coded())
def test_any_k_shares_rebuild_the_input(case):
    k, n, data, survivors = case
    shares = erasure.encode(data, k, n)
    assert len(shares) == n
    assert len({len(s) for s in shares}) == 1
    kept = {i: shares[i] for i in survivors}
    assert erasure.decode(kept, k, n, len(data)) == data


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n - 1))))
def test_fewer_than_k_shares_are_refused(kn):
    n, k = kn
    data = os.urandom(1000)
    shares = erasure.encode(data, k, n)
    with pytest.raises(BaftError, match="at least k="):
        erasure.decode({i: shares[i] for i in range(k - 1)}, k, n, len(data))


def test_large_input_round_trips_from_parity_only():
    data = os.urandom(3 << 20) + b"tail"
    shares = erasure.encode(data, 3, 6)
    assert erasure.decode({3: shares[3], 4: shares[4], 5: shares[5]}, 3, 6, len(data)) == data


def test_two_members_one_data_share_is_replication():
    data = os.urandom(5000)
    shares = erasure.encode(data, 1, 2)
    assert shares[0] == data and shares[1] == data


@pytest.mark.parametrize("k,n,word", [(0, 3, "k=0"), (3, 3, "k=3"), (4, 3, "k=4"), (1, 1, "n=1"), (1, 257, "n=257")])
def test_bad_codes_are_one_line_errors(k, n, word):
    with pytest.raises(BaftError, match=word) as err:
        erasure.encode(b"x", k, n)
    assert "\n" not in str(err.value)


def test_wrong_share_length_is_refused():
    shares = erasure.encode(b"abcdefgh", 2, 3)
    with pytest.raises(BaftError, match="share 0 holds 3 bytes"):
        erasure.decode({0: shares[0][:3], 2: shares[2]}, 2, 3, 8)


def _snapshot(rank, step, nbytes):
    layout = plan_layout([TensorEntry("w", "float32", (nbytes // 4,), nbytes, "parameters")], chunk_bytes=4096)
    buffer = os.urandom(layout.nbytes)
    sums = [checksum(buffer[c.offset:c.offset + c.nbytes]) for c in layout.chunks]
    return CommitRecord(step, rank, rank, layout, sums, items={"rng": rank}), buffer


def test_bundle_round_trips_through_parity():
    snaps = [_snapshot(0, 7, 40000), _snapshot(1, 7, 12000)]
    bundle = erasure.pack_bundle(3, 7, snaps)
    shares = erasure.encode(bundle, 2, 3)
    rebuilt = erasure.decode({1: shares[1], 2: shares[2]}, 2, 3, len(bundle))
    assert erasure.bundle_checksum(rebuilt) == erasure.bundle_checksum(bundle)
    out = erasure.unpack_bundle(rebuilt)
    assert (out.node_id, out.step) == (3, 7)
    assert [(r.to_json(), b) for r, b in out.snapshots] == [(r.to_json(), b) for r, b in snaps]


def test_corrupt_bundle_names_the_chunk():
    record, buffer = _snapshot(0, 7, 40000)
    bundle = bytearray(erasure.pack_bundle(0, 7, [(record, buffer)]))
    bundle[-5000] ^= 1  # inside the last chunks of rank 0's buffer
    with pytest.raises(BaftError, match=r"rank 0: chunk \d+ \(w bytes"):
        erasure.unpack_bundle(bytes(bundle))
