"""A restart's rendezvous skips torch's random 0-0.3 s "first run" delay, which its first restart paid (round 0)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from streamrover.trainers.torch.rendezvous import no_first_round_skew


def test_the_first_restart_is_still_in_round_0_and_its_skew_is_skipped_later_rounds_have_none() -> None:
    store = dist.HashStore()
    params = RendezvousParameters(backend="c10d", endpoint="", run_id="skew", min_nodes=1, max_nodes=1)
    handler = create_handler(store, C10dRendezvousBackend(store, "skew"), params)
    original = dynamic_rendezvous._delay
    try:
        skipped: list[float] = []
        with no_first_round_skew(skipped):
            handler.next_rendezvous()  # the first join (the agent keeps the skew for it)
            assert skipped == [0.3]
            handler.next_rendezvous()  # the group's first restart: torch would sleep again
            assert skipped == [0.3, 0.3], "the first restart is in round 0 too"
            handler.next_rendezvous()  # later restarts: round >= 1, torch does not sleep
            assert skipped == [0.3, 0.3]
        assert dynamic_rendezvous._delay is original, "torch's own delay is back after the block"
    finally:
        handler.shutdown()
