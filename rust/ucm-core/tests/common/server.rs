//! Test servers run as child processes (moto for S3, ganesha for NFS).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` with its output discarded; panics with `what` when it
/// cannot be started.
pub fn spawn_quiet(cmd: &mut Command, what: &str) -> Child {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect(what)
}

/// Asks `ready` every `every` until it says yes (true) or `within` has
/// passed (false).
pub fn poll(within: Duration, every: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if ready() {
            return true;
        }
        std::thread::sleep(every);
    }
    false
}
