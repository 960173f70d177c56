package streamrover.flink;

import java.io.IOException;
import java.net.URISyntaxException;
import java.util.ArrayList;
import java.util.List;

import org.apache.flink.api.connector.sink2.CommitterInitContext;
import org.apache.flink.api.connector.sink2.Sink;
import org.apache.flink.api.connector.sink2.SinkWriter;
import org.apache.flink.api.connector.sink2.SupportsCommitter;
import org.apache.flink.api.connector.sink2.WriterInitContext;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.PipelineOptions;
import org.apache.flink.core.io.SimpleVersionedSerializer;
import org.apache.flink.streaming.api.connector.sink2.CommittableMessage;
import org.apache.flink.streaming.api.connector.sink2.CommittableMessageTypeInfo;
import org.apache.flink.streaming.api.connector.sink2.SupportsPreCommitTopology;
import org.apache.flink.streaming.api.connector.sink2.SupportsPreWriteTopology;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.types.Row;

/**
 * Training as the downstream node of a Flink job: rows become committed shards of a streamrover staged
 * dataset, exactly once with the job's checkpoints (two-phase: staged as Parquet at the checkpoint, committed
 * through the master's CommitStaged RPC when it completes, keyed by job id, subtask and checkpoint id).
 *
 * <p>The rows' schema is the stream's declared row type, read when the sink is added to the job. Without
 * checkpointing nothing is ever committed (a Flink committer runs at checkpoints only).
 */
public final class TrainingSink
        implements Sink<Row>, SupportsCommitter<Staged>, SupportsPreCommitTopology<Staged, Staged>,
        SupportsPreWriteTopology<Row> {
    private static final long serialVersionUID = 1L;
    private final String master;
    private final String dataset;
    private final String token;
    private final Staging staging;
    private final long rowsPerFile;
    private final long retrySeconds;
    private RowSchema schema;

    /**
     * @param master the job master's address (host:port)
     * @param dataset a staged dataset registered on it (uri {@code staged://<name>}, format parquet)
     * @param token the job token
     * @param stagingDir where the Parquet files are staged: an absolute path or file:// URL every trainer reads
     * @param rowsPerFile rows per staged file at most (a checkpoint closes the open file whatever its size)
     * @param retrySeconds how long a commit retries a transient failure ({@link Retry}) before handing it back to
     *     Flink, which calls the committer again (up to {@code sink.committer.retries}), then fails the job
     */
    public TrainingSink(String master, String dataset, String token, String stagingDir, long rowsPerFile,
                        long retrySeconds) {
        if (master == null || master.isEmpty() || dataset == null || dataset.isEmpty()) {
            throw new IllegalArgumentException("streamrover TrainingSink needs a master address and a dataset name");
        }
        if (rowsPerFile <= 0) {
            throw new IllegalArgumentException("streamrover TrainingSink: rows_per_file must be > 0, not " + rowsPerFile);
        }
        this.master = master;
        this.dataset = dataset;
        this.token = token == null ? "" : token;
        this.staging = new Staging(stagingDir);
        this.rowsPerFile = rowsPerFile;
        this.retrySeconds = retrySeconds;
    }

    @Override
    public DataStream<Row> addPreWriteTopology(DataStream<Row> input) {
        schema = RowSchema.of(input.getType());
        shipThisJar(input.getExecutionEnvironment());
        return input;
    }

    /** Adds this jar to the job's jars (pipeline.jars), so a PyFlink job needs no add_jars call for the sink. */
    private static void shipThisJar(StreamExecutionEnvironment env) {
        String self;
        try {
            self = TrainingSink.class.getProtectionDomain().getCodeSource().getLocation().toURI().toString();
        } catch (URISyntaxException | NullPointerException e) {
            return;
        }
        if (!self.endsWith(".jar")) return;
        List<String> jars = new ArrayList<>(env.getConfiguration().getOptional(PipelineOptions.JARS).orElse(List.of()));
        if (jars.contains(self)) return;
        jars.add(self);
        Configuration conf = new Configuration();
        conf.set(PipelineOptions.JARS, jars);
        env.configure(conf);
    }

    @Override
    public SinkWriter<Row> createWriter(WriterInitContext context) throws IOException {
        if (schema == null) {
            throw new IllegalStateException("streamrover TrainingSink: no schema (the sink was not added with sinkTo)");
        }
        String producer = context.getJobInfo().getJobId().toHexString();
        String part = Integer.toString(context.getTaskInfo().getIndexOfThisSubtask());
        return new StagingWriter(schema, staging, producer, part, context.getTaskInfo().getAttemptNumber(), rowsPerFile,
                context.getRestoredCheckpointId());
    }

    @Override
    public StagedCommitter createCommitter(CommitterInitContext context) {
        return new StagedCommitter(master, dataset, token, retrySeconds);
    }

    @Override
    public SimpleVersionedSerializer<Staged> getCommittableSerializer() {
        return new Staged.Serializer();
    }

    @Override
    public SimpleVersionedSerializer<Staged> getWriteResultSerializer() {
        return new Staged.Serializer();
    }

    /**
     * The epoch map and the committer run in a chain of their own, not in the writer's task: the commit RPC
     * (at each completed checkpoint) then never stalls the thread that reads, maps and writes the records, and
     * a completed checkpoint's notification never waits in that thread's mailbox behind the records (a Python
     * operator's bundle, say). The committables cross one local channel, ahead of the checkpoint's barrier.
     */
    @Override
    public DataStream<CommittableMessage<Staged>> addPreCommitTopology(DataStream<CommittableMessage<Staged>> written) {
        return written.map(new EpochAssigner(staging))
                .returns(CommittableMessageTypeInfo.of(Staged.Serializer::new))
                .setParallelism(written.getParallelism())
                .name("streamrover: stage checkpoint")
                .startNewChain();
    }
}
