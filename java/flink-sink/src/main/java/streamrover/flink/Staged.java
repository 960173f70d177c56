package streamrover.flink;

import java.io.IOException;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

import org.apache.flink.core.io.SimpleVersionedSerializer;
import org.apache.flink.core.memory.DataInputDeserializer;
import org.apache.flink.core.memory.DataOutputSerializer;

/**
 * Files one writer subtask staged for one checkpoint: the writer's result (epoch -1, the files still in
 * the subtask's in-progress folder) and, once {@link EpochAssigner} gave it the checkpoint id, the
 * committable (key: producer = Flink job id, part = subtask index, epoch = checkpoint id), with the epoch of
 * the same (producer, part)'s committable before it ({@code previousEpoch}, -1 when unknown or none: see
 * {@link EpochAssigner}).
 */
public final class Staged implements Serializable {
    private static final long serialVersionUID = 1L;

    /** One staged Parquet file: its URI as workers read it, and its row count. */
    public static final class File implements Serializable {
        private static final long serialVersionUID = 1L;
        public final String uri;
        public final long records;

        public File(String uri, long records) {
            this.uri = uri;
            this.records = records;
        }
    }

    public final String producer;
    public final String part;
    public final long epoch;
    public final List<File> files;
    /** The epoch of this (producer, part)'s committable before this one; -1: unknown, or this is the first. */
    public final long previousEpoch;

    public Staged(String producer, String part, long epoch, List<File> files) {
        this(producer, part, epoch, files, -1);
    }

    public Staged(String producer, String part, long epoch, List<File> files, long previousEpoch) {
        this.producer = producer;
        this.part = part;
        this.epoch = epoch;
        this.files = Collections.unmodifiableList(new ArrayList<>(files));
        this.previousEpoch = previousEpoch;
    }

    /** Records in all files. */
    public long records() {
        long n = 0;
        for (File f : files) n += f.records;
        return n;
    }

    @Override
    public String toString() {
        return "Staged{" + producer + "/" + part + "/" + epoch + ", " + files.size() + " files, " + records() + " records}";
    }

    /** The versioned binary form kept in Flink's checkpoints (no Java serialization in state). */
    public static final class Serializer implements SimpleVersionedSerializer<Staged> {
        @Override
        public int getVersion() {
            return 2; // 2 added previousEpoch; 1 (without it) is still read, as previousEpoch -1
        }

        @Override
        public byte[] serialize(Staged s) throws IOException {
            DataOutputSerializer out = new DataOutputSerializer(256);
            out.writeUTF(s.producer);
            out.writeUTF(s.part);
            out.writeLong(s.epoch);
            out.writeInt(s.files.size());
            for (File f : s.files) {
                out.writeUTF(f.uri);
                out.writeLong(f.records);
            }
            out.writeLong(s.previousEpoch);
            return out.getCopyOfBuffer();
        }

        @Override
        public Staged deserialize(int version, byte[] bytes) throws IOException {
            if (version != 1 && version != 2) {
                throw new IOException("streamrover Staged: unknown serialization version " + version);
            }
            DataInputDeserializer in = new DataInputDeserializer(bytes);
            String producer = in.readUTF();
            String part = in.readUTF();
            long epoch = in.readLong();
            int n = in.readInt();
            List<File> files = new ArrayList<>(n);
            for (int i = 0; i < n; i++) {
                files.add(new File(in.readUTF(), in.readLong()));
            }
            long previous = version >= 2 ? in.readLong() : -1;
            return new Staged(producer, part, epoch, files, previous);
        }
    }
}
