package streamrover.flink;

import java.io.File;
import java.io.IOException;
import java.util.Collection;
import java.util.Optional;
import java.util.concurrent.TimeUnit;

import io.grpc.ChannelCredentials;
import io.grpc.ClientInterceptors;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.TlsChannelCredentials;
import io.grpc.Metadata;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import org.apache.flink.api.connector.sink2.Committer;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;
import streamrover.v1.ShardServiceGrpc;
import streamrover.v1.ShardServiceOuterClass.CommitStagedRequest;
import streamrover.v1.ShardServiceOuterClass.CommitStagedResponse;
import streamrover.v1.ShardServiceOuterClass.StagedFile;

/**
 * Commits each checkpoint's staged files to the job master (CommitStaged), once Flink says the checkpoint
 * is complete. No committable is ever dropped: each ends committed, handed back to Flink, or failing the job.
 *
 * <ul>
 *   <li>Answered: committed, or {@code already_committed} (the key was committed before: a replay after a
 *       restore, or an earlier attempt of this call that landed though its answer was lost), both success.</li>
 *   <li>A transient status ({@link Retry#TRANSIENT}: the master down, killed mid-call, restarting): retried
 *       for {@code retrySeconds} (the call is idempotent by its key), then {@code retryLater()}. In Flink 2.3
 *       the committer operator then calls {@link #commit} again at once, up to {@code sink.committer.retries}
 *       (10) more times, and then throws "Failed to commit N committables after 10 retries", which fails the
 *       job; the restart restores the committable from the checkpoint and commits it again.</li>
 *   <li>A final status (INVALID_ARGUMENT: a staged file missing or not matching, FAILED_PRECONDITION: the
 *       dataset failed, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED...): {@link #commit} throws, which fails
 *       the job (Flink's CommitterOperator lets the exception out of notifyCheckpointComplete); a restart
 *       replays the commit from the checkpoint's state, so the job keeps failing, loudly, until the cause
 *       is fixed. Never {@code signalFailedWithKnownReason}: in Flink 2.3 that only counts the committable in
 *       the {@code failedCommittables} metric and forgets it, with no log line and no failure.</li>
 * </ul>
 */
final class StagedCommitter implements Committer<Staged> {
    private static final Logger LOG = LoggerFactory.getLogger(StagedCommitter.class);
    private static final long ATTEMPT_SECONDS = 30;
    private final String dataset;
    private final ManagedChannel channel;
    private final ShardServiceGrpc.ShardServiceBlockingStub stub;
    private final Retry retry;

    StagedCommitter(String master, String dataset, String token, long retrySeconds) {
        this.dataset = dataset;
        this.channel = channel(master);
        Metadata auth = new Metadata();
        auth.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
        this.stub = ShardServiceGrpc.newBlockingStub(
                ClientInterceptors.intercept(channel, MetadataUtils.newAttachHeadersInterceptor(auth)));
        this.retry = new Retry(LOG, retrySeconds, channel::resetConnectBackoff);
    }

    /**
     * The channel to the master: TLS when {@code STREAMROVER_TLS_CA} is set in the environment (the master's
     * certificate verified by that CA; {@code STREAMROVER_TLS_CERT} and {@code STREAMROVER_TLS_KEY}, a PKCS#8
     * key, for mutual TLS; {@code STREAMROVER_TLS_SERVER_NAME} when the address is not the certificate's
     * name), as every Python client reads them; plaintext otherwise.
     */
    static ManagedChannel channel(String master) {
        String ca = System.getenv("STREAMROVER_TLS_CA");
        if (ca == null || ca.isEmpty()) {
            return Grpc.newChannelBuilder(master, InsecureChannelCredentials.create()).build();
        }
        ChannelCredentials credentials;
        try {
            TlsChannelCredentials.Builder tls = TlsChannelCredentials.newBuilder().trustManager(new File(ca));
            String cert = System.getenv("STREAMROVER_TLS_CERT");
            String key = System.getenv("STREAMROVER_TLS_KEY");
            if (cert != null && !cert.isEmpty() && key != null && !key.isEmpty()) {
                tls.keyManager(new File(cert), new File(key));
            }
            credentials = tls.build();
        } catch (IOException e) {
            throw new IllegalArgumentException("cannot read the TLS files named by STREAMROVER_TLS_CA/_CERT/_KEY ("
                    + ca + "): " + e.getMessage(), e);
        }
        ManagedChannelBuilder<?> builder = Grpc.newChannelBuilder(master, credentials);
        String name = System.getenv("STREAMROVER_TLS_SERVER_NAME");
        if (name != null && !name.isEmpty()) {
            builder.overrideAuthority(name);
        }
        LOG.info("committing to the master at {} over TLS (CA {})", master, ca);
        return builder.build();
    }

    @Override
    public void commit(Collection<CommitRequest<Staged>> requests) throws IOException, InterruptedException {
        for (CommitRequest<Staged> request : requests) {
            Staged s = request.getCommittable();
            CommitStagedRequest.Builder rpc = CommitStagedRequest.newBuilder()
                    .setDataset(dataset).setProducer(s.producer).setPart(s.part).setEpoch(s.epoch);
            if (s.previousEpoch >= 0) { // the master shows a gap while that epoch is not committed (EpochAssigner)
                rpc.setPreviousEpoch(s.previousEpoch);
            }
            for (Staged.File f : s.files) {
                rpc.addFiles(StagedFile.newBuilder().setUri(f.uri).setRecords(f.records));
            }
            commitOne(request, rpc.build(), s);
        }
    }

    private void commitOne(CommitRequest<Staged> request, CommitStagedRequest rpc, Staged s)
            throws IOException, InterruptedException {
        String key = dataset + "/" + s.producer + "/" + s.part + "/" + s.epoch;
        long sent = System.nanoTime();
        Optional<Retry.Outcome<CommitStagedResponse>> outcome;
        try {
            outcome = retry.call("CommitStaged", key,
                    () -> stub.withDeadlineAfter(ATTEMPT_SECONDS, TimeUnit.SECONDS).commitStaged(rpc));
        } catch (StatusRuntimeException e) {
            throw new IOException("streamrover: CommitStaged of " + s + " to dataset '" + dataset + "' failed with "
                    + e.getStatus() + ". Failing the job: its restart commits this checkpoint again. Fix the cause "
                    + "the master names (a staged file gone, the dataset failed or removed, a wrong token)", e);
        }
        if (outcome.isEmpty()) {
            request.retryLater();
            return;
        }
        Retry.Outcome<CommitStagedResponse> o = outcome.get();
        long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - sent);
        if (o.answer.getAlreadyCommitted()) {
            if (o.attempts > 1) {
                LOG.info("streamrover: {} was committed before: an earlier attempt landed though its answer was lost "
                        + "({}; {} attempts, {} ms)", s, o.lastFailure.getCode(), o.attempts, ms);
            } else {
                LOG.info("streamrover: {} was committed before (a replayed commit; {} ms)", s, ms);
            }
            request.signalAlreadyCommitted();
        } else {
            LOG.info("streamrover: committed {} to dataset {} in {} ms ({} attempts)", s, dataset, ms, o.attempts);
        }
    }

    @Override
    public void close() throws InterruptedException {
        channel.shutdownNow();
        channel.awaitTermination(5, TimeUnit.SECONDS);
    }
}
