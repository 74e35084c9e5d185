"""KVPool: refcounted allocation of KV page ids (the storage is the runner's KVCache).

A page shared by several owners (active requests and checkpoints) is freed only when
its last reference goes; pages are never written by more than one owner (copy-on-write
of a partially filled page happens before a resuming request writes into it).
"""

from __future__ import annotations


class KVPoolError(RuntimeError):
    """Accounting invariant broken (a bug, never a client error)."""


class KVPool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 0 or page_size <= 0:
            raise ValueError("KV pool needs num_pages >= 0 and a positive page_size")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise KVPoolError(f"asked for {num_pages} pages with {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages another owner already holds."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise KVPoolError(f"sharing free page {page}")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            count = self._refcount[page]
            if count <= 0:
                raise KVPoolError(f"releasing free page {page}")
            self._refcount[page] = count - 1
            if count == 1:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def check_balanced(self) -> None:
        """Every page either free with refcount 0 or held with refcount > 0 (tests call this)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVPoolError("a page is on the free list twice")
        for page, count in enumerate(self._refcount):
            if (page in free) != (count == 0) or count < 0:
                raise KVPoolError(f"page {page}: refcount {count}, free={page in free}")
