package dev.kvsnap;

import java.util.concurrent.atomic.AtomicBoolean;

/**
 * A loaded model. Prefill a prompt prefix once, {@link KvState#snapshot() snapshot} it, and per
 * request extend a copy of the snapshot and step a few tokens. KV states stay on the backend's
 * device; Java only holds their {@code long} handles.
 *
 * <p>Thread safety: any thread may call any method. Calls on distinct {@link KvState}s run in
 * parallel; calls on one state are serialised. {@link #close()} waits for the calls in progress,
 * frees every state of this model, and makes later calls throw {@link IllegalStateException}.
 *
 * <p>Errors: {@link IllegalArgumentException} for bad token ids (negative or past the vocab),
 * empty input, wrong embedding shapes and context overflow; {@link IllegalStateException} for
 * released states and closed models; {@link NullPointerException} for null arguments;
 * {@link UnsupportedOperationException} for capabilities a backend lacks;
 * {@link KvsnapException} for device, backend, I/O and weights failures.
 */
public final class KvModel implements AutoCloseable {
    private final long handle;
    private final AtomicBoolean closed = new AtomicBoolean();
    private final String backend;
    private final int vocabSize;
    private final int hiddenSize;
    private final int contextCapacity;

    private KvModel(long handle) {
        this.handle = handle;
        try {
            this.backend = Native.backend(handle);
            int[] config = Native.config(handle);
            this.vocabSize = config[0];
            this.hiddenSize = config[1];
            this.contextCapacity = config[2];
        } catch (RuntimeException e) {
            // Nobody else holds the handle yet: free the model rather than leak it.
            Native.close(handle);
            throw e;
        }
    }

    /**
     * Loads a model.
     *
     * @param backend {@code reference} (the pure-Rust CPU reference), {@code iree-cpu} or
     *     {@code iree-vulkan}
     * @param modelDir Hugging Face checkpoint directory ({@code config.json},
     *     {@code model.safetensors})
     * @param moduleDir directory of the compiled module, IREE backends only; null otherwise
     * @param device device name, IREE backends only; null for the default
     * @throws KvsnapException if the files are missing or invalid
     * @throws IllegalArgumentException for an unknown backend or an option it does not take
     * @throws UnsupportedOperationException for a backend not built into the library
     */
    public static KvModel open(String backend, String modelDir, String moduleDir, String device) {
        return new KvModel(Native.open(backend, modelDir, moduleDir, device));
    }

    /** Loads {@code modelDir} on the reference backend. */
    public static KvModel openReference(String modelDir) {
        return open("reference", modelDir, null, null);
    }

    /** Runs {@code ids} as a fresh sequence; the state's {@link KvState#nextToken()} is the greedy next token. */
    public KvState prefill(int[] ids) {
        long[] r = Native.prefill(handle, ids);
        return new KvState(this, r[0], (int) r[1]);
    }

    /**
     * Runs a fresh sequence from host-gathered raw (unscaled) embedding rows,
     * {@code [ids.length, hiddenSize()]} row-major; {@code ids} give the length and are validated
     * like any input.
     */
    public KvState prefillEmbeddings(int[] ids, float[] embeddings) {
        long[] r = Native.prefillEmbeddings(handle, ids, embeddings);
        return new KvState(this, r[0], (int) r[1]);
    }

    /** The raw embedding rows of {@code ids}, {@code [ids.length, hiddenSize()]}, as {@link #prefillEmbeddings} takes them. */
    public float[] embeddingRows(int[] ids) {
        return Native.embeddingRows(handle, ids);
    }

    /** The backend's name. */
    public String backend() {
        return backend;
    }

    /** Number of token ids; valid ids are {@code 0 .. vocabSize() - 1}. */
    public int vocabSize() {
        return vocabSize;
    }

    /** Width of one embedding row. */
    public int hiddenSize() {
        return hiddenSize;
    }

    /** Most tokens one KV state holds. */
    public int contextCapacity() {
        return contextCapacity;
    }

    /** Number of KV states of this model not yet released. */
    public int liveStates() {
        return Native.liveStates(handle);
    }

    /** Whether {@link #close()} was called. */
    public boolean isClosed() {
        return closed.get();
    }

    /** The native handle, for callers that keep their own tables. */
    public long handle() {
        return handle;
    }

    /** Frees the model and every KV state it still has. Closing twice does nothing. */
    @Override
    public void close() {
        if (closed.compareAndSet(false, true)) {
            Native.close(handle);
        }
    }
}
