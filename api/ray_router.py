"""Serve's request router for `cag serve --replicas N`: a question waits for a replica holding its corpus.

Serve's default router (power of two choices with multiplexing) spills a question to another replica
as soon as one round of queue-length probes of the corpus's holders fails: a holder full, or a probe
answered later than 0.1 s (a replica busy decoding on 2 cores misses that now and then). The replica
it spills to then makes the corpus resident: a snapshot read from the store (hundreds of MB for a real
corpus) and a second resident copy, for a question that would have waited milliseconds. It also
learns that a replica holds a corpus only after the replica's report reaches the controller and comes
back to this router, so a second question asked right after the first may go to another replica too.

`CorpusRouter` keeps a question on the holders until it has waited `spill_after_s` (Serve's probes and
backoff run as usual between tries), then offers the replicas holding the fewest corpora, then all. A
corpus just sent to a replica counts as held there until the replica's own report arrives.
"""

from __future__ import annotations

import time

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

PLACED_S = 10.0  # a placement counts until the replica's report (0.1 s push + the controller's long poll) is in


class CorpusRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, spill_after_s: float = 2.0, **_):
        self.spill_after_s = spill_after_s
        self.placed: dict[str, tuple[ReplicaID, float]] = {}  # corpus -> (replica it was sent to, when)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        corpus = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if pending_request is None or not corpus:  # broadcasts and health probes: any replica
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # Serve's backoff between tries, not a busy loop
        now = time.time()
        holders = [r for r in candidate_replicas if corpus in r.multiplexed_model_ids]
        if not holders:
            replica, at = self.placed.get(corpus, (None, 0.0))
            holders = [r for r in candidate_replicas if r.replica_id == replica and now - at < PLACED_S]
        if holders and now - pending_request.created_at < self.spill_after_s:
            return [holders]
        others = [r for r in candidate_replicas if r not in holders]
        fewest = min((len(r.multiplexed_model_ids) for r in others), default=0)
        return [holders, [r for r in others if len(r.multiplexed_model_ids) == fewest], others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        corpus = pending_request.metadata.multiplexed_model_id
        replica = self.curr_replicas.get(replica_id)
        if corpus and replica is not None and corpus not in replica.multiplexed_model_ids:
            self.placed[corpus] = (replica_id, time.time())
