package dev.kvsnap;

/**
 * A failure of the model itself rather than of the caller's arguments: a device or backend
 * failure (with the backend's own status text), a missing or malformed model file, weights that
 * do not match the config, the KV memory budget, or an internal error.
 *
 * <p>Argument errors throw {@link IllegalArgumentException}, stale handles and closed models
 * {@link IllegalStateException}, capabilities a backend lacks
 * {@link UnsupportedOperationException}.
 */
public class KvsnapException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final String kind;
    private final String backend;
    private final String status;

    /**
     * Called by the native library.
     *
     * @param kind the stable error kind: {@code backend}, {@code io}, {@code config},
     *     {@code format}, {@code weights_mismatch}, {@code kv_budget}, {@code jni} or {@code panic}
     * @param backend the backend that failed, or null
     * @param status the backend's status text, or null
     * @param message the full message
     */
    public KvsnapException(String kind, String backend, String status, String message) {
        super(message);
        this.kind = kind;
        this.backend = backend;
        this.status = status;
    }

    /** The stable error kind, e.g. {@code backend} or {@code io}. */
    public String kind() {
        return kind;
    }

    /** The backend that reported the failure, or null when it did not come from a backend. */
    public String backend() {
        return backend;
    }

    /** The backend's own status text (e.g. IREE's), or null. */
    public String status() {
        return status;
    }
}
