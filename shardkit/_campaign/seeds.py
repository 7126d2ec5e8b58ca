"""The seed of each round of a campaign, derived from the campaign's seed.

Each round is an ordinary ``shardkit fuzz`` run from its own seed, so a failure found in
round 7 of worker 2 reruns alone with ``shardkit fuzz … --seed ROUND_SEED``, without the
campaign around it. The derivation hashes the campaign seed with the worker and round
numbers (as ``shardkit._run.runner.chunk_seeds`` derives the seeds of a long run's
chunks): a fixed function, the same on any machine and in any process, and two rounds
of a campaign never share a seed unless SHA-256 collides on 64 bits.
"""

from __future__ import annotations

import hashlib

__all__ = ["round_seed"]


def round_seed(campaign_seed: int, worker: int, round_number: int) -> int:
    """The seed of round ``round_number`` of worker ``worker`` (both counted from 1), in
    ``[0, 2**64)`` as ``shardkit fuzz --seed`` takes it."""
    if worker < 1 or round_number < 1:
        message = f"workers and rounds are counted from 1, got worker {worker} round {round_number}"
        raise ValueError(message)
    derived = hashlib.sha256(f"shardkit-campaign:{campaign_seed}:{worker}:{round_number}".encode()).digest()
    return int.from_bytes(derived[:8], "little")
