package streamrover.flink;

import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.OptionalLong;

import org.apache.flink.api.common.typeinfo.Types;

/**
 * The sink's writer outside Flink, for tests/sinks/test_flink_committer.py (compiled with javac beside the
 * sink jar: it is in the sink's package). Opens a StagingWriter for (producer, part) on the staging folder as
 * Flink does after a restore from checkpoint {@code restored} ("none": not restored), closes it, and prints
 * the epoch folders left under {@code <staging>/<producer>/<part>}, one per line.
 *
 * <p>Arguments: staging_dir producer part restored
 */
public final class WriterHarness {
    public static void main(String[] args) throws Exception {
        RowSchema schema = RowSchema.of(Types.ROW_NAMED(new String[] {"id"}, Types.LONG));
        OptionalLong restored = args[3].equals("none") ? OptionalLong.empty() : OptionalLong.of(Long.parseLong(args[3]));
        new StagingWriter(schema, new Staging(args[0]), args[1], args[2], 1, 1000, restored).close();
        Path base = Paths.get(args[0], args[1], args[2]);
        try (var left = Files.list(base)) {
            left.map(p -> p.getFileName().toString()).sorted().forEach(name -> System.out.println("left " + name));
        }
    }
}
