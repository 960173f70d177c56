package streamrover.flink;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.Comparator;
import java.util.List;
import java.util.OptionalLong;
import java.util.UUID;
import java.util.stream.Stream;

import org.apache.flink.api.connector.sink2.CommittingSinkWriter;
import org.apache.flink.types.Row;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Buffers one subtask's rows into Parquet files under
 * {@code <staging>/<producer>/<part>/_inprogress/} and, at each checkpoint ({@link #prepareCommit}), closes
 * them and hands them on; {@link EpochAssigner} then moves them into the checkpoint's folder. Files left in
 * the in-progress folder by an earlier attempt of this subtask were never handed on, so they are deleted.
 *
 * <p><b>What a restored writer deletes.</b> When Flink restores this subtask from checkpoint K
 * ({@code WriterInitContext.getRestoredCheckpointId()}), the epoch folders {@code <producer>/<part>/<e>} with
 * e &gt; K are deleted: no commit can claim them.
 * <ul>
 *   <li>A folder e holds the files of the committable (producer, part, e) only. That committable exists in
 *       Flink's state only from checkpoint e on (EpochAssigner moves the files before e's barrier; the
 *       committer's state of checkpoint e holds it), and is committed only after e completed.</li>
 *   <li>Flink restores from the latest completed checkpoint, K (a failover aborts the pending ones): so no
 *       checkpoint e &gt; K of this job completed. The folders e &gt; K were staged by the failed attempt
 *       after K, no state holds their committables, and no committer will ever commit them. The restored
 *       job's own checkpoints take ids above the failed attempt's (Flink's checkpoint counter only grows), so
 *       it never stages into a folder deleted here.</li>
 *   <li>Only this subtask's own (producer, part) is touched. Producer is the job id. A region failover
 *       restores the region's tasks from K like a full one. A rescaled job (adaptive scheduler, same job
 *       id) gives each new subtask its own index to clean; the folders of indexes that no longer exist
 *       are left to the master's retention. A job restored by hand, from an older retained checkpoint or a
 *       savepoint, runs under a new job id: a new producer, with no folders yet; the old job's folders may
 *       hold commits the old job made after that checkpoint, and are not touched.</li>
 *   <li>This relies on a job id naming one run lineage: a job resubmitted under a fixed job id and
 *       restored from an older checkpoint than its latest would reuse checkpoint ids, i.e. commit keys
 *       (the master would answer those already_committed): don't do that.</li>
 * </ul>
 * A writer that is not restored (a job's first attempt, or a restart before any checkpoint completed)
 * deletes no epoch folder.
 */
final class StagingWriter implements CommittingSinkWriter<Row, Staged> {
    private static final Logger LOG = LoggerFactory.getLogger(StagingWriter.class);
    private final RowSchema schema;
    private final Staging staging;
    private final String producer;
    private final String part;
    private final long rowsPerFile;
    private final Path inProgress;
    private final String prefix;
    private final List<Staged.File> closed = new ArrayList<>();
    private ParquetRows current;
    private Path currentPath;
    private int seq;

    StagingWriter(RowSchema schema, Staging staging, String producer, String part, int attempt, long rowsPerFile,
                  OptionalLong restoredCheckpointId) throws IOException {
        this.schema = schema;
        this.staging = staging;
        this.producer = producer;
        this.part = part;
        this.rowsPerFile = rowsPerFile;
        this.inProgress = staging.local(producer, part, "_inprogress");
        this.prefix = "a" + attempt + "-" + UUID.randomUUID().toString().substring(0, 8);
        Files.createDirectories(inProgress);
        try (Stream<Path> old = Files.list(inProgress)) {
            old.forEach(p -> {
                try {
                    Files.deleteIfExists(p);
                } catch (IOException e) {
                    throw new UncheckedIOException(e);
                }
            });
        }
        if (restoredCheckpointId.isPresent()) {
            try {
                deleteEpochsAfter(restoredCheckpointId.getAsLong());
            } catch (IOException | UncheckedIOException e) { // garbage stays garbage: the master's retention may take it
                LOG.warn("streamrover: {}/{} restored from checkpoint {} could not delete the epoch folders staged after "
                        + "it under {}: {}", producer, part, restoredCheckpointId.getAsLong(), inProgress.getParent(), e);
            }
        }
    }

    /** Deletes this (producer, part)'s epoch folders above the restored checkpoint (see the class's javadoc). */
    private void deleteEpochsAfter(long restored) throws IOException {
        Path base = inProgress.getParent();
        List<Path> garbage = new ArrayList<>();
        try (Stream<Path> epochs = Files.list(base)) {
            epochs.filter(p -> isEpochAfter(p.getFileName().toString(), restored)).forEach(garbage::add);
        }
        long files = 0;
        for (Path epoch : garbage) {
            List<Path> paths;
            try (Stream<Path> walk = Files.walk(epoch)) {
                paths = walk.sorted(Comparator.reverseOrder()).toList();
            } catch (NoSuchFileException e) {
                continue; // gone already
            }
            for (Path p : paths) {
                if (Files.deleteIfExists(p) && !p.equals(epoch)) files++;
            }
        }
        if (!garbage.isEmpty()) {
            LOG.info("streamrover: restored from checkpoint {}: deleted {} epoch folder(s) ({} files) that {}/{} staged "
                    + "after it in a failed attempt: {}", restored, garbage.size(), files, producer, part, garbage);
        }
    }

    private static boolean isEpochAfter(String name, long restored) {
        if (name.isEmpty() || name.length() > 18 || !name.chars().allMatch(Character::isDigit)) return false;
        return Long.parseLong(name) > restored;
    }

    @Override
    public void write(Row row, Context context) throws IOException {
        if (current == null) {
            currentPath = inProgress.resolve(prefix + "-" + (seq++) + ".parquet");
            current = new ParquetRows(currentPath, schema);
        }
        current.write(row);
        if (current.records() >= rowsPerFile) {
            roll();
        }
    }

    private void roll() throws IOException {
        if (current == null) return;
        current.close();
        closed.add(new Staged.File(currentPath.getFileName().toString(), current.records()));
        current = null;
        currentPath = null;
    }

    @Override
    public void flush(boolean endOfInput) {
        // prepareCommit, which follows each flush, closes the open file.
    }

    @Override
    public Collection<Staged> prepareCommit() throws IOException {
        roll();
        if (closed.isEmpty()) {
            return Collections.emptyList();
        }
        // the files' names only: EpochAssigner moves them and names them by their final URIs
        Staged result = new Staged(producer, part, -1, closed);
        closed.clear();
        return Collections.singletonList(result);
    }

    @Override
    public void close() throws IOException {
        if (current != null) {
            current.close();
            Files.deleteIfExists(currentPath);
            current = null;
        }
    }
}
