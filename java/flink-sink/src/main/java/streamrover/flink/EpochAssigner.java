package streamrover.flink;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.api.common.functions.RichMapFunction;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.connector.sink2.CommittableMessage;
import org.apache.flink.streaming.api.connector.sink2.CommittableWithLineage;

/**
 * The pre-commit step, chained to the writer: gives a writer's result its checkpoint id (the commit key's
 * epoch) and moves its files from the in-progress folder into {@code <producer>/<part>/<checkpoint id>/}, where
 * the master's garbage collection finds them if that checkpoint never commits. It runs before the
 * checkpoint's barrier, so the committer's state holds the final URIs.
 *
 * <p><b>The previous epoch.</b> Each committable also carries the epoch of its (producer, part)'s committable
 * before it ({@link Staged#previousEpoch}), sent as {@code previous_epoch} with its commit: the master shows a
 * gap while that commit has not arrived and fails the dataset once it is missing too long (a checkpoint id
 * of a subtask that was skipped is loud). A checkpoint in which the writer staged nothing has no committable,
 * so the previous epoch is not the checkpoint id - 1: this operator remembers, per (producer, part), the last
 * epoch it assigned, in operator state (union list state of (producer, part, epoch)), so that it survives
 * restarts. It runs at the writer's parallelism on a forward edge, so subtask i sees part i only.
 * <ul>
 *   <li>A job's first checkpoint (no state): -1, unknown; the master opens no gap for it.</li>
 *   <li>A failover restored from checkpoint K: the state of K holds the last epoch &lt;= K of each part, the
 *       one before the restored job's first committable (the failed attempt's epochs after K were never
 *       committed: {@link StagingWriter} deletes them). So the chain goes on without a false gap.</li>
 *   <li>A rescale (same job id): subtask i keeps part i's entry when part i existed before (the chain of part
 *       i goes on: its earlier committables are in the restored committer state, so they commit); a part that
 *       is new, or a part that went away and came back, starts at -1. Entries of parts that no longer run
 *       are dropped.</li>
 *   <li>A job restored by hand from a retained checkpoint or savepoint runs under a new job id, a new
 *       producer: the old job's entries are dropped, its first committable has -1.</li>
 *   <li>A checkpoint written by a jar from before this state existed: no entries, -1.</li>
 * </ul>
 */
final class EpochAssigner extends RichMapFunction<CommittableMessage<Staged>, CommittableMessage<Staged>>
        implements CheckpointedFunction {
    private static final long serialVersionUID = 1L;
    private final Staging staging;
    /** "producer/part" -> {last epoch assigned, the epoch before it} */
    private transient Map<String, long[]> last;
    private transient ListState<Tuple3<String, String, Long>> state;

    EpochAssigner(Staging staging) {
        this.staging = staging;
    }

    @Override
    public void initializeState(FunctionInitializationContext context) throws Exception {
        state = context.getOperatorStateStore().getUnionListState(
                new ListStateDescriptor<>("streamrover-last-epochs", Types.TUPLE(Types.STRING, Types.STRING, Types.LONG)));
        last = new HashMap<>();
        if (!context.isRestored()) return;
        String job = getRuntimeContext().getJobInfo().getJobId().toHexString();
        String mine = Integer.toString(getRuntimeContext().getTaskInfo().getIndexOfThisSubtask());
        for (Tuple3<String, String, Long> e : state.get()) {
            if (!e.f0.equals(job) || !e.f1.equals(mine)) continue; // another job's, or another subtask's part
            long[] known = last.get(e.f0 + "/" + e.f1);
            if (known == null || known[0] < e.f2) last.put(e.f0 + "/" + e.f1, new long[] {e.f2, -1});
        }
    }

    @Override
    public void snapshotState(FunctionSnapshotContext context) throws Exception {
        List<Tuple3<String, String, Long>> entries = new ArrayList<>(last.size());
        for (Map.Entry<String, long[]> e : last.entrySet()) {
            int slash = e.getKey().lastIndexOf('/'); // producer and part have no '/' (the master checks)
            entries.add(Tuple3.of(e.getKey().substring(0, slash), e.getKey().substring(slash + 1), e.getValue()[0]));
        }
        state.update(entries);
    }

    /** The epoch before {@code epoch} of (producer, part), remembering {@code epoch} as its last one. */
    private long previous(String producer, String part, long epoch) {
        long[] known = last.get(producer + "/" + part);
        if (known == null) {
            last.put(producer + "/" + part, new long[] {epoch, -1});
            return -1;
        }
        if (epoch == known[0]) return known[1]; // a second committable of the same checkpoint
        long before = epoch > known[0] ? known[0] : -1; // never a later epoch as the previous one
        if (epoch > known[0]) {
            known[1] = known[0];
            known[0] = epoch;
        }
        return before;
    }

    @Override
    public CommittableMessage<Staged> map(CommittableMessage<Staged> message) throws IOException {
        if (!(message instanceof CommittableWithLineage)) {
            return message; // a summary: counts only
        }
        CommittableWithLineage<Staged> c = (CommittableWithLineage<Staged>) message;
        Staged s = c.getCommittable();
        String epoch = Long.toString(c.getCheckpointId());
        Path from = staging.local(s.producer, s.part, "_inprogress");
        Path to = staging.local(s.producer, s.part, epoch);
        Files.createDirectories(to);
        List<Staged.File> moved = new ArrayList<>(s.files.size());
        for (Staged.File f : s.files) {
            Files.move(from.resolve(f.uri), to.resolve(f.uri), StandardCopyOption.ATOMIC_MOVE);
            moved.add(new Staged.File(staging.uri(s.producer, s.part, epoch, f.uri), f.records));
        }
        long previous = previous(s.producer, s.part, c.getCheckpointId());
        Staged committable = new Staged(s.producer, s.part, c.getCheckpointId(), moved, previous);
        return c.map(ignored -> committable);
    }
}
