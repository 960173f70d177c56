package streamrover.flink;

import java.io.IOException;
import java.util.Collection;
import java.util.concurrent.TimeUnit;

import io.grpc.ClientInterceptors;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
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
 * is complete. A key the master already holds (a commit replayed after a restore) answers
 * already_committed, which is success. A master that cannot be reached is retried for
 * {@code retrySeconds}, then the commit is retried at the next checkpoint; any other error fails the job
 * with the master's message.
 */
final class StagedCommitter implements Committer<Staged> {
    private static final Logger LOG = LoggerFactory.getLogger(StagedCommitter.class);
    private final String dataset;
    private final long retrySeconds;
    private final ManagedChannel channel;
    private final ShardServiceGrpc.ShardServiceBlockingStub stub;

    StagedCommitter(String master, String dataset, String token, long retrySeconds) {
        this.dataset = dataset;
        this.retrySeconds = retrySeconds;
        this.channel = Grpc.newChannelBuilder(master, InsecureChannelCredentials.create()).build();
        Metadata auth = new Metadata();
        auth.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
        this.stub = ShardServiceGrpc.newBlockingStub(
                ClientInterceptors.intercept(channel, MetadataUtils.newAttachHeadersInterceptor(auth)));
    }

    @Override
    public void commit(Collection<CommitRequest<Staged>> requests) throws IOException, InterruptedException {
        for (CommitRequest<Staged> request : requests) {
            Staged s = request.getCommittable();
            CommitStagedRequest.Builder rpc = CommitStagedRequest.newBuilder()
                    .setDataset(dataset).setProducer(s.producer).setPart(s.part).setEpoch(s.epoch);
            for (Staged.File f : s.files) {
                rpc.addFiles(StagedFile.newBuilder().setUri(f.uri).setRecords(f.records));
            }
            commitOne(request, rpc.build(), s);
        }
    }

    private void commitOne(CommitRequest<Staged> request, CommitStagedRequest rpc, Staged s) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(retrySeconds);
        long backoffMs = 50;
        while (true) {
            try {
                long sent = System.nanoTime();
                CommitStagedResponse response = stub.withDeadlineAfter(30, TimeUnit.SECONDS).commitStaged(rpc);
                long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - sent);
                if (response.getAlreadyCommitted()) {
                    LOG.info("streamrover: {} was committed before (a replayed commit; {} ms)", s, ms);
                    request.signalAlreadyCommitted();
                } else {
                    LOG.info("streamrover: committed {} to dataset {} in {} ms", s, dataset, ms);
                }
                return;
            } catch (StatusRuntimeException e) {
                Status.Code code = e.getStatus().getCode();
                boolean transient_ = code == Status.Code.UNAVAILABLE || code == Status.Code.DEADLINE_EXCEEDED
                        || code == Status.Code.RESOURCE_EXHAUSTED || code == Status.Code.ABORTED;
                if (!transient_) {
                    request.signalFailedWithKnownReason(new IOException(
                            "streamrover: CommitStaged of " + s + " to dataset '" + dataset + "' failed: " + e.getStatus(), e));
                    return;
                }
                if (System.nanoTime() > deadline) {
                    LOG.warn("streamrover: the master did not take {} for {} s ({}); retrying at the next checkpoint",
                            s, retrySeconds, e.getStatus());
                    request.retryLater();
                    return;
                }
                Thread.sleep(backoffMs);
                backoffMs = Math.min(backoffMs * 2, 2000);
            }
        }
    }

    @Override
    public void close() throws InterruptedException {
        channel.shutdownNow();
        channel.awaitTermination(5, TimeUnit.SECONDS);
    }
}
