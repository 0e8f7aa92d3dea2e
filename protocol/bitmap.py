"""Have-bitmaps: which chunks of a version a node holds.

Bit ``i`` (chunk ``i`` in the manifest's global order) lives in byte ``i // 8``
under mask ``1 << (i % 8)`` (least significant bit first).  The bitmap is
``ceil(num_chunks / 8)`` bytes; bits past ``num_chunks`` are zero.  This is
the encoding of ``HaveEntry.bitmap`` on the wire.
"""

from __future__ import annotations


class Bitmap:
    __slots__ = ("_bits", "_count", "n")

    def __init__(self, n: int, data: bytes | None = None) -> None:
        self.n = n
        size = (n + 7) // 8
        if data is None:
            self._bits = bytearray(size)
            self._count = 0
        else:
            if len(data) != size:
                raise ValueError(f"bitmap of {len(data)} bytes for {n} chunks (want {size})")
            self._bits = bytearray(data)
            if n % 8 and self._bits:
                self._bits[-1] &= (1 << (n % 8)) - 1  # ignore padding bits
            self._count = int.from_bytes(self._bits, "little").bit_count()

    def __contains__(self, i: int) -> bool:
        return 0 <= i < self.n and bool(self._bits[i >> 3] & (1 << (i & 7)))

    def set(self, i: int) -> bool:
        """Set bit ``i``; return True if it was not set before."""
        if not 0 <= i < self.n:
            raise IndexError(i)
        mask = 1 << (i & 7)
        if self._bits[i >> 3] & mask:
            return False
        self._bits[i >> 3] |= mask
        self._count += 1
        return True

    def clear(self, i: int) -> None:
        mask = 1 << (i & 7)
        if self._bits[i >> 3] & mask:
            self._bits[i >> 3] &= ~mask & 0xFF
            self._count -= 1

    @property
    def count(self) -> int:
        return self._count

    @property
    def complete(self) -> bool:
        return self._count == self.n

    def indices(self) -> list[int]:
        return [i for i in range(self.n) if i in self]

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if i not in self]

    def raw(self) -> bytearray:
        """The bits themselves, for loops that test many (``bits[i >> 3] >> (i & 7) & 1``
        costs a third of ``i in bitmap``): read, never written."""
        return self._bits

    def to_bytes(self) -> bytes:
        return bytes(self._bits)

    def copy(self) -> Bitmap:
        return Bitmap(self.n, bytes(self._bits))

    def __repr__(self) -> str:
        return f"Bitmap({self._count}/{self.n})"
