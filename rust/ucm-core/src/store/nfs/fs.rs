//! The two ways the NFS store reaches an export, behind one small API:
//! the built-in NFSv3 client ([`RemoteFs`]) and a kernel-mounted directory
//! ([`LocalFs`]). Both use the Posix store's naming (`<2 hex>/<32 hex>`)
//! and publish a block by renaming a fully written, committed temporary
//! file in the same directory.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nfs3_client::nfs3_types::nfs3::{fattr3, nfs_fh3, nfsstat3, writeverf3};
use parking_lot::Mutex;

use super::client::{Client, NfsError};
use crate::block::BlockId;
use crate::block::IdMap;
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::store::remote::Breaker;
use crate::store::safe_fs;

/// An open temporary block file.
pub enum TempFile {
    /// Handle on the server.
    Remote(nfs_fh3),
    /// Open file on the mounted export.
    Local(Arc<File>),
}

/// Where the store's files live.
pub enum Fs {
    /// Built-in client.
    Remote(Box<RemoteFs>),
    /// Kernel mount.
    Local(LocalFs),
}

fn names(id: &BlockId) -> (String, String) {
    let hex = id.hex();
    (hex[..2].to_string(), hex)
}

/// The built-in NFSv3 client and the handles it has learnt.
pub struct RemoteFs {
    /// The connection pool.
    pub client: Client,
    /// `sync` mount option: FILE_SYNC writes, no COMMIT.
    pub sync: bool,
    dirs: Mutex<HashMap<String, nfs_fh3>>,
    handles: Mutex<IdMap<(nfs_fh3, Instant)>>,
    handle_ttl: Duration,
    breaker: Arc<Breaker>,
    /// Where, for messages.
    pub label: String,
}

/// A directory on a kernel-mounted export.
#[derive(Clone)]
pub struct LocalFs {
    root: PathBuf,
    direct: bool,
}

fn from_nfs(breaker: &Breaker, e: NfsError) -> UcmError {
    match e {
        NfsError::Transport { msg, timeout } => {
            breaker.trip(&msg);
            if timeout {
                UcmError::Timeout(format!("NFS {msg}"))
            } else {
                UcmError::TaskFailed(format!("NFS server unreachable: {msg}"))
            }
        }
        NfsError::Status(s, what) => {
            breaker.reset();
            let msg = format!("NFS {what}: {s}");
            match s {
                nfsstat3::NFS3ERR_NOENT => UcmError::NotFound(msg),
                nfsstat3::NFS3ERR_NOSPC | nfsstat3::NFS3ERR_DQUOT => UcmError::NoSpace(msg),
                nfsstat3::NFS3ERR_ACCES | nfsstat3::NFS3ERR_PERM | nfsstat3::NFS3ERR_ROFS => {
                    UcmError::TaskFailed(format!(
                        "{msg} (permission denied: check the export's \
                         access rules and the uid=/gid= mount options)"
                    ))
                }
                _ => UcmError::TaskFailed(msg),
            }
        }
    }
}

fn is_stale(e: &NfsError) -> bool {
    matches!(
        e.status(),
        Some(nfsstat3::NFS3ERR_STALE | nfsstat3::NFS3ERR_BADHANDLE | nfsstat3::NFS3ERR_NOENT)
    )
}

impl RemoteFs {
    /// Wraps a connected client.
    pub fn new(
        client: Client,
        sync: bool,
        handle_ttl: Duration,
        breaker: Arc<Breaker>,
        label: String,
    ) -> Self {
        RemoteFs {
            client,
            sync,
            dirs: Mutex::new(HashMap::new()),
            handles: Mutex::new(IdMap::default()),
            handle_ttl,
            breaker,
            label,
        }
    }

    fn err(&self, e: NfsError) -> UcmError {
        from_nfs(&self.breaker, e)
    }

    async fn dir(&self, dir: &str, create: bool) -> Result<Option<nfs_fh3>> {
        if let Some(fh) = self.dirs.lock().get(dir) {
            return Ok(Some(fh.clone()));
        }
        let root = self.client.root.clone();
        let found = match self
            .client
            .lookup(&root, dir)
            .await
            .map_err(|e| self.err(e))?
        {
            Some((fh, _)) => Some(fh),
            None if create => Some(
                self.client
                    .mkdir(&root, dir)
                    .await
                    .map_err(|e| self.err(e))?,
            ),
            None => None,
        };
        if let Some(fh) = &found {
            self.dirs.lock().insert(dir.to_string(), fh.clone());
        }
        Ok(found)
    }

    /// The entries of block directory `dir` (`"00"` to `"ff"`) with their
    /// attributes; none if the directory does not exist.
    pub async fn list_dir(&self, dir: &str) -> Result<Vec<(String, Option<fattr3>)>> {
        let Some(fh) = self.dir(dir, false).await? else {
            return Ok(Vec::new());
        };
        self.client.list(&fh).await.map_err(|e| self.err(e))
    }

    /// Creates the 256 block directories.
    pub async fn create_dirs(&self) -> Result<()> {
        let all = (0..=255u8).map(|b| format!("{b:02x}"));
        let made =
            futures::future::join_all(all.map(|d| async move { self.dir(&d, true).await })).await;
        for r in made {
            r?;
        }
        Ok(())
    }

    fn cached_handle(&self, id: &BlockId) -> Option<nfs_fh3> {
        let map = self.handles.lock();
        map.get(id)
            .filter(|(_, at)| at.elapsed() < self.handle_ttl)
            .map(|(fh, _)| fh.clone())
    }

    fn remember(&self, id: BlockId, fh: nfs_fh3) {
        if self.handle_ttl.is_zero() {
            return;
        }
        let mut map = self.handles.lock();
        if map.len() >= 1 << 18 {
            let ttl = self.handle_ttl;
            map.retain(|_, (_, at)| at.elapsed() < ttl);
            if map.len() >= 1 << 18 {
                map.clear();
            }
        }
        map.insert(id, (fh, Instant::now()));
    }

    /// Forgets what is known about a block (it was removed or replaced).
    pub fn forget(&self, id: &BlockId) {
        self.handles.lock().remove(id);
    }

    async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        let (d, n) = names(id);
        let Some(dir) = self.dir(&d, false).await? else {
            return Ok(None);
        };
        match self.client.lookup(&dir, &n).await {
            Ok(Some((fh, attrs))) => {
                self.breaker.reset();
                let size = attrs.map(|a| a.size);
                self.remember(*id, fh);
                Ok(Some(size.unwrap_or(0)))
            }
            Ok(None) => {
                self.breaker.reset();
                self.forget(id);
                Ok(None)
            }
            Err(e) => Err(self.err(e)),
        }
    }

    async fn handle(&self, id: &BlockId, fresh: bool) -> Result<nfs_fh3> {
        if !fresh {
            if let Some(fh) = self.cached_handle(id) {
                return Ok(fh);
            }
        }
        let (d, n) = names(id);
        let dir = self
            .dir(&d, false)
            .await?
            .ok_or_else(|| UcmError::NotFound(format!("block {id} is not in {}", self.label)))?;
        match self
            .client
            .lookup(&dir, &n)
            .await
            .map_err(|e| self.err(e))?
        {
            Some((fh, _)) => {
                self.remember(*id, fh.clone());
                Ok(fh)
            }
            None => Err(UcmError::NotFound(format!(
                "block {id} is not in {}",
                self.label
            ))),
        }
    }

    async fn read_with(
        &self,
        fh: &nfs_fh3,
        offset: u64,
        len: usize,
    ) -> std::result::Result<Vec<u8>, NfsError> {
        let chunk = self.client.rtmax as usize;
        if len <= chunk {
            let mut out = Vec::with_capacity(len);
            self.client.read_into(fh, offset, len, &mut out).await?;
            return Ok(out);
        }
        // Large reads go out as concurrent chunks over several connections.
        let parts = futures::future::join_all((0..len.div_ceil(chunk)).map(|i| async move {
            let start = i * chunk;
            let n = chunk.min(len - start);
            let mut out = Vec::with_capacity(n);
            self.client
                .read_into(fh, offset + start as u64, n, &mut out)
                .await
                .map(|()| out)
        }))
        .await;
        let mut out = Vec::with_capacity(len);
        for p in parts {
            let p = p?;
            let short = p.len() < chunk;
            out.extend_from_slice(&p);
            if short {
                break;
            }
        }
        Ok(out)
    }

    async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<Vec<u8>> {
        let fh = self.handle(id, false).await?;
        match self.read_with(&fh, offset, len).await {
            Ok(v) => {
                self.breaker.reset();
                Ok(v)
            }
            Err(e) if is_stale(&e) => {
                // The file was replaced or removed since its handle was
                // cached: look it up again, once.
                self.forget(id);
                let fh = self.handle(id, true).await?;
                self.read_with(&fh, offset, len)
                    .await
                    .map_err(|e| self.err(e))
            }
            Err(e) => Err(self.err(e)),
        }
    }

    async fn create(&self, id: &BlockId, tmp: &str) -> Result<nfs_fh3> {
        let (d, _) = names(id);
        let dir = self.dir(&d, true).await?.ok_or_else(|| {
            UcmError::TaskFailed(format!("{}: directory {d} is missing", self.label))
        })?;
        self.client.create(&dir, tmp).await.map_err(|e| self.err(e))
    }

    async fn write(&self, fh: &nfs_fh3, offset: u64, data: &[u8]) -> Result<Option<writeverf3>> {
        let chunk = self.client.wtmax as usize;
        let sync = self.sync;
        let verfs = futures::future::join_all(data.chunks(chunk).enumerate().map(|(i, part)| {
            self.client
                .write(fh, offset + (i * chunk) as u64, part, sync)
        }))
        .await;
        let mut verf = None;
        for v in verfs {
            let v = v.map_err(|e| self.err(e))?;
            match verf {
                None => verf = Some(v),
                Some(prev) if prev != v => {
                    return Err(UcmError::TaskFailed(format!(
                        "{}: the server restarted during a write; the block is dropped",
                        self.label
                    )))
                }
                Some(_) => {}
            }
        }
        self.breaker.reset();
        Ok(verf)
    }

    async fn publish(
        &self,
        id: &BlockId,
        tmp: &str,
        fh: &nfs_fh3,
        verf: Option<writeverf3>,
    ) -> Result<()> {
        if !self.sync {
            let committed = self.client.commit(fh).await.map_err(|e| self.err(e))?;
            if verf.is_some_and(|v| v != committed) {
                // The server rebooted after the WRITEs: they may be lost.
                return Err(UcmError::TaskFailed(format!(
                    "{}: the server restarted before block {id} was committed; it is dropped",
                    self.label
                )));
            }
        }
        let (d, n) = names(id);
        let dir = self.dir(&d, true).await?.ok_or_else(|| {
            UcmError::TaskFailed(format!("{}: directory {d} is missing", self.label))
        })?;
        self.client
            .rename(&dir, tmp, &n)
            .await
            .map_err(|e| self.err(e))?;
        self.forget(id);
        Ok(())
    }

    async fn remove(&self, id: &BlockId, name: &str) -> Result<()> {
        let (d, _) = names(id);
        let Some(dir) = self.dir(&d, false).await? else {
            return Ok(());
        };
        self.forget(id);
        self.client
            .remove(&dir, name)
            .await
            .map_err(|e| self.err(e))
    }
}

fn io_err(op: &'static str, path: &std::path::Path, e: std::io::Error) -> UcmError {
    UcmError::os(op, path, e)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(UcmError::TaskFailed(format!("I/O thread failed: {e}"))))
}

impl LocalFs {
    /// A kernel-mounted directory; `direct` asks for O_DIRECT.
    pub fn new(root: PathBuf, direct: bool) -> Self {
        LocalFs { root, direct }
    }

    fn dir_path(&self, id: &BlockId) -> PathBuf {
        self.root.join(&id.hex()[..2])
    }

    /// Creates the 256 block directories.
    pub fn create_dirs(&self) -> Result<()> {
        for b in 0..=255u8 {
            let d = self.root.join(format!("{b:02x}"));
            match std::fs::create_dir(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err("mkdir", &d, e)),
            }
        }
        Ok(())
    }

    /// Opens a block file (a regular file, not followed) to read, or
    /// creates a new temporary (never an existing file or a symlink's
    /// target): the export is shared with other machines and users.
    fn open(&self, path: &std::path::Path, write: bool) -> std::io::Result<File> {
        let attempt = |direct: bool| {
            let flags = if direct { libc::O_DIRECT } else { 0 };
            if write {
                safe_fs::create_new(path, 0o644, flags)
            } else {
                safe_fs::open_regular(path, flags)
            }
        };
        match attempt(self.direct) {
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => attempt(false),
            r => r,
        }
    }

    async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        let dir = self.dir_path(id);
        let path = dir.join(id.hex());
        // Not followed: only a regular file at the name is a block.
        let size = |m: std::fs::Metadata| m.file_type().is_file().then_some(m.len());
        blocking(move || match std::fs::symlink_metadata(&path) {
            Ok(m) => Ok(size(m)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // The kernel client may answer from a cached negative
                // lookup; opening the directory revalidates it
                // (close-to-open), then ask again.
                let _ = File::open(&dir);
                match std::fs::symlink_metadata(&path) {
                    Ok(m) => Ok(size(m)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(io_err("stat", &path, e)),
                }
            }
            Err(e) => Err(io_err("stat", &path, e)),
        })
        .await
    }

    async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<Vec<u8>> {
        let path = self.dir_path(id).join(id.hex());
        let me = self.clone();
        blocking(move || {
            let f = me
                .open(&path, false)
                .map_err(|e| io_err("open", &path, e))?;
            let this_direct = me.direct;
            // O_DIRECT needs aligned memory, offset and length: read whole
            // 4 KiB pages into an aligned buffer (offsets are page aligned).
            let padded = crate::io::align_up(len);
            let mut buf = AlignedBuf::new(padded.max(4096));
            let want = if this_direct { padded } else { len };
            let mut done = 0usize;
            while done < want {
                match f.read_at(&mut buf[done..want], offset + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err("read", &path, e)),
                }
            }
            Ok(buf[..done.min(len)].to_vec())
        })
        .await
    }

    async fn create(&self, id: &BlockId, tmp: &str) -> Result<Arc<File>> {
        let path = self.dir_path(id).join(tmp);
        let me = self.clone();
        blocking(move || {
            let f = me.open(&path, true).map_err(|e| io_err("open", &path, e))?;
            Ok(Arc::new(f))
        })
        .await
    }

    async fn write(&self, f: &Arc<File>, offset: u64, data: Arc<AlignedBuf>) -> Result<()> {
        let f = f.clone();
        let root = self.root.clone();
        blocking(move || {
            f.write_all_at(&data, offset)
                .map_err(|e| io_err("write", &root, e))
        })
        .await
    }

    async fn publish(&self, id: &BlockId, tmp: &str, f: &Arc<File>) -> Result<()> {
        let f = f.clone();
        let dir = self.dir_path(id);
        let (from, to) = (dir.join(tmp), dir.join(id.hex()));
        blocking(move || {
            // Close-to-open: the data is on the server before the name is.
            f.sync_data().map_err(|e| io_err("fsync", &from, e))?;
            std::fs::rename(&from, &to).map_err(|e| io_err("rename", &from, e))
        })
        .await
    }

    async fn remove(&self, id: &BlockId, name: &str) -> Result<()> {
        let path = self.dir_path(id).join(name);
        blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("unlink", &path, e)),
        })
        .await
    }
}

impl Fs {
    /// Size of a published block, None if absent.
    pub async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        match self {
            Fs::Remote(r) => r.size_of(id).await,
            Fs::Local(l) => l.size_of(id).await,
        }
    }

    /// Reads `len` bytes at `offset` of a published block (fewer at its end).
    pub async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<Vec<u8>> {
        match self {
            Fs::Remote(r) => r.read(id, offset, len).await,
            Fs::Local(l) => l.read(id, offset, len).await,
        }
    }

    /// Creates a temporary file for `id` named `tmp` next to its final name.
    pub async fn create(&self, id: &BlockId, tmp: &str) -> Result<Arc<TempFile>> {
        Ok(Arc::new(match self {
            Fs::Remote(r) => TempFile::Remote(r.create(id, tmp).await?),
            Fs::Local(l) => TempFile::Local(l.create(id, tmp).await?),
        }))
    }

    /// Writes `data` at `offset` of a temporary file; returns the server's
    /// write verifier (built-in client, unstable writes).
    pub async fn write(
        &self,
        t: &TempFile,
        offset: u64,
        data: Arc<AlignedBuf>,
    ) -> Result<Option<writeverf3>> {
        match (self, t) {
            (Fs::Remote(r), TempFile::Remote(fh)) => r.write(fh, offset, &data).await,
            (Fs::Local(l), TempFile::Local(f)) => l.write(f, offset, data).await.map(|()| None),
            _ => Err(UcmError::TaskFailed(
                "temporary file of another backend".into(),
            )),
        }
    }

    /// Commits a fully written temporary file and renames it to the
    /// block's final name.
    pub async fn publish(
        &self,
        id: &BlockId,
        tmp: &str,
        t: &TempFile,
        verf: Option<writeverf3>,
    ) -> Result<()> {
        match (self, t) {
            (Fs::Remote(r), TempFile::Remote(fh)) => r.publish(id, tmp, fh, verf).await,
            (Fs::Local(l), TempFile::Local(f)) => l.publish(id, tmp, f).await,
            _ => Err(UcmError::TaskFailed(
                "temporary file of another backend".into(),
            )),
        }
    }

    /// Removes file `name` of block `id`'s directory (a temporary, or the
    /// block itself).
    pub async fn remove(&self, id: &BlockId, name: &str) -> Result<()> {
        match self {
            Fs::Remote(r) => r.remove(id, name).await,
            Fs::Local(l) => l.remove(id, name).await,
        }
    }

    /// Forgets cached knowledge of a block.
    pub fn forget(&self, id: &BlockId) {
        if let Fs::Remote(r) = self {
            r.forget(id);
        }
    }
}
