package dev.kvsnap;

/**
 * The native methods of libkvsnap_jni. Package-private: {@link KvModel} and {@link KvState} are
 * the API. Every method either returns a valid result or throws; none signals failure by null
 * or 0.
 */
final class Native {
    /**
     * System property naming the library file to load (absolute, or relative to the working
     * directory) instead of {@code kvsnap_jni} on {@code java.library.path}.
     */
    static final String LIBRARY_PATH_PROPERTY = "kvsnap.library.path";

    static {
        String path = System.getProperty(LIBRARY_PATH_PROPERTY);
        if (path != null && !path.isEmpty()) {
            System.load(java.nio.file.Paths.get(path).toAbsolutePath().toString());
        } else {
            System.loadLibrary("kvsnap_jni");
        }
    }

    private Native() {}

    static native long open(String backend, String modelDir, String moduleDir, String device);

    static native void close(long model);

    static native String backend(long model);

    /** {vocab size, hidden size, context capacity}. */
    static native int[] config(long model);

    /** {kv handle, next token}. */
    static native long[] prefill(long model, int[] ids);

    /** {kv handle, next token}. */
    static native long[] prefillEmbeddings(long model, int[] ids, float[] embeddings);

    static native float[] embeddingRows(long model, int[] ids);

    static native int extend(long model, long kv, int[] ids);

    static native int step(long model, long kv, int id);

    static native int[] decode(long model, long kv, int id, int steps);

    static native long snapshot(long model, long kv);

    static native void release(long model, long kv);

    static native int len(long model, long kv);

    static native long kvBytes(long model, long kv);

    static native int liveStates(long model);
}
