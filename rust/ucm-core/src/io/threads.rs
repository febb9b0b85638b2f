//! The thread plumbing both queued engines share: starting their named
//! threads, running callbacks on them, and joining them on drop.

use std::thread::JoinHandle;

use super::IoDone;

/// Starts `count` engine threads named `{prefix}-{i}`, thread `i` running
/// what `body(i)` returns, and adds them to `threads`. On error the threads
/// already started stay in `threads`, so dropping the engine that owns them
/// shuts them down.
pub(crate) fn spawn_all<F>(
    prefix: &str,
    count: usize,
    threads: &mut Vec<JoinHandle<()>>,
    mut body: impl FnMut(usize) -> F,
) -> crate::Result<()>
where
    F: FnOnce() + Send + 'static,
{
    for i in 0..count {
        let handle = std::thread::Builder::new()
            .name(format!("{prefix}-{i}"))
            .spawn(body(i))
            .map_err(|e| crate::UcmError::os("spawn I/O thread", "", e))?;
        threads.push(handle);
    }
    Ok(())
}

/// Joins an engine's threads, logging `panicked` for each that panicked.
/// The calling thread is skipped: the last engine reference may be dropped
/// inside a callback on an engine thread, which then exits by itself once
/// its queue has drained.
pub(crate) fn join_all(threads: &mut Vec<JoinHandle<()>>, panicked: &str) {
    let me = std::thread::current().id();
    for handle in threads.drain(..) {
        if handle.thread().id() == me {
            continue;
        }
        if handle.join().is_err() {
            log::error!("{panicked}");
        }
    }
}

/// Runs a callback, containing a panic so that one bad callback cannot take
/// an engine thread down with it.
pub(crate) fn run_callback(done: IoDone, res: std::io::Result<usize>) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || done(res)));
    if outcome.is_err() {
        log::error!("an I/O completion callback panicked; the engine thread keeps running");
    }
}

/// The error a request gets once its engine is shutting down.
pub(crate) fn closed() -> std::io::Error {
    std::io::Error::other("I/O engine is shut down")
}
