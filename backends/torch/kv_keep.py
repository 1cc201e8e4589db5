"""Episodes' keys and values kept between their turns, so a turn prefills only its new tokens.

A multi-turn episode's next request is its last one's prompt, the tokens the engine generated,
and the environment's reply. When requests that carry an episode key finish, the sampler copies
their rows' keys and values out of the decode loop's cache (`KeptKV`: every position whose
token is known, i.e. all but the last generated token, whose keys the loop may have overwritten
since), those finishing together in one copy into one tensor (a pack) that their entries are
slices of, and `KVKeep.keep`s them under their keys; when an episode's next request is
admitted, `take` hands them back if its prompt starts with exactly the kept tokens (and goes on
past them), and the sampler restores them into the new slot and prefills only the rest.

Bounds and lifetime: the kept entries hold at most ``budget`` bytes of device memory in all,
counted by the tensors they hold (a pack counts whole while any of its entries is kept: its
memory is freed with its last entry); keeping one more evicts the least recently kept first (an
entry whose tensor is larger than the whole budget is not kept). `take` removes its entry, hit
or miss (a live request's keys are in its slot; a mismatched entry is of no further use).
`forget` drops an ended episode's entry; `clear` drops them all: the engine calls it at a
stand-down (the memory goes back for training, and a wake finds nothing kept: it may serve new
weights) and whenever the weights it serves change otherwise (a refit, a weights load: kept keys
and values are the old weights'). A request given up (a deadline, a stop) keeps nothing, even
one whose row finished as its caller gave up: its episode may have ended and been forgotten
already, and its entry would hold memory until evicted.

Thread-safe: the compute thread keeps and takes, the event loop forgets.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from torch import Tensor


def never_given_up() -> bool:
    """The ``given_up`` of a request whose caller cannot give up."""
    return False


class KeptKV(NamedTuple):
    """Keys and values ``kv`` [len(tokens), layers, 2, kv_heads, head_dim] of ``tokens`` at
    positions 0..len(tokens)-1 (a view into a pack, or a tensor of its own)."""

    tokens: tuple[int, ...]
    kv: Tensor


class KVKeep:
    """Kept episodes' keys and values, at most ``budget`` bytes, least recently kept evicted."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # Each entry with the address of the storage its tensor holds.
        self._entries: OrderedDict[Hashable, tuple[KeptKV, int]] = OrderedDict()
        self._holders: dict[int, int] = {}  # entries that hold each storage (by its address)
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0  # entries dropped to make room, in all

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def keep(self, key: Hashable, kept: KeptKV, *, given_up: Callable[[], bool] = never_given_up) -> None:
        """Keep ``kept`` under ``key``: `keep_all` of one."""
        self.keep_all([(key, kept, given_up)])

    def keep_all(self, entries: Sequence[tuple[Hashable, KeptKV, Callable[[], bool]]]) -> None:
        """Keep each ``(key, kept, given_up)`` in order under its key (replacing what was kept
        under it), evicting the least recently kept entries until its memory fits; one whose
        tensor is larger than the budget is not kept, nor one whose request ``given_up`` says
        its caller gave up. ``given_up`` is asked under the lock `forget` takes: a caller that
        marks its request given up before it forgets the episode never leaves an entry behind,
        however the two threads interleave."""
        with self._lock:
            for key, kept, given_up in entries:
                self._pop(key)
                storage = kept.kv.untyped_storage()
                address = storage.data_ptr()
                added = 0 if address in self._holders else storage.nbytes()
                if added > self.budget or given_up():
                    continue
                while self._bytes + added > self.budget:
                    self._pop(next(iter(self._entries)))
                    self.evicted += 1
                self._entries[key] = (kept, address)
                self._holders[address] = self._holders.get(address, 0) + 1
                self._bytes += added

    def take(self, key: Hashable, prompt: Sequence[int]) -> KeptKV | None:
        """Remove ``key``'s entry; it, when ``prompt`` starts with its tokens and goes on past
        them (a prefill needs at least one new token to draw from), else None."""
        with self._lock:
            kept = self._pop(key)
        if kept is None or len(prompt) <= len(kept.tokens):
            return None
        return kept if tuple(prompt[: len(kept.tokens)]) == kept.tokens else None

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._pop(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._holders.clear()
            self._bytes = 0

    def _pop(self, key: Hashable) -> KeptKV | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        kept, address = entry
        self._holders[address] -= 1
        if not self._holders[address]:
            del self._holders[address]
            self._bytes -= kept.kv.untyped_storage().nbytes()
        return kept
