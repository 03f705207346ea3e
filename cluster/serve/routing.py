"""Request routers for the LLMServer replicas of a separate ingress (Ray Serve's request-router API,
set by the deployment's `request_router_config`), chosen by the Serve key `routing_policy`:

- `kv_aware`: each replica reports in its routing stats (`routing_stats`) what its prefix cache
  holds (the chain hashes of its cached blocks, shortened) and its load; the router hashes the
  prompt's token ids into the same chained block hashes (`engine.sched.block_pool.chain_block_hashes`) and
  sends the request to the replica holding the longest prefix of them, unless that replica's load
  exceeds the least-loaded one's by more than `load_margin` requests; a request with no hit goes to
  the least loaded. Between two reports, the prompts routed to a replica count as held by it.
- `prefix_text`: Ray Serve LLM's approach (its PrefixCacheAffinityRouter), for comparison: the
  router remembers the text it has sent each replica and routes a prompt to the replica that has seen
  the longest prefix of it, by the same rule; it never learns what a replica evicted.
- `pow2`: Serve's default power-of-two-choices router (no request_router_config).

The prompt reaches the router as the first argument of `LLMServer.generate`: the ingress passes
`{"prompt": text, "prompt_token_ids": ids}`, tokenized before routing, with the request's
`cache_salt` if it has one. Both routers salt their keys with it as the engine salts its block
hashes, so that a salted prompt is routed to where that tenant's prefix is cached, never to where
the same text is cached under another salt (or none).

LoRA adapter affinity comes first: a request's adapter is its Serve multiplexed model id, and it goes
to a replica that holds the adapter (as Serve's multiplexing reports, as the replica's routing stats
report, or as this router sent it there lately) unless every such replica's load exceeds the least
loaded one's by more than `load_margin`; only then is the adapter loaded on another replica, the
least loaded, among equals the one holding fewest adapters. Among the replicas holding it, the
prefix rule above picks. An adapter's KV blocks are not the base model's, so its name salts the
prompt's keys too.
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections.abc import Collection, Container, Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.sched.block_pool import SUMMARY_HASH_BYTES, chain_block_hashes, hash_block_tokens

KV_AWARE, PREFIX_TEXT, POW2 = "kv_aware", "prefix_text", "pow2"
ROUTING_POLICIES = (KV_AWARE, PREFIX_TEXT, POW2)
# Characters per hashed chunk of a prompt's text (prefix_text): about a KV block's worth of tokens.
TEXT_CHUNK_CHARS = 64
# Most text chunks prefix_text remembers per replica (the oldest go first).
MAX_REMEMBERED_CHUNKS = 100_000
# Requests by which the replica holding a prompt's prefix (or its adapter) may be busier than the
# least-loaded one and still get the prompt.
DEFAULT_LOAD_MARGIN = 8.0
# Seconds an adapter routed to a replica counts as held there: until Serve's multiplexing reports it
# (pushed every 0.1 s, then broadcast to the routers).
ADAPTER_ROUTE_MEMORY_S = 10.0


def routing_stats(summary: bytes, stats: Mapping[str, Any], adapters: Sequence[str] = ()) -> dict[str, Any]:
    """What a replica reports to the routers: its prefix cache's block hashes
    (`BlockPool.cached_hash_summary`), its load (the scheduler's counters), and the LoRA adapters
    its engine holds."""
    return {
        "cached_blocks": summary,
        "running": stats.get("num_running_reqs", 0),
        "waiting": stats.get("num_waiting_reqs", 0),
        "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
        "adapters": list(adapters),
    }


def routed_prompt(pending_request: PendingRequest | None) -> Mapping[str, Any] | None:
    """The prompt of a call to LLMServer.generate (its first argument), None for any other call."""
    if pending_request is None or not pending_request.args:
        return None
    prompt = pending_request.args[0]
    return prompt if isinstance(prompt, Mapping) else None


def routed_adapter(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter a request runs with (its multiplexed model id), None for the base model."""
    if pending_request is None:
        return None
    return pending_request.metadata.multiplexed_model_id or None


def with_adapter_salt(prompt: Mapping[str, Any], adapter: str | None) -> Mapping[str, Any]:
    """The prompt as the router keys it: an adapter's blocks are salted with its name, beside the
    request's cache salt, so that they never match the base model's (nor another adapter's)."""
    if adapter is None:
        return prompt
    return {**prompt, "cache_salt": f"{prompt.get('cache_salt') or ''}\0lora:{adapter}"}


def affine_replicas(
    holding: Collection[ReplicaID], loads: Mapping[ReplicaID, float], margin: float
) -> list[ReplicaID]:
    """Those of the replicas `holding` a request's adapter whose load is within `margin` of the
    lowest of all `loads`: where the request may go without loading its adapter again (none: every
    holder is too busy, and the adapter is loaded elsewhere)."""
    lowest = min(loads.values())
    return [replica for replica in holding if loads[replica] - lowest <= margin]


def prefix_hits(keys: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of the chained `keys` (a prompt's blocks, in order) `held` has, from the first on."""
    for index, key in enumerate(keys):
        if key not in held:
            return index
    return len(keys)


def choose_by_prefix(
    hits: Mapping[ReplicaID, int],
    loads: Mapping[ReplicaID, float],
    margin: float,
    occupancy: Mapping[ReplicaID, int] | None = None,
) -> ReplicaID:
    """The replica with the longest prefix hit, unless its load exceeds the least loaded one's by
    more than `margin`; otherwise (nothing hits, or the best is too busy) the least loaded, where
    every replica within `margin` of the lowest load counts as least loaded and the one whose cache
    holds least (`occupancy`) among them wins, so that new prefixes spread over the caches rather
    than follow a request that has only just finished. Remaining ties are broken at random."""
    replicas = list(hits)
    random.shuffle(replicas)
    lowest = min(loads[replica] for replica in replicas)
    best = max(replicas, key=lambda replica: (hits[replica], -loads[replica]))
    if hits[best] > 0 and loads[best] - lowest <= margin:
        return best
    idle_enough = [replica for replica in replicas if loads[replica] - lowest <= margin]
    return min(idle_enough, key=lambda replica: ((occupancy or {}).get(replica, 0), loads[replica]))


class _RecentKeys:
    """Keys routed to one replica, each kept for `memory_s` seconds (0: for ever, up to a cap)."""

    def __init__(self, memory_s: float) -> None:
        self._memory_s = memory_s
        self._routed_at: dict[bytes, float] = {}

    def add(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        for key in keys:
            self._routed_at.pop(key, None)  # re-inserted: the dict's order is the routing order
            self._routed_at[key] = now
        while len(self._routed_at) > MAX_REMEMBERED_CHUNKS:
            del self._routed_at[next(iter(self._routed_at))]

    def __len__(self) -> int:
        return len(self._routed_at)

    def __contains__(self, key: object) -> bool:
        routed_at = self._routed_at.get(key)  # type: ignore[call-overload]
        return routed_at is not None and (not self._memory_s or time.monotonic() - routed_at < self._memory_s)


class _HeldBy:
    """A replica's reported cache plus what was routed to it since: the keys it is taken to hold."""

    def __init__(self, reported: Container[bytes], routed: _RecentKeys) -> None:
        self._reported, self._routed = reported, routed

    def __contains__(self, key: object) -> bool:
        return key in self._reported or key in self._routed


class PrefixAffinityRouter(RequestRouter):
    """Routes a request to the replica holding the longest prefix of its prompt (see the module's
    docstring); subclasses say how a prompt becomes chained keys and what a replica holds.

    Not FIFO (Serve's FIFOMixin): a replica chosen for one prompt must serve that prompt, not the
    oldest request waiting. A replica's load is the requests this router has in flight on it (Serve
    tells it of every send and completion); its queue-length cache only refreshes on probes."""

    # Seconds a routed prompt's keys count as held by its replica; 0: for ever.
    routed_memory_s = 0.0

    def initialize_state(self, load_margin: float = DEFAULT_LOAD_MARGIN, block_size: int = 16) -> None:
        """Serve passes the deployment's request_router_kwargs: the load margin, and the replicas'
        KV block size (their engines' config)."""
        self._load_margin = load_margin
        self._block_size = block_size
        self._routed: dict[ReplicaID, _RecentKeys] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        # When this router last sent each adapter to each replica.
        self._adapter_routes: dict[ReplicaID, dict[str, float]] = {}

    @abstractmethod
    def prompt_keys(self, prompt: Mapping[str, Any]) -> list[bytes]:
        """The prompt as chained keys: equal keys at index i mean equal prompts up to chunk i."""

    def reported(self, replica: RunningReplica) -> Collection[bytes]:
        """What the replica itself says it holds (nothing, unless it reports)."""
        return ()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=self._load)
        prompt, adapter = routed_prompt(pending_request), routed_adapter(pending_request)
        if len(candidate_replicas) == 1 or (prompt is None and adapter is None):
            return [by_load]
        loads = {replica.replica_id: self._load(replica) for replica in candidate_replicas}
        eligible = candidate_replicas
        # Prefix routing spreads new prefixes over the emptiest caches; a new adapter goes to the
        # replica holding fewest adapters instead.
        occupancy = {
            replica.replica_id: len(self.reported(replica)) + len(self._recent(replica.replica_id))
            for replica in candidate_replicas
        }
        if adapter is not None:
            adapters = {replica.replica_id: self._adapters_of(replica) for replica in candidate_replicas}
            holding = [replica_id for replica_id, held in adapters.items() if adapter in held]
            affine = set(affine_replicas(holding, loads, self._load_margin))
            if affine:
                eligible = [replica for replica in candidate_replicas if replica.replica_id in affine]
            else:
                occupancy = {replica_id: len(held) for replica_id, held in adapters.items()}
        keys = self.prompt_keys(with_adapter_salt(prompt, adapter)) if prompt is not None else []
        hits = {
            replica.replica_id: prefix_hits(
                keys, _HeldBy(self.reported(replica), self._recent(replica.replica_id))
            )
            for replica in eligible
        }
        chosen = choose_by_prefix(
            hits, {replica_id: loads[replica_id] for replica_id in hits}, self._load_margin, occupancy
        )
        # Its blocks will be there once prefilled, before the replica's next report says so. (Serve's
        # on_request_routed hook only fires with strict max_ongoing_requests.)
        self._recent(chosen).add(keys)
        if adapter is not None:
            self._adapter_routes.setdefault(chosen, {})[adapter] = time.monotonic()
        # The chosen replica first; should it be full, Serve tries the others, least loaded first.
        return [[self._replicas[chosen]], [r for r in by_load if r.replica_id != chosen]]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id for replica in replicas}
        for state in (self._routed, self._in_flight, self._adapter_routes):
            for replica_id in set(state) - current:
                del state[replica_id]

    def _recent(self, replica_id: ReplicaID) -> _RecentKeys:
        if replica_id not in self._routed:
            self._routed[replica_id] = _RecentKeys(self.routed_memory_s)
        return self._routed[replica_id]

    def _adapters_of(self, replica: RunningReplica) -> set[str]:
        """The adapters the replica holds: those Serve's multiplexing reports (loaded or loading),
        those its engine reported in its routing stats, and those sent to it lately that no report
        shows yet. Once a report shows one, the reports alone say whether it is still there (an
        evicted adapter must not draw requests back)."""
        now = time.monotonic()
        reported = set(replica.multiplexed_model_ids) | set((replica.routing_stats or {}).get("adapters", ()))
        routes = self._adapter_routes.get(replica.replica_id, {})
        for adapter in [
            name for name, at in routes.items() if name in reported or now - at >= ADAPTER_ROUTE_MEMORY_S
        ]:
            del routes[adapter]
        return reported | set(routes)

    def _load(self, replica: RunningReplica) -> float:
        """Requests on the replica: those in flight from here, plus those it last reported waiting
        (queued for want of KV blocks or batch slots, which requests from other ingress replicas
        cause too). Its reported running count is not added: up to a report period old, it would
        make a replica that has just finished a request look busy."""
        waiting = (replica.routing_stats or {}).get("waiting", 0)
        return self._in_flight.get(replica.replica_id, 0) + waiting


class KVAwareRouter(PrefixAffinityRouter):
    """kv_aware: the replicas' reported prefix caches, matched by the engine's own chained block hashes."""

    # Long enough for a routed prompt to be prefilled and reported back (stats every second or so).
    routed_memory_s = 10.0

    def initialize_state(self, load_margin: float = DEFAULT_LOAD_MARGIN, block_size: int = 16) -> None:
        super().initialize_state(load_margin, block_size)
        # The last report decoded, per replica: (the report's bytes, their set of hashes).
        self._decoded: dict[ReplicaID, tuple[bytes, frozenset[bytes]]] = {}

    def prompt_keys(self, prompt: Mapping[str, Any]) -> list[bytes]:
        token_ids = prompt.get("prompt_token_ids") or ()
        hashes = chain_block_hashes(token_ids, self._block_size, cache_salt=prompt.get("cache_salt"))
        return [block_hash[:SUMMARY_HASH_BYTES] for block_hash in hashes]

    def reported(self, replica: RunningReplica) -> Collection[bytes]:
        summary = (replica.routing_stats or {}).get("cached_blocks", b"")
        decoded = self._decoded.get(replica.replica_id)
        if decoded is None or decoded[0] is not summary:
            step = SUMMARY_HASH_BYTES
            decoded = (summary, frozenset(summary[i : i + step] for i in range(0, len(summary), step)))
            self._decoded[replica.replica_id] = decoded
        return decoded[1]


class PrefixTextRouter(PrefixAffinityRouter):
    """prefix_text: the text each replica has been sent, in chained chunks (Ray Serve LLM's idea)."""

    def prompt_keys(self, prompt: Mapping[str, Any]) -> list[bytes]:
        text = prompt.get("prompt")
        if not text:  # token ids only: their decimal text stands in
            text = " ".join(map(str, prompt.get("prompt_token_ids") or ()))
        salt = prompt.get("cache_salt")
        # The salt, hashed, stands in for the first chunk's parent: every key chains it.
        parent = hash_block_tokens(None, (), salt.encode()) if salt else None
        keys: list[bytes] = []
        for start in range(0, len(text) - TEXT_CHUNK_CHARS + 1, TEXT_CHUNK_CHARS):
            chunk = text[start : start + TEXT_CHUNK_CHARS].encode()
            keys.append(hash_block_tokens(keys[-1] if keys else parent, (), chunk))
        return keys


ROUTER_CLASSES = {KV_AWARE: KVAwareRouter, PREFIX_TEXT: PrefixTextRouter}
