package streamrover.flink;

import java.util.EnumSet;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.TimeUnit;

import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import org.slf4j.Logger;

/**
 * The Java sink's one retry rule for calls to the job master.
 *
 * <p><b>Which calls.</b> The sink makes one call: {@code CommitStaged}, from {@link StagedCommitter}. It is
 * idempotent by its key (dataset, producer = Flink job id, part = subtask index, epoch = checkpoint id): the
 * master journals the key with the commit, and answers a repeat of a committed key {@code already_committed}
 * without changing anything, so sending it again after any failure is safe. There is no call in the sink
 * that is not idempotent.
 *
 * <p><b>Which statuses.</b> {@link #TRANSIENT}: every status that says the call may not have been served or
 * its answer did not arrive, so that sending it again can succeed:
 * <ul>
 *   <li>UNAVAILABLE: the master is down or restarting (connection refused; a connection reset, which
 *       grpc-java reports as "io exception"; a GOAWAY);</li>
 *   <li>UNKNOWN: grpc-java's "channel closed" when the master dies while the call is in flight (Netty's
 *       ClosedChannelException, the connection's end without an answer);</li>
 *   <li>INTERNAL: a frame cut in half (grpc-java's protocol errors on a truncated stream);</li>
 *   <li>DEADLINE_EXCEEDED: no answer in time (a master stalled or restarting);</li>
 *   <li>RESOURCE_EXHAUSTED, ABORTED: the master shedding load, a conflicting call.</li>
 * </ul>
 * Every other status (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED,
 * ...) is final: the master will answer the same again. The caller must then fail the job, never drop the call.
 *
 * <p><b>For how long.</b> Attempts go on for {@code retrySeconds}, each with its own deadline, with
 * exponential backoff from 50 ms to 2 s; before each new attempt the channel's reconnect backoff is reset so
 * that a restarted master is reached at once. After {@code retrySeconds} {@link #call} returns empty: the
 * committer then asks Flink to retry the commit ({@code retryLater}). Every failed attempt is logged at WARN
 * with its status and key: the first one of a call, then at most one line per {@link #LOG_EVERY_MS}.
 */
final class Retry {
    /** The statuses after which a call is sent again. */
    static final Set<Status.Code> TRANSIENT = EnumSet.of(Status.Code.UNAVAILABLE, Status.Code.UNKNOWN,
            Status.Code.INTERNAL, Status.Code.DEADLINE_EXCEEDED, Status.Code.RESOURCE_EXHAUSTED, Status.Code.ABORTED);
    static final long FIRST_BACKOFF_MS = 50;
    static final long MAX_BACKOFF_MS = 2000;
    static final long LOG_EVERY_MS = 5000;

    /** One attempt of a call. */
    interface Attempt<T> {
        T run() throws StatusRuntimeException;
    }

    /** The outcome of a call: its answer and the number of attempts it took. */
    static final class Outcome<T> {
        final T answer;
        final int attempts;
        final Status lastFailure;

        Outcome(T answer, int attempts, Status lastFailure) {
            this.answer = answer;
            this.attempts = attempts;
            this.lastFailure = lastFailure;
        }
    }

    private final Logger log;
    private final long retrySeconds;
    private final Runnable beforeRetry;

    /**
     * @param log where retries are logged
     * @param retrySeconds how long one {@link #call} goes on
     * @param beforeRetry run before each new attempt (the committer resets its channel's connect backoff)
     */
    Retry(Logger log, long retrySeconds, Runnable beforeRetry) {
        this.log = log;
        this.retrySeconds = retrySeconds;
        this.beforeRetry = beforeRetry;
    }

    static boolean isTransient(Status.Code code) {
        return TRANSIENT.contains(code);
    }

    /**
     * Runs {@code attempt} until it answers, a final status, or {@code retrySeconds}. Returns the answer, or
     * empty when {@code retrySeconds} passed with transient failures only.
     *
     * @param call the call's name ("CommitStaged"), for the log
     * @param key the call's idempotency key, for the log
     * @throws StatusRuntimeException the first final (non-transient) status: the caller fails the job
     */
    <T> Optional<Outcome<T>> call(String call, Object key, Attempt<T> attempt) throws InterruptedException {
        long start = System.nanoTime();
        long deadline = start + TimeUnit.SECONDS.toNanos(retrySeconds);
        long backoffMs = FIRST_BACKOFF_MS;
        long lastLog = 0;
        int attempts = 0;
        int unlogged = 0;
        Status lastFailure = null;
        while (true) {
            attempts++;
            try {
                return Optional.of(new Outcome<>(attempt.run(), attempts, lastFailure));
            } catch (StatusRuntimeException e) {
                Status status = e.getStatus();
                if (!isTransient(status.getCode())) {
                    throw e;
                }
                lastFailure = status;
                long now = System.nanoTime();
                if (now - deadline > 0) {
                    log.warn("streamrover: {} of {} failed with {} ({}) for {} s over {} attempts; giving it back "
                            + "to Flink to retry", call, key, status.getCode(), status.getDescription(),
                            retrySeconds, attempts);
                    return Optional.empty();
                }
                if (lastLog == 0 || now - lastLog >= TimeUnit.MILLISECONDS.toNanos(LOG_EVERY_MS)) {
                    log.warn("streamrover: {} of {} failed with {} ({}), attempt {}{}; retrying (transient, the call "
                            + "is idempotent)", call, key, status.getCode(), status.getDescription(), attempts,
                            unlogged > 0 ? ", " + unlogged + " more failures not logged" : "");
                    lastLog = now;
                    unlogged = 0;
                } else {
                    unlogged++;
                }
                Thread.sleep(backoffMs);
                backoffMs = Math.min(backoffMs * 2, MAX_BACKOFF_MS);
                beforeRetry.run();
            }
        }
    }
}
