//! A same-run throughput baseline for the store benchmarks: plain
//! sequential O_DIRECT `pread`/`pwrite` from a few threads, no engine, no
//! store (or the same through the page cache, the baseline of buffered
//! I/O). Benchmarks print their throughput as a ratio of this number.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::Instant;

use super::{align_up, AlignedBuf, IoOp};

/// Removes the scratch file however the measurement ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn open_scratch(path: &Path, direct: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(path)
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Throughput in GB/s (10^9 bytes per second) of plain sequential O_DIRECT
/// I/O on one scratch file in `dir`, created for this one measurement (see
/// [`BaselineFile`]; benchmarks that measure repeatedly keep one).
pub fn baseline_direct_io(
    dir: &Path,
    op: IoOp,
    total_bytes: usize,
    io_size: usize,
    queue_depth: usize,
) -> std::io::Result<f64> {
    BaselineFile::create(dir, total_bytes, io_size, queue_depth)?.measure(op)
}

/// A scratch file for repeated baseline measurements.
///
/// `io_size` is rounded up to 4 KiB. `queue_depth` threads (at least one)
/// each move their contiguous share of the file, `io_size` bytes per call,
/// with `pread`/`pwrite` (retrying short transfers). The file holds
/// `total_bytes` rounded down to a multiple of `io_size * queue_depth` (at
/// least one I/O per thread). It is preallocated with `fallocate` (falling
/// back to `ftruncate` where unsupported) when created and removed on drop.
///
/// * `IoOp::Write` overwrites it; no fsync is timed.
/// * `IoOp::Read` reads it; a file not yet written in full is first written
///   (O_DIRECT, untimed, then `fdatasync`), so the reads hit allocated,
///   written blocks; O_DIRECT keeps the page cache out of it.
///
/// Keeping one file across measurements keeps the file system's own work
/// (creating, freeing and, on `-o discard` mounts, discarding 100+ MiB)
/// out of the measurements of whatever runs next.
///
/// [`BaselineFile::create_buffered`] makes the same file without O_DIRECT:
/// its writes are copies into the page cache and its reads, of a file just
/// written, copies out of it. That is the baseline of buffered store I/O,
/// which an O_DIRECT baseline would flatter by the page cache's speed.
pub struct BaselineFile {
    file: File,
    _scratch: Scratch,
    io_size: usize,
    qd: usize,
    ios_per_thread: usize,
    file_len: usize,
    written: bool,
}

impl BaselineFile {
    /// Creates and preallocates the scratch file in `dir` (O_DIRECT).
    pub fn create(
        dir: &Path,
        total_bytes: usize,
        io_size: usize,
        queue_depth: usize,
    ) -> std::io::Result<Self> {
        Self::create_as(dir, total_bytes, io_size, queue_depth, true)
    }

    /// Like [`BaselineFile::create`], but its I/O goes through the page
    /// cache.
    pub fn create_buffered(
        dir: &Path,
        total_bytes: usize,
        io_size: usize,
        queue_depth: usize,
    ) -> std::io::Result<Self> {
        Self::create_as(dir, total_bytes, io_size, queue_depth, false)
    }

    fn create_as(
        dir: &Path,
        total_bytes: usize,
        io_size: usize,
        queue_depth: usize,
        direct: bool,
    ) -> std::io::Result<Self> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let io_size = align_up(io_size.max(1));
        let qd = queue_depth.max(1);
        let ios_per_thread = (total_bytes / io_size / qd).max(1);
        let file_len = ios_per_thread * io_size * qd;
        let path = dir.join(format!(
            ".ucm-baseline-{}-{}.dat",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = open_scratch(&path, direct)?;
        let scratch = Scratch(path);
        let len = libc::off_t::try_from(file_len)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        use std::os::fd::AsRawFd;
        // SAFETY: plain syscall on a descriptor owned by `file`.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if r != 0 {
            file.set_len(file_len as u64)?;
        }
        Ok(BaselineFile {
            file,
            _scratch: scratch,
            io_size,
            qd,
            ios_per_thread,
            file_len,
            written: false,
        })
    }

    /// One timed pass over the whole file; GB/s.
    pub fn measure(&mut self, op: IoOp) -> std::io::Result<f64> {
        self.timed(op, None)
    }

    /// Like [`BaselineFile::measure`], but moving the bytes of `mem` (read
    /// into it, or written from it): thread `t` moves the `t`-th contiguous
    /// share of `mem` to or from the same share of the file. A store
    /// benchmark passes the very memory the store moved, so both sides pay
    /// the same cost of pinning the caller's pages for O_DIRECT (a hot
    /// private buffer per thread would make the baseline cheaper than any
    /// real transfer of 100+ MiB of cold memory). `mem` must be 4 KiB
    /// aligned and at least as long as the file.
    pub fn measure_mem(&mut self, op: IoOp, mem: &mut [u8]) -> std::io::Result<f64> {
        if mem.len() < self.file_len || (mem.as_ptr() as usize) % super::DIRECT_ALIGN != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "baseline memory must be {}-byte aligned and hold {} bytes",
                    super::DIRECT_ALIGN,
                    self.file_len
                ),
            ));
        }
        let len = self.file_len;
        self.timed(op, Some(&mut mem[..len]))
    }

    /// A read first has the file written in full (untimed); then one timed
    /// [`BaselineFile::pass`]; GB/s.
    fn timed(&mut self, op: IoOp, mem: Option<&mut [u8]>) -> std::io::Result<f64> {
        if op == IoOp::Read && !self.written {
            let chunk = align_up(self.io_size.max(4 << 20));
            let mut buf = AlignedBuf::new(chunk);
            fill(&mut buf, 7);
            let mut off = 0usize;
            while off < self.file_len {
                let n = chunk.min(self.file_len - off);
                self.file.write_all_at(&buf[..n], off as u64)?;
                off += n;
            }
            self.file.sync_data()?;
        }
        let secs = self.pass(op, mem)?;
        if op == IoOp::Write {
            self.written = true;
        }
        Ok(self.file_len as f64 / secs.max(1e-9) / 1e9)
    }

    /// One timed pass in seconds: thread `t` moves the `t`-th share of the
    /// file, from or into the `t`-th share of `mem`, or through a private
    /// buffer of one I/O when `mem` is None.
    fn pass(&self, op: IoOp, mem: Option<&mut [u8]>) -> std::io::Result<f64> {
        let (qd, io_size, ios) = (self.qd, self.io_size, self.ios_per_thread);
        let share = ios * io_size;
        let shares: Vec<Option<&mut [u8]>> = match mem {
            Some(m) => m.chunks_mut(share).map(Some).collect(),
            None => (0..qd).map(|_| None).collect(),
        };
        let barrier = Barrier::new(qd + 1);
        let file: &File = &self.file;
        std::thread::scope(|scope| {
            let handles: Vec<_> = shares
                .into_iter()
                .enumerate()
                .map(|(t, region)| {
                    let barrier = &barrier;
                    scope.spawn(move || -> std::io::Result<()> {
                        let mut private =
                            AlignedBuf::new(if region.is_some() { 0 } else { io_size });
                        fill(&mut private, t as u64 + 1);
                        let mut region = region;
                        let base = (t * share) as u64;
                        barrier.wait();
                        for i in 0..ios {
                            let io: &mut [u8] = match region.as_deref_mut() {
                                Some(r) => &mut r[i * io_size..(i + 1) * io_size],
                                None => &mut private,
                            };
                            let off = base + (i * io_size) as u64;
                            match op {
                                IoOp::Read => file.read_exact_at(io, off)?,
                                IoOp::Write => file.write_all_at(io, off)?,
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            barrier.wait();
            let start = Instant::now();
            let mut first_err = None;
            for h in handles {
                let res = h
                    .join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("baseline I/O thread panicked")));
                if let Err(e) = res {
                    first_err.get_or_insert(e);
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok(start.elapsed().as_secs_f64()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_reports_positive_throughput_and_cleans_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        for op in [IoOp::Write, IoOp::Read] {
            let gbps = baseline_direct_io(dir.path(), op, 8 << 20, 1 << 20, 2).expect("baseline");
            assert!(gbps > 0.0 && gbps.is_finite(), "{op:?}: {gbps}");
        }
        // Odd sizes are rounded, not rejected.
        let gbps = baseline_direct_io(dir.path(), IoOp::Read, 1000, 1000, 3).expect("baseline");
        assert!(gbps > 0.0);
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0);
    }

    #[test]
    fn one_baseline_file_serves_repeated_measurements() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut f = BaselineFile::create(dir.path(), 4 << 20, 1 << 20, 2).expect("create");
        for op in [IoOp::Read, IoOp::Write, IoOp::Write, IoOp::Read] {
            let gbps = f.measure(op).expect("measure");
            assert!(gbps > 0.0 && gbps.is_finite(), "{op:?}: {gbps}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
        // From and into caller memory: what is written is read back.
        let mut src = AlignedBuf::new(4 << 20);
        fill(&mut src, 9);
        let mut dst = AlignedBuf::new(4 << 20);
        assert!(f.measure_mem(IoOp::Write, &mut src).expect("write") > 0.0);
        assert!(f.measure_mem(IoOp::Read, &mut dst).expect("read") > 0.0);
        assert!(src[..] == dst[..]);
        let mut short = AlignedBuf::new(1 << 20);
        assert!(f.measure_mem(IoOp::Read, &mut short).is_err());
        drop(f);
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0);
    }

    #[test]
    fn buffered_baseline_moves_the_same_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut f = BaselineFile::create_buffered(dir.path(), 4 << 20, 1 << 20, 2).expect("create");
        assert!(f.measure(IoOp::Read).expect("read") > 0.0);
        let mut src = AlignedBuf::new(4 << 20);
        fill(&mut src, 3);
        let mut dst = AlignedBuf::new(4 << 20);
        assert!(f.measure_mem(IoOp::Write, &mut src).expect("write") > 0.0);
        assert!(f.measure_mem(IoOp::Read, &mut dst).expect("read") > 0.0);
        assert!(src[..] == dst[..]);
        drop(f);
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0);
    }
}
