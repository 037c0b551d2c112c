//! Blocking file work for async callers.

/// Runs blocking file work (an `fdatasync`) for an async caller. On a multi-thread runtime it
/// runs right here, on the calling worker (`block_in_place`: the worker's other tasks move to
/// another thread meanwhile), so the caller resumes the moment the call returns, without a
/// round trip through the blocking pool; nor can the caller be dropped halfway through it.
/// Elsewhere (a current-thread runtime, or none) it runs right here too, blocking that thread
/// for the call: handing it to the blocking pool would let a caller dropped meanwhile (a client
/// gone mid-FLUSH) miss the call's error, and a later FLUSH succeed over data the failed one
/// lost.
/// A panic inside `f` (only an injected fault does that) comes back as an error, so the caller
/// fails the volume rather than losing the dirty batch it took.
pub(crate) async fn blocking_here<T>(f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    let f = move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|_| Err(std::io::Error::other("a blocking file operation panicked")))
    };
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi {
        return tokio::task::block_in_place(f);
    }
    f()
}
