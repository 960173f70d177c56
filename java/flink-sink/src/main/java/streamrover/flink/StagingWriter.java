package streamrover.flink;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.List;
import java.util.UUID;
import java.util.stream.Stream;

import org.apache.flink.api.connector.sink2.CommittingSinkWriter;
import org.apache.flink.types.Row;

/**
 * Buffers one subtask's rows into Parquet files under
 * {@code <staging>/<producer>/<part>/_inprogress/} and, at each checkpoint ({@link #prepareCommit}), closes
 * them and hands them on; {@link EpochAssigner} then moves them into the checkpoint's folder. Files left in
 * the in-progress folder by an earlier attempt of this subtask were never handed on, so they are deleted.
 */
final class StagingWriter implements CommittingSinkWriter<Row, Staged> {
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

    StagingWriter(RowSchema schema, Staging staging, String producer, String part, int attempt, long rowsPerFile)
            throws IOException {
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
