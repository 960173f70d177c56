package streamrover.flink;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.List;

import org.apache.flink.api.common.functions.MapFunction;
import org.apache.flink.streaming.api.connector.sink2.CommittableMessage;
import org.apache.flink.streaming.api.connector.sink2.CommittableWithLineage;

/**
 * The pre-commit step, chained to the writer: gives a writer's result its checkpoint id (the commit key's
 * epoch) and moves its files from the in-progress folder into {@code <producer>/<part>/<checkpoint id>/}, where
 * the master's garbage collection finds them if that checkpoint never commits. It runs before the
 * checkpoint's barrier, so the committer's state holds the final URIs.
 */
final class EpochAssigner implements MapFunction<CommittableMessage<Staged>, CommittableMessage<Staged>> {
    private static final long serialVersionUID = 1L;
    private final Staging staging;

    EpochAssigner(Staging staging) {
        this.staging = staging;
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
        Staged committable = new Staged(s.producer, s.part, c.getCheckpointId(), moved);
        return c.map(ignored -> committable);
    }
}
