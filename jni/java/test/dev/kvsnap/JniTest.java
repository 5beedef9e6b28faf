package dev.kvsnap;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.List;
import java.util.concurrent.Callable;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.stream.Stream;

/**
 * The Java API against the real library: the catalog flow on each model compared with the
 * tokens the Rust API computed (an expected file written by the {@code expected} example),
 * every error case (exception type and message), and calls from several threads.
 *
 * <pre>
 * java -Dkvsnap.library.path=LIB -cp CLASSES dev.kvsnap.JniTest \
 *     --model NAME BACKEND DIR EXPECTED [--model ...] [--modules MATCHING CAPACITY_DIR CAPACITY OTHER]
 *     [--skip NAME REASON]
 * </pre>
 *
 * The first model is the tiny one: the error and thread tests run on it (open with default
 * module dir and device), and the {@code moduleDir} checks on iree-cpu with the exported module
 * directories of {@code --modules}: one for the tiny model, one for it with context capacity
 * CAPACITY, one for another config. Prints one line per check and closes with
 * {@code jni: N passed, N failed[, N skipped]}; exits 1 on any failure.
 */
public final class JniTest {
    private int passed;
    private int failed;
    private int skipped;
    /** The backend the current model runs on. */
    private String backend = "reference";

    private KvModel open(String dir) {
        return KvModel.open(backend, dir, null, null);
    }

    /** The catalog flow the Rust API ran, read from an expected file. */
    static final class Expected {
        int vocab;
        int[] prefix;
        int prefill;
        int prefillEmbeddings;
        final List<int[]> utterances = new ArrayList<>();
        final List<int[]> outputs = new ArrayList<>();

        static Expected read(Path file) throws IOException {
            Expected e = new Expected();
            for (String line : Files.readAllLines(file, StandardCharsets.UTF_8)) {
                String[] kv = line.split(" ", 2);
                switch (kv[0]) {
                    case "vocab":
                        e.vocab = Integer.parseInt(kv[1].trim());
                        break;
                    case "prefix":
                        e.prefix = ints(kv[1]);
                        break;
                    case "prefill":
                        e.prefill = Integer.parseInt(kv[1].trim());
                        break;
                    case "prefill_embeddings":
                        e.prefillEmbeddings = Integer.parseInt(kv[1].trim());
                        break;
                    case "turn":
                        String[] io = kv[1].split("->");
                        e.utterances.add(ints(io[0]));
                        e.outputs.add(ints(io[1]));
                        break;
                    default:
                        throw new IOException(file + ": unknown record `" + kv[0] + "`");
                }
            }
            if (e.prefix == null || e.utterances.isEmpty()) {
                throw new IOException(file + ": no prefix or no turns");
            }
            return e;
        }

        int steps() {
            return outputs.get(0).length - 1;
        }

        private static int[] ints(String s) {
            return Arrays.stream(s.trim().split("\\s+")).mapToInt(Integer::parseInt).toArray();
        }
    }

    interface Check {
        void run() throws Exception;
    }

    void check(String name, Check body) {
        try {
            body.run();
            passed++;
            System.out.println("ok    " + name);
        } catch (Throwable t) {
            failed++;
            System.out.println("FAIL  " + name + ": " + t);
        }
    }

    void skip(String name, String reason) {
        skipped++;
        System.out.println("skip  " + name + ": " + reason);
    }

    static void assertEq(Object expected, Object got, String what) {
        boolean same = expected instanceof int[] && got instanceof int[]
                ? Arrays.equals((int[]) expected, (int[]) got)
                : expected.equals(got);
        if (!same) {
            throw new AssertionError(what + ": expected " + show(expected) + ", got " + show(got));
        }
    }

    static String show(Object o) {
        return o instanceof int[] ? Arrays.toString((int[]) o) : String.valueOf(o);
    }

    /** Runs {@code body}, which must throw exactly {@code type} with every {@code parts} in its message. */
    static <T extends Throwable> T assertThrows(Class<T> type, Check body, String... parts) {
        try {
            body.run();
        } catch (Throwable t) {
            if (t.getClass() != type) {
                throw new AssertionError("expected " + type.getName() + ", got " + t, t);
            }
            String msg = String.valueOf(t.getMessage());
            for (String part : parts) {
                if (!msg.contains(part)) {
                    throw new AssertionError("message `" + msg + "` lacks `" + part + "`");
                }
            }
            return type.cast(t);
        }
        throw new AssertionError("expected " + type.getName() + ", nothing was thrown");
    }

    /** One turn: extend a copy of {@code catalog} by the utterance, then step greedily. */
    static int[] turn(KvState catalog, int[] utterance, int steps) {
        try (KvState kv = catalog.snapshot()) {
            int[] out = new int[steps + 1];
            out[0] = kv.extend(utterance);
            for (int i = 1; i <= steps; i++) {
                out[i] = kv.step(out[i - 1]);
            }
            return out;
        }
    }

    /** The same turn with its steps in one {@link KvState#decode} call. */
    static int[] decodedTurn(KvState catalog, int[] utterance, int steps) {
        try (KvState kv = catalog.snapshot()) {
            int[] out = new int[steps + 1];
            out[0] = kv.extend(utterance);
            int[] tokens = kv.decode(out[0], steps);
            assertEq(steps, tokens.length, "decoded tokens");
            System.arraycopy(tokens, 0, out, 1, steps);
            assertEq(tokens[steps - 1], kv.nextToken(), "next token after decode");
            assertEq(catalog.len() + utterance.length + steps, kv.len(), "length after decode");
            return out;
        }
    }

    /** The catalog flow and the embeddings variant, compared with the Rust API's tokens. */
    void flowChecks(String name, String dir, Expected e) {
        long start = System.nanoTime();
        try {
            flowChecksTimed(name, dir, e);
        } finally {
            System.out.printf("      (%s: %.1f s)%n", name, (System.nanoTime() - start) / 1e9);
        }
    }

    private void flowChecksTimed(String name, String dir, Expected e) {
        KvModel[] opened = new KvModel[1];
        check(name + ": open", () -> {
            opened[0] = open(dir);
            assertEq(backend, opened[0].backend(), "backend");
            assertEq(e.vocab, opened[0].vocabSize(), "vocab size");
        });
        KvModel m = opened[0];
        if (m == null) {
            return;
        }
        try (m) {
            check(name + ": catalog flow (prefill, snapshot, extend + steps per turn) equals Rust", () -> {
                try (KvState catalog = m.prefill(e.prefix)) {
                    assertEq(e.prefill, catalog.nextToken(), "prefill token");
                    assertEq(e.prefix.length, catalog.len(), "prefix length");
                    for (int t = 0; t < e.utterances.size(); t++) {
                        assertEq(e.outputs.get(t), turn(catalog, e.utterances.get(t), e.steps()), "turn " + t);
                    }
                    assertEq(e.prefix.length, catalog.len(), "catalog length after the turns (snapshots are independent)");
                    assertEq(1, m.liveStates(), "live states after the turns released theirs");
                }
                assertEq(0, m.liveStates(), "live states after release");
            });
            check(name + ": catalog flow with each turn's steps in one decode call equals Rust", () -> {
                try (KvState catalog = m.prefill(e.prefix)) {
                    for (int t = 0; t < e.utterances.size(); t++) {
                        assertEq(e.outputs.get(t), decodedTurn(catalog, e.utterances.get(t), e.steps()), "turn " + t);
                    }
                }
            });
            check(name + ": prefillEmbeddings with host-gathered rows equals Rust", () -> {
                float[] rows = m.embeddingRows(e.prefix);
                assertEq(e.prefix.length * m.hiddenSize(), rows.length, "rows length");
                try (KvState s = m.prefillEmbeddings(e.prefix, rows)) {
                    assertEq(e.prefillEmbeddings, s.nextToken(), "prefill_embeddings token");
                    assertEq(e.outputs.get(0), turn(s, e.utterances.get(0), e.steps()), "turn 0 from the embeddings prefill");
                }
            });
        }
    }

    /** 4 threads on distinct handles give the serial tokens; 4 threads on one handle serialise. */
    void threadChecks(String dir, Expected e) throws Exception {
        try (KvModel m = open(dir); KvState catalog = m.prefill(e.prefix)) {
            check("threads: 4 Java threads on distinct handles give the serial tokens", () -> {
                ExecutorService pool = Executors.newFixedThreadPool(4);
                try {
                    CountDownLatch start = new CountDownLatch(1);
                    List<Future<List<int[]>>> results = new ArrayList<>();
                    for (int w = 0; w < 4; w++) {
                        final int worker = w;
                        Callable<List<int[]>> job = () -> {
                            start.await();
                            List<int[]> outs = new ArrayList<>();
                            for (int rep = 0; rep < 3; rep++) {
                                int t = (worker + rep) % e.utterances.size();
                                outs.add(turn(catalog, e.utterances.get(t), e.steps()));
                            }
                            return outs;
                        };
                        results.add(pool.submit(job));
                    }
                    start.countDown();
                    for (int w = 0; w < 4; w++) {
                        List<int[]> outs = results.get(w).get();
                        for (int rep = 0; rep < 3; rep++) {
                            int t = (w + rep) % e.utterances.size();
                            assertEq(e.outputs.get(t), outs.get(rep), "thread " + w + " turn " + t);
                        }
                    }
                } finally {
                    pool.shutdown();
                }
                assertEq(1, m.liveStates(), "live states after the threads");
            });
            check("threads: 4 Java threads stepping ONE handle are serialised (no lost appends)", () -> {
                try (KvState shared = catalog.snapshot()) {
                    int before = shared.len();
                    List<Thread> threads = new ArrayList<>();
                    List<Throwable> errors = new ArrayList<>();
                    for (int w = 0; w < 4; w++) {
                        Thread th = new Thread(() -> {
                            try {
                                for (int i = 0; i < 5; i++) {
                                    shared.step(1 + i);
                                }
                            } catch (Throwable t) {
                                synchronized (errors) {
                                    errors.add(t);
                                }
                            }
                        });
                        threads.add(th);
                        th.start();
                    }
                    for (Thread th : threads) {
                        th.join();
                    }
                    assertEq(List.of(), errors, "errors");
                    assertEq(before + 20, shared.len(), "length after 20 concurrent steps");
                }
            });
        }
    }

    /** Every documented error: exception type and message. */
    void errorChecks(String dir, Expected e) throws Exception {
        int vocab = e.vocab;
        try (KvModel m = open(dir); KvState s = m.prefill(e.prefix)) {
            int cap = m.contextCapacity();
            check("bad input: empty prefill -> IllegalArgumentException", () ->
                    assertThrows(IllegalArgumentException.class, () -> m.prefill(new int[0]),
                            "prefill: empty input"));
            check("bad input: negative id in prefill -> IllegalArgumentException naming value and index", () ->
                    assertThrows(IllegalArgumentException.class, () -> m.prefill(new int[] {2, 7, -5}),
                            "prefill: token id -5 at input index 2 is out of range (vocab size " + vocab + ")"));
            check("bad input: id == vocab in prefill -> IllegalArgumentException", () ->
                    assertThrows(IllegalArgumentException.class, () -> m.prefill(new int[] {2, vocab}),
                            "token id " + vocab + " at input index 1 is out of range"));
            check("bad input: negative step -> IllegalArgumentException, state unchanged", () -> {
                int len = s.len();
                assertThrows(IllegalArgumentException.class, () -> s.step(-1),
                        "step: token id -1 at input index 0 is out of range");
                assertThrows(IllegalArgumentException.class, () -> s.step(Integer.MIN_VALUE),
                        "token id -2147483648");
                assertEq(len, s.len(), "length");
            });
            check("bad input: step id past the vocab -> IllegalArgumentException", () ->
                    assertThrows(IllegalArgumentException.class, () -> s.step(vocab + 3),
                            "step: token id " + (vocab + 3)));
            check("bad input: decode of no steps, negative steps, a bad id or too many -> IllegalArgumentException, state unchanged", () -> {
                int len = s.len();
                assertThrows(IllegalArgumentException.class, () -> s.decode(3, 0), "decode: empty input");
                assertThrows(IllegalArgumentException.class, () -> s.decode(3, -1),
                        "decode: steps must be at least 0, got -1");
                assertThrows(IllegalArgumentException.class, () -> s.decode(-1, 2),
                        "decode: token id -1 at input index 0 is out of range");
                assertThrows(IllegalArgumentException.class, () -> s.decode(vocab, 2),
                        "decode: token id " + vocab);
                assertThrows(IllegalArgumentException.class, () -> s.decode(3, cap - len + 1),
                        "decode: context overflow: " + len + " tokens cached + " + (cap - len + 1)
                                + " new > capacity " + cap);
                assertEq(len, s.len(), "length");
            });
            check("bad input: empty extend -> IllegalArgumentException, state unchanged", () -> {
                int len = s.len();
                assertThrows(IllegalArgumentException.class, () -> s.extend(new int[0]),
                        "extend: empty input");
                assertThrows(IllegalArgumentException.class, () -> s.extend(new int[] {3, -1}),
                        "extend: token id -1 at input index 1");
                assertEq(len, s.len(), "length");
            });
            check("bad input: context overflow on extend and prefill -> IllegalArgumentException", () -> {
                int len = s.len();
                int[] tooMany = new int[cap - len + 1];
                Arrays.fill(tooMany, 3);
                assertThrows(IllegalArgumentException.class, () -> s.extend(tooMany),
                        "extend: context overflow: " + len + " tokens cached + " + tooMany.length
                                + " new > capacity " + cap);
                assertEq(len, s.len(), "length after the refused extend");
                int[] wholeTooLong = new int[cap + 1];
                Arrays.fill(wholeTooLong, 3);
                assertThrows(IllegalArgumentException.class, () -> m.prefill(wholeTooLong),
                        "prefill: context overflow");
            });
            check("bad input: embeddings of the wrong shape -> IllegalArgumentException", () -> {
                int[] ids = {2, 5, 7};
                float[] rows = new float[ids.length * m.hiddenSize() - 1];
                assertThrows(IllegalArgumentException.class, () -> m.prefillEmbeddings(ids, rows),
                        "prefill_embeddings: embeddings has shape", "expected [3, " + m.hiddenSize() + "]");
            });
            check("bad input: null arrays -> NullPointerException naming the argument", () -> {
                assertThrows(NullPointerException.class, () -> m.prefill(null), "prefill: ids is null");
                assertThrows(NullPointerException.class, () -> s.extend(null), "extend: ids is null");
                assertThrows(NullPointerException.class, () -> m.prefillEmbeddings(new int[] {2}, null),
                        "prefill_embeddings: embeddings is null");
            });
            check("handles: use after release and double release -> IllegalStateException", () -> {
                KvState r = s.snapshot();
                r.release();
                assertThrows(IllegalStateException.class, () -> r.step(1), "step: stale handle", "(released)");
                assertThrows(IllegalStateException.class, () -> r.decode(1, 2), "decode: stale handle", "(released)");
                assertThrows(IllegalStateException.class, () -> r.snapshot(), "snapshot: stale handle", "(released)");
                assertThrows(IllegalStateException.class, r::release, "release: stale handle", "(released)");
                r.close(); // close after release is a no-op
            });
            check("handles: zero, never issued, garbage -> IllegalStateException", () -> {
                assertThrows(IllegalStateException.class, () -> Native.step(m.handle(), 0L, 1),
                        "step: stale handle 0x0 (zero handle)");
                assertThrows(IllegalStateException.class, () -> Native.len(m.handle(), s.handle() + 4096),
                        "len: stale handle", "(never issued)");
                assertThrows(IllegalStateException.class, () -> Native.extend(m.handle(), 0x1234L, new int[] {1}),
                        "extend: stale handle 0x1234 (issued by another model)");
                assertThrows(IllegalStateException.class, () -> Native.prefill(0L, new int[] {1}),
                        "prefill: stale handle 0x0 (zero handle)");
                assertThrows(IllegalStateException.class, () -> Native.prefill(-1L, new int[] {1}),
                        "prefill: stale handle 0xffffffffffffffff");
            });
            check("handles: another model's state, or a model handle as a state -> IllegalStateException", () -> {
                try (KvModel other = open(dir); KvState foreign = other.prefill(new int[] {2, 3})) {
                    assertThrows(IllegalStateException.class, () -> Native.step(m.handle(), foreign.handle(), 1),
                            "step: stale handle", "(issued by another model)");
                    assertThrows(IllegalStateException.class, () -> Native.len(m.handle(), m.handle()),
                            "(issued by another model)");
                    foreign.step(3);
                    assertEq(3, foreign.len(), "the foreign state is untouched and usable");
                }
            });
        }
        check("closed model: every call -> IllegalStateException; close is idempotent", () -> {
            KvModel m = open(dir);
            KvState s = m.prefill(new int[] {2, 3, 4});
            KvState t = s.snapshot();
            m.close();
            assertThrows(IllegalStateException.class, () -> s.step(1), "step: the model is closed");
            assertThrows(IllegalStateException.class, t::len, "len: the model is closed");
            assertThrows(IllegalStateException.class, () -> m.prefill(new int[] {2}), "prefill: the model is closed");
            assertThrows(IllegalStateException.class, () -> Native.close(m.handle()), "close: the model is closed");
            s.close();
            m.close();
        });
        Path scratch = Files.createTempDirectory("kvsnap-jni-test");
        try {
            errorOpenChecks(dir, scratch);
        } finally {
            try (Stream<Path> paths = Files.walk(scratch)) {
                paths.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
            }
        }
    }

    void errorOpenChecks(String dir, Path scratch) throws IOException {
        check("open: missing model dir -> KvsnapException(io) naming the file", () -> {
            String missing = scratch.resolve("no-such-model").toString();
            KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.openReference(missing),
                    missing, "config.json");
            assertEq("io", ex.kind(), "kind");
            assertEq("null", String.valueOf(ex.status()), "status");
        });
        check("open: invalid config.json -> KvsnapException(config)", () -> {
            Path bad = Files.createDirectories(scratch.resolve("bad-config"));
            Files.writeString(bad.resolve("config.json"), "{ not json");
            KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.openReference(bad.toString()),
                    "config.json", "not JSON");
            assertEq("config", ex.kind(), "kind");
        });
        check("open: missing weights -> KvsnapException naming model.safetensors", () -> {
            Path noWeights = Files.createDirectories(scratch.resolve("no-weights"));
            Files.copy(Paths.get(dir, "config.json"), noWeights.resolve("config.json"));
            KvsnapException ex = assertThrows(KvsnapException.class,
                    () -> KvModel.openReference(noWeights.toString()), "model.safetensors");
            assertEq("io", ex.kind(), "kind");
        });
        check("open: corrupt weights -> KvsnapException(format)", () -> {
            Path corrupt = Files.createDirectories(scratch.resolve("corrupt-weights"));
            Files.copy(Paths.get(dir, "config.json"), corrupt.resolve("config.json"));
            Files.write(corrupt.resolve("model.safetensors"), new byte[] {1, 2, 3, 4, 5, 6, 7, 8, 9});
            KvsnapException ex = assertThrows(KvsnapException.class,
                    () -> KvModel.openReference(corrupt.toString()), "model.safetensors");
            assertEq("format", ex.kind(), "kind");
        });
        check("open: unknown backend -> IllegalArgumentException listing the known ones", () ->
                assertThrows(IllegalArgumentException.class, () -> KvModel.open("cuda", dir, null, null),
                        "open: unknown backend `cuda`", "reference, iree-cpu, iree-vulkan"));
        check("open: IREE backends, missing model dir -> KvsnapException(io) naming the dir", () -> {
            String missing = scratch.resolve("no-such-model").toString();
            for (String b : new String[] {"iree-cpu", "iree-vulkan"}) {
                KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.open(b, missing, null, null),
                        missing, "config.json");
                assertEq("io", ex.kind(), b + " kind");
            }
        });
        check("open: IREE device that is not an ordinal, or a device for iree-cpu -> IllegalArgumentException", () -> {
            for (String d : new String[] {"gpu", "-1", "1.5"}) {
                assertThrows(IllegalArgumentException.class, () -> KvModel.open("iree-vulkan", dir, null, d),
                        "open: iree-vulkan device `" + d + "` is not a Vulkan device ordinal");
            }
            assertThrows(IllegalArgumentException.class, () -> KvModel.open("iree-cpu", dir, null, "0"),
                    "open: the iree-cpu backend runs on `cpu`, not `0`");
        });
        check("open: a Vulkan device that does not exist (99) -> KvsnapException(backend) naming it", () -> {
            if (!Boolean.getBoolean("kvsnap.test.vulkan")) {
                // No Vulkan device at all: the driver's empty list is a capability this machine lacks.
                assertThrows(UnsupportedOperationException.class, () -> KvModel.open("iree-vulkan", dir, null, "99"),
                        "iree-vulkan", "found none");
                return;
            }
            KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.open("iree-vulkan", dir, null, "99"),
                    "open Vulkan device 99", "ordinal out of range");
            assertEq("backend", ex.kind(), "kind");
            assertEq("iree-vulkan", ex.backend(), "backend");
            assertEq(true, ex.status() != null && ex.status().contains("the driver found"), "status `" + ex.status() + "`");
            System.out.println("      (" + ex.getMessage() + ")");
        });
        check("open: options the reference does not take -> IllegalArgumentException", () -> {
            assertThrows(IllegalArgumentException.class, () -> KvModel.open("reference", dir, "/some/module", null),
                    "the reference backend takes no module dir");
            assertThrows(IllegalArgumentException.class, () -> KvModel.open("reference", dir, null, "vulkan"),
                    "the reference backend runs on `cpu`, not `vulkan`");
        });
        check("open: null arguments -> NullPointerException", () -> {
            assertThrows(NullPointerException.class, () -> KvModel.open(null, dir, null, null), "open: backend is null");
            assertThrows(NullPointerException.class, () -> KvModel.openReference(null), "open: modelDir is null");
        });
    }

    /**
     * {@code moduleDir} on iree-cpu: a module exported for the tiny model loads without compiling
     * and gives the Rust tokens; one exported with another context capacity opens with that
     * capacity (the module's description gives it) and gives the same tokens; one exported for
     * another config (another sliding window) is refused.
     */
    void moduleChecks(String dir, Expected e, String matching, String capacityDir, int capacity, String other) {
        check("moduleDir: iree-cpu from an exported module gives the Rust tokens", () -> {
            try (KvModel m = KvModel.open("iree-cpu", dir, matching, null); KvState catalog = m.prefill(e.prefix)) {
                assertEq("iree-cpu", m.backend(), "backend");
                assertEq(e.prefill, catalog.nextToken(), "prefill token");
                assertEq(e.outputs.get(0), turn(catalog, e.utterances.get(0), e.steps()), "turn 0");
            }
        });
        check("moduleDir: a module exported with capacity " + capacity + " opens with it and gives the Rust tokens", () -> {
            try (KvModel m = KvModel.open("iree-cpu", dir, capacityDir, null); KvState catalog = m.prefill(e.prefix)) {
                assertEq(capacity, m.contextCapacity(), "context capacity");
                assertEq(e.prefill, catalog.nextToken(), "prefill token");
                assertEq(e.outputs.get(0), turn(catalog, e.utterances.get(0), e.steps()), "turn 0");
            }
        });
        check("moduleDir: a module built for another config -> KvsnapException(format)", () -> {
            KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.open("iree-cpu", dir, other, null),
                    "compiled for another model config", "kvsnap.llvm-cpu.json");
            assertEq("format", ex.kind(), "kind");
        });
        check("moduleDir: a directory without a module -> KvsnapException(io) naming the file", () -> {
            KvsnapException ex = assertThrows(KvsnapException.class, () -> KvModel.open("iree-cpu", dir, dir, null),
                    "kvsnap.llvm-cpu.json");
            assertEq("io", ex.kind(), "kind");
        });
    }

    public static void main(String[] args) throws Exception {
        JniTest t = new JniTest();
        List<String[]> models = new ArrayList<>();
        String[] modules = null;
        for (int i = 0; i < args.length; ) {
            if (args[i].equals("--model") && i + 4 < args.length) {
                models.add(new String[] {args[i + 1], args[i + 2], args[i + 3], args[i + 4]});
                i += 5;
            } else if (args[i].equals("--modules") && i + 4 < args.length) {
                modules = new String[] {args[i + 1], args[i + 2], args[i + 3], args[i + 4]};
                i += 5;
            } else if (args[i].equals("--skip") && i + 2 < args.length) {
                t.skip(args[i + 1], args[i + 2]);
                i += 3;
            } else {
                System.err.println("usage: JniTest --model NAME BACKEND DIR EXPECTED ... [--modules MATCHING CAPACITY_DIR CAPACITY OTHER] [--skip NAME REASON]");
                System.exit(2);
            }
        }
        if (models.isEmpty()) {
            System.err.println("JniTest: no --model given");
            System.exit(2);
        }
        for (int i = 0; i < models.size(); i++) {
            String[] spec = models.get(i);
            String name = spec[0] + " (" + spec[1] + ")";
            t.backend = spec[1];
            String dir = spec[2];
            Expected e = Expected.read(Paths.get(spec[3]));
            t.flowChecks(name, dir, e);
            if (i == 0) {
                // A failure outside a check (opening the model for a group) fails the group.
                t.check("thread checks ran", () -> t.threadChecks(dir, e));
                t.check("error checks ran", () -> t.errorChecks(dir, e));
                if (modules != null) {
                    t.moduleChecks(dir, e, modules[0], modules[1], Integer.parseInt(modules[2]), modules[3]);
                }
            }
        }
        String closing = "jni: " + t.passed + " passed, " + t.failed + " failed";
        System.out.println(t.skipped > 0 ? closing + ", " + t.skipped + " skipped" : closing);
        System.exit(t.failed == 0 ? 0 : 1);
    }
}
