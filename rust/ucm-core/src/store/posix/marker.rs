//! The mark of a store directory: `<root>/.ucm-store`, written by the first
//! store that writes under a root, naming the on-disk format. Tools that
//! delete (`ucm store clear`, `gc`, `verify --remove`) act only on a
//! directory that carries it, so a command pointed at the wrong folder
//! refuses instead of deleting what ucm did not write.

use rustix::fs::OFlags;

use super::files::Dir;
use crate::error::{Result, UcmError};

/// The marker's name under each root.
pub const MARKER_FILE: &str = ".ucm-store";
/// The on-disk format this version writes and reads.
pub const FORMAT: u32 = 1;
/// Longest marker read: it is a line or two, and anything may be put there.
const MAX_LEN: usize = 4096;

fn text(format: u32) -> String {
    format!("ucm store\nformat {format}\n")
}

/// The format a marker's bytes declare; None when they are not a marker.
fn parse(bytes: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(bytes).ok()?;
    let mut lines = s.lines();
    (lines.next()? == "ucm store").then_some(())?;
    lines.next()?.strip_prefix("format ")?.trim().parse().ok()
}

/// The format `root`'s marker declares, None when there is none. Anything
/// at its name that is not a small regular file holding a marker is an
/// error naming it.
pub fn read(root: &Dir) -> Result<Option<u32>> {
    use std::io::Read;
    let path = root.join(MARKER_FILE);
    let st = match root.lstat(MARKER_FILE) {
        Ok(st) => st,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(UcmError::os("stat", path, e)),
    };
    if !st.is_file() {
        return Err(UcmError::invalid(format!(
            "{} is {}, not a ucm store marker",
            path.display(),
            st.describe()
        )));
    }
    let mut buf = Vec::new();
    root.open_file(MARKER_FILE, OFlags::RDONLY)
        .and_then(|f| f.take(MAX_LEN as u64 + 1).read_to_end(&mut buf))
        .map_err(|e| UcmError::os("read", &path, e))?;
    match parse(&buf) {
        Some(v) if buf.len() <= MAX_LEN => Ok(Some(v)),
        _ => Err(UcmError::invalid(format!(
            "{} is not a ucm store marker",
            path.display()
        ))),
    }
}

/// Marks `root` as a store directory of this format unless it already is;
/// a directory marked with a newer format is refused (this version would
/// misread it).
pub fn ensure(root: &Dir) -> Result<()> {
    match read(root)? {
        Some(v) if v > FORMAT => Err(UcmError::invalid(format!(
            "{} was written by a newer ucm (store format {v}; this version reads {FORMAT})",
            root.path().display()
        ))),
        Some(_) => Ok(()),
        None => {
            use std::io::Write;
            let tmp = format!("{MARKER_FILE}.{}", super::files::random_token());
            let write = || -> std::io::Result<()> {
                let mut f = root.create_file(&tmp, 0o600, OFlags::empty())?;
                f.write_all(text(FORMAT).as_bytes())?;
                // Never replaces a marker another store wrote meanwhile.
                match root.rename_noreplace(&tmp, root, MARKER_FILE) {
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                    r => r,
                }
            };
            let r = write();
            let _ = root.remove_file(&tmp);
            r.map_err(|e| UcmError::os("write", root.join(MARKER_FILE), e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_once_and_reads_back() {
        let d = tempfile::tempdir().unwrap();
        let root = Dir::open(d.path()).unwrap();
        assert_eq!(read(&root).unwrap(), None);
        ensure(&root).unwrap();
        ensure(&root).unwrap();
        assert_eq!(read(&root).unwrap(), Some(FORMAT));
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "no temporary left");
        std::fs::write(d.path().join(MARKER_FILE), text(FORMAT + 1)).unwrap();
        assert!(ensure(&root).unwrap_err().to_string().contains("newer"));
        std::fs::write(d.path().join(MARKER_FILE), b"hello").unwrap();
        assert!(read(&root).is_err());
        std::fs::remove_file(d.path().join(MARKER_FILE)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.path().join(MARKER_FILE)).unwrap();
        let e = read(&root).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }
}
