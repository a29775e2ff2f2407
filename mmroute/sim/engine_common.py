"""What the simulated vLLM and SGLang engines share: the request bookkeeping the
``Runner`` drives (admission checks, KV reservations, Prometheus-style counters) and
the batching of one step's events. The cache itself (block pool / radix tree) and its
hashes stay in each engine's module.

A request's whole lifetime is reserved at admission, in the engine's unit of KV
(vLLM blocks, SGLang pages): ``prompt + max_new_tokens - 1`` tokens, since the last
sampled token is never computed.
"""

from __future__ import annotations

from typing import Any, Callable

from mmroute.sim.wire import Record

Emit = Callable[[list[Record]], None]


class CapacityError(ValueError):
    """The request can never fit in the KV cache (more blocks/pages than the pool holds)."""


class EngineCore:
    """Base of both engines. A subclass sets ``UNIT``/``POOL`` (words in errors),
    ``unit_tokens`` (block or page size) and ``capacity`` (usable units); its sequences
    have ``request_id``, ``num_prompt``, ``token_ids``, ``reserved`` and ``finished``."""

    UNIT = "blocks"
    POOL = "cache"
    unit_tokens: int

    def __init__(self, emit: Emit | None) -> None:
        self._emit = emit or (lambda records: None)
        self._pending: list[Record] = []
        self._reserved_total = 0  # units promised to running requests, not yet allocated
        self.running: dict[str, Any] = {}
        # Prometheus-style counters (prefix cache queries/hits in tokens, tokens processed).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def _flush(self) -> None:
        """Publish the events of this step as one batch."""
        if self._pending:
            records, self._pending = self._pending, []
            self._emit(records)

    def _lifetime(self, seq: Any, max_new_tokens: int) -> int:
        """Units the request holds at most: the last sampled token is never computed."""
        tokens = seq.num_prompt + max(max_new_tokens, 1) - 1
        return -(-tokens // self.unit_tokens)

    def fits_ever(self, seq: Any, max_new_tokens: int) -> bool:
        return self._lifetime(seq, max_new_tokens) <= self.capacity

    def _check_new(self, seq: Any, max_new_tokens: int) -> None:
        """A request ``try_prefill`` may consider: not running yet, not empty, can ever fit."""
        if seq.request_id in self.running:
            raise ValueError(f"request {seq.request_id!r} already running")
        if seq.num_prompt == 0:
            raise ValueError("empty prompt")
        if not self.fits_ever(seq, max_new_tokens):
            need = self._lifetime(seq, max_new_tokens)
            raise CapacityError(f"request needs {need} KV {self.UNIT}, the {self.POOL} has {self.capacity}")

    def _count_prefill(self, num_prompt: int, hit_tokens: int) -> None:
        self.prefix_queries += num_prompt
        self.prefix_hits += hit_tokens
        self.prompt_tokens += num_prompt

    def _start(self, seq: Any, reserved: int) -> None:
        """``seq`` is admitted, with ``reserved`` units promised for its decode."""
        seq.reserved = reserved
        self._reserved_total += reserved
        self.running[seq.request_id] = seq

    def _take_reserved(self, seq: Any, units: int) -> None:
        """``units`` are being allocated to ``seq``: they stop counting as promised."""
        take = min(units, seq.reserved)
        seq.reserved -= take
        self._reserved_total -= take

    def _add_token(self, seq: Any, token_id: int) -> None:
        seq.token_ids.append(token_id)
        self.generation_tokens += 1

    def _retire(self, seq: Any) -> bool:
        """Mark ``seq`` finished and drop what it still had promised; False if it already was."""
        if seq.finished:
            return False
        seq.finished = True
        self.running.pop(seq.request_id, None)
        self._reserved_total -= seq.reserved
        seq.reserved = 0
        return True
