package streamrover.flink;

import java.io.Serializable;
import java.net.URI;
import java.nio.file.Path;
import java.nio.file.Paths;

/**
 * The staging folder the sink writes its Parquet files to: a local path or a {@code file://} URL (every
 * trainer must be able to read it, e.g. a shared mount), laid out as the master expects:
 * {@code <staging>/<producer>/<part>/<epoch>/<file>.parquet}.
 */
final class Staging implements Serializable {
    private static final long serialVersionUID = 1L;
    private final String uri;
    private final String root;

    Staging(String uri) {
        String u = uri.endsWith("/") && uri.length() > 1 ? uri.substring(0, uri.length() - 1) : uri;
        String path;
        if (u.startsWith("file://")) {
            path = URI.create(u).getPath();
        } else if (u.startsWith("/")) {
            path = u;
        } else {
            throw new IllegalArgumentException("streamrover TrainingSink: staging_dir must be an absolute local path or a "
                    + "file:// URL that every trainer can read, not '" + uri + "'");
        }
        this.uri = u;
        this.root = path;
    }

    /** The folder {@code <staging>/<producer>/<part>/<leaf>} on this machine. */
    Path local(String producer, String part, String leaf) {
        return Paths.get(root, producer, part, leaf);
    }

    /** The URI of a file in that folder, in the form the staging folder was given. */
    String uri(String producer, String part, String leaf, String file) {
        return uri + "/" + producer + "/" + part + "/" + leaf + "/" + file;
    }

    /** The staging folder as given (the dataset's {@code sr.staging_dir}). */
    String uri() {
        return uri;
    }
}
