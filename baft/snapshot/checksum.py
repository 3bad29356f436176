"""Chunk checksums that a GPU computes from the source tensors and the host verifies from the slot bytes.

The checksum of ``n`` bytes is ``(n + sum_i w_i * a_i) mod 2**64``: ``w_i`` is the i-th
little-endian 64-bit word of the bytes (the last one zero-padded when ``n`` is not a multiple of
8) and ``a_i`` a fixed odd weight, ``a_i = A[i mod B] * C[i // B]`` with ``A`` and ``C`` from
splitmix64 (``B`` = 2**17 words, 1 MiB, so the tables stay small whatever the length). Integer
arithmetic that wraps mod 2**64 gives the same sum in any reduction order, so a CUDA kernel's sum
over the live tensor, torch's ``dot`` on CPU and numpy's over the host bytes agree to the bit.

What it detects: any change confined to one word (``d * a_i`` is 0 mod 2**64 only for ``d`` = 0,
``a_i`` being odd); blocks moved or swapped, and random corruption, with probability 1 - 2**-64
over the weights. Its blind spot is that of every such sum: a change whose words all differ only
in bits k and up is checked on 64 - k bits (two sign bits flipped cancel) — it guards against
stale, torn and overwritten chunks, not against an adversary.

On CPU torch's dot product runs at about half xxh3's speed and releases the GIL
(``experiments/checksum_throughput.py``); on a GPU it costs the device a read of the source.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BLOCK_WORDS = 1 << 17
PRODUCT_BYTES = 256 << 20  # the int64 products a GPU holds at once while it sums a long run of chunks
_MASK = (1 << 64) - 1


def _splitmix64(index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = index + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@functools.cache
def _within() -> np.ndarray:
    """``A``: the odd weights within a block."""
    return _splitmix64(np.arange(BLOCK_WORDS, dtype=np.uint64)) | np.uint64(1)


def _blocks(count: int) -> np.ndarray:
    """``C``: the odd weights of the first ``count`` blocks (their indices follow ``A``'s)."""
    return _splitmix64(np.arange(BLOCK_WORDS, BLOCK_WORDS + count, dtype=np.uint64)) | np.uint64(1)


def weights(words: int) -> np.ndarray:
    """The weights ``a_0 .. a_{words-1}`` (uint64)."""
    with np.errstate(over="ignore"):
        return (_within()[None, :] * _blocks(-(-words // BLOCK_WORDS))[:, None]).reshape(-1)[:words]


def hexdigest(value: int) -> str:
    """A checksum as the commit record holds it: 16 hex digits."""
    return f"{value & _MASK:016x}"


def hexdigests(values: "torch.Tensor") -> list[str]:
    """:func:`hexdigest` of each int64 in ``values`` (a CPU tensor): one formatting pass in numpy, not a
    Python format per chunk (a 10 GB state has ten thousand)."""
    text = values.numpy().astype(">i8").tobytes().hex()
    return [text[i:i + 16] for i in range(0, len(text), 16)]


def _tail_word(data) -> int:
    return int.from_bytes(bytes(data), "little")


def digest(data) -> str:
    """The checksum of a bytes-like object (a slot's chunk, a bundle), computed on the host with numpy."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    full = n // 8
    words = np.frombuffer(view, dtype="<u8", count=full)
    a, c = _within(), _blocks(full // BLOCK_WORDS + 1)
    total = n
    with np.errstate(over="ignore"):
        for block, start in enumerate(range(0, full, BLOCK_WORDS)):
            part = words[start:start + BLOCK_WORDS]
            total += int(c[block]) * int(np.dot(part, a[:len(part)]))
    if n % 8:
        total += _tail_word(view[full * 8:]) * int(a[full % BLOCK_WORDS]) * int(c[full // BLOCK_WORDS])
    return hexdigest(total)


class TorchSums:
    """The same checksum as int64 tensors on the data's device, queued like any kernel (no host sync).

    The weights live on each device once, grown to the longest chunk asked for.
    """

    def __init__(self):
        self._weights: dict[str, "torch.Tensor"] = {}
        self._many = None  # of_many's last pieces' lengths, and their weights and bounds

    def _weights_on(self, device, words: int) -> "torch.Tensor":
        import torch

        key = str(device)
        have = self._weights.get(key)
        if have is None or have.numel() < words:
            have = torch.from_numpy(weights(max(words, 1)).view(np.int64)).to(device)
            self._weights[key] = have
        return have[:words]

    def of(self, data: "torch.Tensor") -> "torch.Tensor":
        """The checksum of a flat uint8 tensor, as a 0-d int64 tensor on its device."""
        import torch

        n = data.numel()
        full = n // 8
        if n % 8 or data.data_ptr() % 8:
            # the last word zero-padded; an unaligned view cannot be read as int64 words in place
            padded = torch.empty(full * 8 + (8 if n % 8 else 0), dtype=torch.uint8, device=data.device)
            padded[:n].copy_(data)
            padded[n:].zero_()
            data = padded
        words = data.view(torch.int64)
        return _dot(words, self._weights_on(data.device, words.numel())) + n

    def of_many(self, pieces: list["torch.Tensor"]) -> "torch.Tensor":
        """The checksums of several small flat uint8 tensors on one device, as one int64 tensor: a few operations
        over their bytes side by side (each zero-padded to whole words), not a few per piece."""
        import torch

        lengths = tuple(p.numel() for p in pieces)
        if self._many is None or self._many[0] != lengths:  # the seal asks for the same pieces every snapshot
            words = -(-np.array(lengths, dtype=np.int64) // 8)
            bounds = np.concatenate([[0], np.cumsum(words)])
            within = np.arange(bounds[-1]) - np.repeat(bounds[:-1], words)
            device = pieces[0].device if pieces else "cpu"
            weights = self._weights_on(device, int(words.max(initial=1)))[torch.from_numpy(within).to(device)]
            self._many = (lengths, weights, torch.from_numpy(bounds).to(device),
                          torch.tensor(lengths, dtype=torch.int64, device=device))
        _, weights, bounds, nbytes = self._many
        padded = [p if n % 8 == 0 else torch.cat([p, p.new_zeros(8 - n % 8)]) for p, n in zip(pieces, lengths)]
        products = torch.cat(padded).view(torch.int64) * weights if pieces else weights
        running = torch.cat([products.new_zeros(1), products.cumsum(0)])  # wraps mod 2**64 as a sum does
        return running[bounds[1:]] - running[bounds[:-1]] + nbytes

    def of_chunks(self, data: "torch.Tensor", chunk_bytes: int) -> "torch.Tensor":
        """The checksums of ``data`` cut into consecutive chunks of ``chunk_bytes`` (the last one may be
        shorter), as one int64 tensor: a few kernels for a whole run of chunks, not one per chunk."""
        import torch

        n = data.numel()
        full = n // chunk_bytes
        if not full or chunk_bytes % 8 or data.data_ptr() % 8:
            return torch.stack([self.of(data[i:i + chunk_bytes]) for i in range(0, n, chunk_bytes)])
        words = chunk_bytes // 8
        rows = data[:full * chunk_bytes].view(torch.int64).view(full, words)
        w = self._weights_on(data.device, words)
        if data.is_cuda:
            # bounded temporaries: 256 MiB of products at a time (torch has no int64 matrix product on CUDA)
            step = max(1, PRODUCT_BYTES // chunk_bytes)
            sums = [torch.mul(rows[i:i + step], w).sum(dim=1) for i in range(0, full, step)]
        else:
            sums = [torch.dot(row, w).reshape(1) for row in rows]
        sums = (torch.cat(sums) if len(sums) > 1 else sums[0]) + chunk_bytes
        if full * chunk_bytes < n:
            sums = torch.cat([sums, self.of(data[full * chunk_bytes:]).reshape(1)])
        return sums


def _dot(words: "torch.Tensor", w: "torch.Tensor") -> "torch.Tensor":
    import torch

    if words.is_cuda:  # cuBLAS has no integer dot product
        return torch.mul(words, w).sum()
    return torch.dot(words, w)
