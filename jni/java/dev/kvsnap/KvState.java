package dev.kvsnap;

import java.util.concurrent.atomic.AtomicBoolean;

/**
 * One sequence's KV state, held on the backend's device. Use it after
 * {@link KvModel#prefill}: {@link #extend} appends several tokens, {@link #step} one, and both
 * return the greedy next token; {@link #decode} runs several greedy steps in one call.
 * {@link #snapshot()} is an independent copy.
 *
 * <p>Calls on one state are serialised; distinct states may be used from distinct threads in
 * parallel. Errors are thrown as documented on {@link KvModel}.
 */
public final class KvState implements AutoCloseable {
    private final KvModel model;
    private final long handle;
    private final AtomicBoolean released = new AtomicBoolean();
    private volatile int nextToken;

    KvState(KvModel model, long handle, int nextToken) {
        this.model = model;
        this.handle = handle;
        this.nextToken = nextToken;
    }

    /** Appends {@code ids}; returns the greedy next token. On an error the state is unchanged. */
    public int extend(int[] ids) {
        int next = Native.extend(model.handle(), handle, ids);
        nextToken = next;
        return next;
    }

    /** Appends one token; returns the greedy next token. On an error the state is unchanged. */
    public int step(int id) {
        int next = Native.step(model.handle(), handle, id);
        nextToken = next;
        return next;
    }

    /**
     * Greedy-decodes {@code steps} tokens: appends {@code id}, then each token the step before
     * returned; returns the {@code steps} tokens (the state grows by {@code steps}, the last
     * token is not appended). What {@code steps} calls of {@link #step} return, but a GPU
     * backend runs them without a round trip to the host between steps. On an input error
     * (a token out of range, {@code steps} 0 or negative, no room) the state is unchanged.
     */
    public int[] decode(int id, int steps) {
        int[] tokens = Native.decode(model.handle(), handle, id, steps);
        if (tokens.length > 0) {
            nextToken = tokens[tokens.length - 1];
        }
        return tokens;
    }

    /** An independent copy: using either never changes the other. */
    public KvState snapshot() {
        return new KvState(model, Native.snapshot(model.handle(), handle), nextToken);
    }

    /** The greedy next token predicted by the latest prefill, extend or step of this state. */
    public int nextToken() {
        return nextToken;
    }

    /** Number of tokens cached. */
    public int len() {
        return Native.len(model.handle(), handle);
    }

    /** Bytes of memory the state holds. */
    public long kvBytes() {
        return Native.kvBytes(model.handle(), handle);
    }

    /** The model this state belongs to. */
    public KvModel model() {
        return model;
    }

    /** The native handle, for callers that keep their own tables. */
    public long handle() {
        return handle;
    }

    /**
     * Frees the state now.
     *
     * @throws IllegalStateException if it was already released (a double release is a bug in
     *     the caller) or its model is closed
     */
    public void release() {
        released.set(true);
        Native.release(model.handle(), handle);
    }

    /**
     * Frees the state unless it was already released or its model closed (which freed it):
     * safe in try-with-resources whatever order things are closed in.
     */
    @Override
    public void close() {
        if (released.compareAndSet(false, true) && !model.isClosed()) {
            try {
                Native.release(model.handle(), handle);
            } catch (IllegalStateException e) {
                // The model was closed by another thread meanwhile: the state is freed.
                if (!model.isClosed()) {
                    throw e;
                }
            }
        }
    }
}
