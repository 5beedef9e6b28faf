//! JNI bridge of kvsnap. Not implemented yet: see the JNI issue.
