package streamrover.flink;

import java.io.IOException;
import java.nio.file.Path;
import java.util.HashMap;

import org.apache.flink.types.Row;
import org.apache.hadoop.conf.Configuration;
import org.apache.parquet.conf.ParquetConfiguration;
import org.apache.parquet.hadoop.ParquetFileWriter;
import org.apache.parquet.hadoop.ParquetWriter;
import org.apache.parquet.hadoop.api.WriteSupport;
import org.apache.parquet.hadoop.metadata.CompressionCodecName;
import org.apache.parquet.io.LocalOutputFile;
import org.apache.parquet.io.api.RecordConsumer;

/**
 * One Parquet file of rows being written: open, {@link #write} rows, {@link #close} (then it is complete).
 *
 * <p>Every file is written with one Hadoop {@link Configuration} of this JVM, made without Hadoop's default
 * resources: parquet-java otherwise makes a new default one per writer, and its first read parses Hadoop's
 * core-default.xml; a sink opens a file per subtask per checkpoint, and that parsing was ~13% of the task
 * thread's time (a JFR profile of the bench). Dictionary encoding is on for STRING and BYTES columns only:
 * numeric features rarely repeat, and a dictionary that outgrows its page is thrown away and the page
 * written again plain (~6% of the task thread's time in that profile).
 */
final class ParquetRows implements AutoCloseable {
    private static final Configuration HADOOP = new Configuration(false);
    private final ParquetWriter<Row> writer;
    private long records;

    ParquetRows(Path path, RowSchema schema) throws IOException {
        Builder builder = new Builder(path, schema)
                .withConf(HADOOP)
                .withWriteMode(ParquetFileWriter.Mode.CREATE)
                .withCompressionCodec(CompressionCodecName.SNAPPY)
                .withDictionaryEncoding(false);
        for (String column : schema.dictionaryColumns()) {
            builder = builder.withDictionaryEncoding(column, true);
        }
        this.writer = builder.build();
    }

    void write(Row row) throws IOException {
        writer.write(row);
        records++;
    }

    long records() {
        return records;
    }

    @Override
    public void close() throws IOException {
        writer.close();
    }

    private static final class Builder extends ParquetWriter.Builder<Row, Builder> {
        private final RowSchema schema;

        Builder(Path path, RowSchema schema) {
            super(new LocalOutputFile(path));
            this.schema = schema;
        }

        @Override
        protected Builder self() {
            return this;
        }

        @Override
        protected WriteSupport<Row> getWriteSupport(Configuration conf) {
            return new RowWriteSupport(schema);
        }

        @Override
        protected WriteSupport<Row> getWriteSupport(ParquetConfiguration conf) {
            return new RowWriteSupport(schema);
        }
    }

    private static final class RowWriteSupport extends WriteSupport<Row> {
        private final RowSchema schema;
        private RecordConsumer out;

        RowWriteSupport(RowSchema schema) {
            this.schema = schema;
        }

        @Override
        public WriteContext init(Configuration configuration) {
            return new WriteContext(schema.parquet(), new HashMap<>());
        }

        @Override
        public WriteContext init(ParquetConfiguration configuration) {
            return new WriteContext(schema.parquet(), new HashMap<>());
        }

        @Override
        public void prepareForWrite(RecordConsumer recordConsumer) {
            this.out = recordConsumer;
        }

        @Override
        public void write(Row row) {
            schema.write(row, out);
        }
    }
}
