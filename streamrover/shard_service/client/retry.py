"""The one rule (Python) for retrying calls of the master: which statuses, which calls, for how long.

Every Python client of the master (``AdminClient``/``ShardClient`` and so the torch session, the TF chief,
the checkpoint saver's cut commits, the Spark sink, the CLI and the operator) reaches it through
:class:`~streamrover.shard_service.client.transport.Transport`, which applies this rule; the Java Flink committer
states the same rule in ``java/flink-sink/.../Retry.java``. A change here is a change there.

**Statuses.** A call that fails with a *transient* status is sent again, with jittered exponential backoff
(50 ms doubling to 2 s), until the client's ``timeout`` (120 s by default) has passed since the first try;
then the last error is raised. Transient means the master may not have seen the call, or saw it and its
answer was lost, and will answer it when it is back:

- ``UNAVAILABLE``: no connection, refused, reset; a master stopping after a failed journal write.
- ``UNKNOWN``: the connection died mid-call (gRPC-java's "channel closed"; grpc-core's "Stream removed"), but
  not a handler of the master that raised ("Exception calling application": a bug, which a retry repeats).
- ``INTERNAL``: a frame cut short (``RST_STREAM``) when the master died mid-answer.
- ``ABORTED`` and ``RESOURCE_EXHAUSTED`` (a full server), but not a message over the size limit, which no retry
  makes smaller.
- ``DEADLINE_EXCEEDED`` when the client gave the call no deadline of its own (only the transport's):
  a caller's own deadline is final.

Every other status (``INVALID_ARGUMENT``, ``NOT_FOUND``, ``FAILED_PRECONDITION``, ``ALREADY_EXISTS``,
``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ``CANCELLED``...) is the master's considered answer and is raised
at once as the service's typed error.

**Calls.** Retrying is safe because the master answers a repeat of each call the way it answered the first
(:data:`IDEMPOTENT`). The calls that are not idempotent, and how each is guarded, are in
:data:`GUARDED`: none of them loses or doubles a record when retried.
"""

from __future__ import annotations

import grpc

#: statuses that may mean "the master did not answer", retried by every Python client
TRANSIENT: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
#: the start of the details grpc gives when a handler of the master raised (not transient)
HANDLER_RAISED = ("Exception calling application", "Exception iterating")
#: details of a message over the size limit (RESOURCE_EXHAUSTED, not transient)
TOO_LARGE = ("larger than max",)
FIRST_DELAY = 0.05  # seconds before the first retry
MAX_DELAY = 2.0  # the backoff's cap

#: call -> why a repeat is answered as the first was
IDEMPOTENT: dict[str, str] = {
    "RegisterDataset": "the same spec registers once; a repeat answers created=False",
    "DescribeDataset": "read-only",
    "ListDatasets": "read-only",
    "ResumeDataset": "a repeat answers resumed=False",
    "Join": "a join with the worker's id (a rejoin) answers the same worker",
    "LeaseShards": "keyed by request id: a repeat answers the same grant",
    "Heartbeat": "extends the same leases to the same deadline",
    "Ack": "fenced by lease attempt: a repeat of the same attempt is a no-op",
    "AckBatch": "keyed by request id, each ack fenced by its attempt",
    "CutCommit": "a committed cut answers the committed cursor again",
    "GetCursor": "read-only",
    "Restore": "resets to the same cursor: a repeat revokes and requeues nothing more",
    "Status": "read-only",
    "ReportMetrics": "the newest value of each metric wins",
    "KvGet": "read-only",
    "KvSet": "compare-and-set with a write id (the same in every retry): a repeat of the write that landed is "
    "answered written, not 'the version moved' (a read-modify-write would otherwise apply twice)",
    "KvDeleteRange": "deletes the same keys",
    "CommitStaged": "keyed by (dataset, producer, part, epoch): a repeat answers already_committed",
    "WorkerSession": "its messages are Lease, Ack, AckBatch and Heartbeat above; the stream is reopened and the "
    "message sent again",
}
#: call -> how a retry that is not answered as the first is kept harmless
GUARDED: dict[str, str] = {
    "CutPrepare": "with a step (every trainer's checkpoint) it is idempotent: one cut per step; without one, a "
    "repeat prepares a second cut of the same acks, the caller commits the one it was answered and the other "
    "is discarded once a later cut commits",
    "RemoveDataset": "a repeat after the first removed it is answered NOT_FOUND: the client reports the dataset "
    "removed (AdminClient.remove_dataset)",
    "Stop": "sent once, not retried (AdminClient.stop): a stopped master answers nothing more",
    "Leave": "a repeat after the first is answered NOT_FOUND (the worker is gone, its leases returned): the "
    "client takes that as done (ShardClient.close)",
}


def transient(code: grpc.StatusCode, details: str, *, own_deadline: bool = False) -> bool:
    """Whether a call that failed with ``code`` and ``details`` is retried (see the module's rule).

    ``own_deadline``: the caller gave the call a deadline of its own (then DEADLINE_EXCEEDED is final).
    """
    if code not in TRANSIENT:
        return False
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return not own_deadline
    if code is grpc.StatusCode.UNKNOWN:
        return not details.startswith(HANDLER_RAISED)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return not any(t in details for t in TOO_LARGE)
    return True


def next_delay(delay: float) -> float:
    """The backoff after a retry that waited ``delay`` (doubling up to :data:`MAX_DELAY`)."""
    return min(delay * 2, MAX_DELAY)


__all__ = ["FIRST_DELAY", "GUARDED", "IDEMPOTENT", "MAX_DELAY", "TRANSIENT", "next_delay", "transient"]
