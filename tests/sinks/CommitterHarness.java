import java.util.ArrayList;
import java.util.List;

import org.apache.flink.api.connector.sink2.Committer;
import streamrover.flink.Staged;
import streamrover.flink.TrainingSink;

/**
 * The sink's committer outside Flink, for tests/sinks/test_flink_committer.py: run as a single source file
 * ({@code java -cp <sink jar>:<flink-dist jar>:... CommitterHarness.java ...}). Commits one committable per
 * {@code producer part epoch uri records} group of arguments, as Flink's committer operator would (its
 * retries included: {@code retryLater} calls {@code commit} again, up to 10 times, and then fails), and
 * prints one line per committable: {@code outcome <producer>/<part>/<epoch> <committed|already|failed|retry>}.
 * A commit that throws (the job would fail) prints {@code threw <message>} and exits 3.
 *
 * <p>Arguments: master token dataset staging_dir retry_seconds (producer part epoch uri records)...; an epoch
 * written {@code E:P} is epoch E whose previous epoch is P (as {@code EpochAssigner} sets it), else -1 (unknown).
 */
public final class CommitterHarness {
    static final class Request implements Committer.CommitRequest<Staged> {
        final Staged committable;
        String state = "committed";
        int retries;

        Request(Staged committable) {
            this.committable = committable;
        }

        @Override public Staged getCommittable() { return committable; }
        @Override public int getNumberOfRetries() { return retries; }
        @Override public void signalFailedWithKnownReason(Throwable t) { state = "failed"; }
        @Override public void signalFailedWithUnknownReason(Throwable t) { state = "failed"; }
        @Override public void retryLater() { state = "retry"; }
        @Override public void updateAndRetryLater(Staged committable) { state = "retry"; }
        @Override public void signalAlreadyCommitted() { state = "already"; }
    }

    public static void main(String[] args) throws Exception {
        TrainingSink sink = new TrainingSink(args[0], args[2], args[1], args[3], 1000, Long.parseLong(args[4]));
        List<Request> requests = new ArrayList<>();
        for (int i = 5; i + 4 < args.length; i += 5) {
            List<Staged.File> files = List.of(new Staged.File(args[i + 3], Long.parseLong(args[i + 4])));
            String[] epoch = args[i + 2].split(":");
            long previous = epoch.length > 1 ? Long.parseLong(epoch[1]) : -1;
            requests.add(new Request(new Staged(args[i], args[i + 1], Long.parseLong(epoch[0]), files, previous)));
        }
        try (Committer<Staged> committer = sink.createCommitter(null)) {
            for (Request r : requests) {
                for (int attempt = 0; attempt <= 10; attempt++) { // Flink 2.3's CommitterOperator, sink.committer.retries
                    r.state = "committed";
                    r.retries = attempt;
                    committer.commit(List.of(r));
                    if (!r.state.equals("retry")) break;
                }
                Staged s = r.committable;
                System.out.println("outcome " + s.producer + "/" + s.part + "/" + s.epoch + " " + r.state);
                System.out.flush();
            }
        } catch (Exception e) {
            System.out.println("threw " + e);
            System.exit(3);
        }
    }
}
