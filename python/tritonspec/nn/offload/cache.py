"""Which experts of one layer occupy its fixed GPU slots, and which to evict: the bookkeeping only.

Slots are allocated once per layer; steady state never allocates. Policies choose a victim:

- ``"lru"``: the least recently used resident.
- ``"lfu"``: the resident used least often since the start (ties: least recent).
- ``"frequency"``: static placement by measured frequency (KTransformers' expert scheduling): after the
  first batch (the prefill's routing, a profile) or :meth:`SlotCache.place`, the most used experts are
  pinned in all slots but ``spill``; misses pass through the spill slots, LRU among them.

:func:`simulate` replays a routing trace through a policy and :func:`belady` gives the offline optimum
(evict the resident needed farthest in the future) on the same trace, so a policy's hit rate has a ceiling.
"""

from __future__ import annotations

from typing import Iterable, Sequence

POLICIES = ("lru", "lfu", "frequency")


class SlotCache:
    def __init__(self, num_slots: int, num_experts: int, policy: str = "lru", spill: int = 1):
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
        if not 1 <= num_slots:
            raise ValueError(f"num_slots: expected at least 1, got {num_slots}")
        self.num_slots, self.num_experts, self.policy = num_slots, num_experts, policy
        self.spill = max(1, min(spill, num_slots)) if policy == "frequency" else 0
        self.slot_of = [-1] * num_experts
        self.expert_in = [-1] * num_slots
        self.last_use = [0] * num_slots
        self.uses = [0] * num_experts
        self.pinned: set[int] = set()  # slots the frequency policy never evicts
        self.placed = False
        self._tick = 0

    def lookup(self, e: int) -> int:
        return self.slot_of[e]

    def count(self, experts: Iterable[int]) -> None:
        """Record one use of each expert of a batch (whatever serves it: slot, copy or CPU)."""
        for e in experts:
            self.uses[e] += 1

    def touch(self, e: int) -> None:
        self._tick += 1
        self.last_use[self.slot_of[e]] = self._tick

    def victim(self, keep: set[int] = frozenset()) -> int:
        """A slot to overwrite, never one in ``keep`` (slots the current batch reads) nor a pinned one; -1 if none."""
        best, best_key = -1, None
        for s in range(self.num_slots):
            if s in keep or s in self.pinned:
                continue
            e = self.expert_in[s]
            if e < 0:
                return s
            key = (self.uses[e], self.last_use[s]) if self.policy == "lfu" else (self.last_use[s],)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def admit(self, e: int, slot: int) -> int:
        """Put expert ``e`` in ``slot``; returns the expert evicted (-1 if the slot was free)."""
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot], self.slot_of[e] = e, slot
        self.touch(e)
        return old

    def placement(self) -> list[int]:
        """The experts the frequency policy pins: the most used, as many as slots minus the spill."""
        ranked = sorted(range(self.num_experts), key=lambda e: (-self.uses[e], e))
        return [e for e in ranked[: self.num_slots - self.spill] if self.uses[e] > 0]

    def place(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """Pin ``experts`` (frequency policy); returns the (expert, slot) loads that makes necessary."""
        experts = list(experts)[: self.num_slots - self.spill]
        self.pinned = set()
        loads = []
        for e in experts:
            if self.slot_of[e] < 0:
                slot = self.victim(keep={self.slot_of[p] for p in experts if self.slot_of[p] >= 0})
                self.admit(e, slot)
                loads.append((e, slot))
            self.pinned.add(self.slot_of[e])
        self.placed = True
        return loads


def serve(cache: SlotCache, experts: Sequence[int]) -> list[list[tuple[int, int, bool]]]:
    """Plan how one batch's ``experts`` are served from slots: waves of ``(expert, slot, must_load)``.

    Resident experts run in the first wave. Missing ones are admitted into victims that no expert of the
    same wave occupies; when they do not all fit, waves take half the unpinned slots each, so one half
    loads while the other computes (the module issues each wave's loads after the previous wave's kernel,
    and a slot's copy waits for the kernel that last read it). Updates the cache as it plans.
    """
    resident = [e for e in experts if cache.lookup(e) >= 0]
    missing = [e for e in experts if cache.lookup(e) < 0]
    free = cache.num_slots - len(cache.pinned)
    victims = free - sum(cache.lookup(e) not in cache.pinned for e in resident)
    cap = len(missing) if len(missing) <= victims else max(1, free // 2)
    for e in resident:
        cache.touch(e)
    waves, wave = [], [(e, cache.lookup(e), False) for e in resident]
    while wave or missing:
        keep = {slot for _, slot, _ in wave}
        loaded = 0
        while missing and loaded < cap:
            slot = cache.victim(keep)
            if slot < 0:
                break
            e = missing.pop(0)
            cache.admit(e, slot)
            keep.add(slot)
            wave.append((e, slot, True))
            loaded += 1
        if not wave:
            raise RuntimeError(
                f"no slot is free for a missing expert (policy {cache.policy!r}, {cache.num_slots} "
                f"slots, {len(cache.pinned)} pinned)"
            )
        waves.append(wave)
        wave = []
    return waves


def place_after_profile(cache: SlotCache) -> list[tuple[int, int]]:
    """The frequency policy's placement once its first batch (the prefill: a profile) was counted: the
    (expert, slot) loads it needs; nothing for the other policies or once placed."""
    return cache.place(cache.placement()) if cache.policy == "frequency" and not cache.placed else []


def simulate(
    trace: Iterable[Iterable[int]], num_slots: int, num_experts: int, policy: str = "lru", spill: int = 1
) -> dict[str, int]:
    """Replay ``trace`` (the set of experts each batch of one layer needs) through a policy: hits and misses,
    planned exactly as the module plans them (the frequency policy's placement loads are not counted)."""
    cache = SlotCache(num_slots, num_experts, policy, spill)
    hits = misses = 0
    for needed in trace:
        needed = sorted(set(needed))
        cache.count(needed)
        for wave in serve(cache, needed):
            for _, _, load in wave:
                misses += load
                hits += not load
        place_after_profile(cache)
    return {"hits": hits, "misses": misses}


def belady(trace: Sequence[Iterable[int]], num_slots: int) -> dict[str, int]:
    """The offline optimum on ``trace``: on a miss, evict the resident whose next use is farthest away."""
    trace = [sorted(set(t)) for t in trace]
    next_use: list[dict[int, int]] = [{} for _ in trace]
    upcoming: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = dict(upcoming)  # for each expert, the first step after i that needs it
        for e in trace[i]:
            upcoming[e] = i
    resident: set[int] = set()
    hits = misses = 0
    far = len(trace) + 1
    for i, needed in enumerate(trace):
        for e in needed:
            if e in resident:
                hits += 1
        for e in needed:
            if e in resident:
                continue
            misses += 1
            if len(resident) < num_slots:
                resident.add(e)
                continue
            candidates = [r for r in resident if r not in needed]
            if not candidates:
                continue  # streamed without caching
            out = max(candidates, key=lambda r: (next_use[i].get(r, far), r))
            if next_use[i].get(out, far) > next_use[i].get(e, far):
                resident.discard(out)
                resident.add(e)
    return {"hits": hits, "misses": misses}
