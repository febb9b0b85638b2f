//! The built-in NFSv3 client: a pool of TCP connections to one server
//! (the `nfs3_client` crate does the XDR and RPC framing), with per-request
//! timeouts, retries of idempotent requests on fresh connections, and the
//! few procedures the store needs.
//!
//! Why a pure-Rust client (`nfs3_client`) rather than libnfs: no C library
//! at build or run time (the wheel must import on machines without
//! libnfs), async on the same tokio runtime as the S3 store, and nothing it
//! lacks for this use (MOUNT, portmapper, LOOKUP/CREATE/READ/WRITE/COMMIT/
//! RENAME/REMOVE/MKDIR/FSINFO over TCP, AUTH_SYS). Tested against
//! NFS-Ganesha 4.3 (VFS FSAL).
//!
//! (One file: the connection pool and the procedures share its retry loop.)

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nfs3_client::io::{AsyncRead, AsyncWrite};
use nfs3_client::net::Connector;
use nfs3_client::nfs3_types::nfs3::{
    cookieverf3, createhow3, diropargs3, fattr3, filename3, nfs_fh3, nfsstat3, post_op_attr,
    post_op_fh3, sattr3, stable_how, writeverf3, COMMIT3args, CREATE3args, FSINFO3args,
    LOOKUP3args, MKDIR3args, Nfs3Option, Nfs3Result, READ3args, READDIRPLUS3args, REMOVE3args,
    RENAME3args, WRITE3args,
};
use nfs3_client::nfs3_types::rpc::{auth_unix, opaque_auth};
use nfs3_client::nfs3_types::xdr_codec::Opaque;
use nfs3_client::{Nfs3Client, Nfs3ConnectionBuilder, RpcError};
use parking_lot::Mutex;
use tokio::net::{TcpSocket, TcpStream};

use super::config::MountOptions;

/// A failed request.
#[derive(Debug, Clone)]
pub enum NfsError {
    /// The server could not be reached or did not answer in time (after
    /// the retries); `timeout` tells which.
    Transport {
        /// What failed and why.
        msg: String,
        /// It was a timeout.
        timeout: bool,
    },
    /// The server answered with an error status.
    Status(nfsstat3, String),
}

impl NfsError {
    /// The NFS status, if the server answered.
    pub fn status(&self) -> Option<nfsstat3> {
        match self {
            NfsError::Status(s, _) => Some(*s),
            NfsError::Transport { .. } => None,
        }
    }
}

impl std::fmt::Display for NfsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NfsError::Transport { msg, .. } => f.write_str(msg),
            NfsError::Status(s, what) => write!(f, "{what}: {s}"),
        }
    }
}

/// Result of one request.
pub type NfsResult<T> = std::result::Result<T, NfsError>;

/// A TCP connection wrapped for `nfs3_client`.
pub struct Io(TcpStream);

impl AsyncRead for Io {
    async fn async_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        tokio::io::AsyncReadExt::read(&mut self.0, buf).await
    }
}

impl AsyncWrite for Io {
    async fn async_write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        tokio::io::AsyncWriteExt::write(&mut self.0, buf).await
    }
}

/// Connects with TCP_NODELAY (requests are single writes, replies small).
struct NodelayConnector;

impl Connector for NodelayConnector {
    type Connection = Io;

    async fn connect(&self, addr: SocketAddr) -> std::io::Result<Io> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Io(s))
    }

    async fn connect_with_port(&self, addr: SocketAddr, local_port: u16) -> std::io::Result<Io> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        let local: SocketAddr = if addr.is_ipv4() {
            (std::net::Ipv4Addr::UNSPECIFIED, local_port).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, local_port).into()
        };
        socket.bind(local)?;
        let s = socket.connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Io(s))
    }
}

type Conn = Nfs3Client<Io>;

/// Largest READ/WRITE used when `rsize`/`wsize` are not given.
const DEFAULT_IO_MAX: u32 = 1 << 20;

/// A pool of connections to one NFS server, bound to one export.
pub struct Client {
    addr: IpAddr,
    nfs_port: u16,
    resvport: bool,
    cred: opaque_auth<'static>,
    pool: Mutex<Vec<Conn>>,
    permits: tokio::sync::Semaphore,
    rpc_timeout: Duration,
    retrans: u32,
    /// Handle of the export's root (or of the directory mounted).
    pub root: nfs_fh3,
    /// Largest READ, from FSINFO and `rsize`.
    pub rtmax: u32,
    /// Largest WRITE, from FSINFO and `wsize`.
    pub wtmax: u32,
    /// The server's mount path that was mounted.
    pub mounted: String,
    reconnects: AtomicU64,
}

fn transport(what: &str, e: impl std::fmt::Display) -> NfsError {
    NfsError::Transport {
        msg: format!("{what}: {e}"),
        timeout: false,
    }
}

fn auth(opts: &MountOptions) -> opaque_auth<'static> {
    // SAFETY: plain libc getters without arguments.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "ucm".into());
    let mut name = host.into_bytes();
    name.truncate(255);
    opaque_auth::auth_unix(&auth_unix {
        stamp: 0,
        machinename: Opaque::owned(name),
        uid: opts.uid.unwrap_or(uid),
        gid: opts.gid.unwrap_or(gid),
        gids: vec![],
    })
}

async fn resolve(host: &str) -> NfsResult<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let mut addrs = tokio::net::lookup_host((host, 0))
        .await
        .map_err(|e| transport(&format!("resolve {host}"), e))?;
    addrs
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| transport(&format!("resolve {host}"), "no address"))
}

fn name(s: &str) -> filename3<'_> {
    filename3(Opaque::borrowed(s.as_bytes()))
}

/// Entry `n` of directory `dir`, as the directory operations name it.
fn entry<'a>(dir: &nfs_fh3, n: &'a str) -> diropargs3<'a> {
    diropargs3 {
        dir: dir.clone(),
        name: name(n),
    }
}

fn attrs(a: post_op_attr) -> Option<fattr3> {
    match a {
        Nfs3Option::Some(f) => Some(f),
        Nfs3Option::None => None,
    }
}

/// Runs one request with the pool: a timeout per attempt, and up to
/// `retrans` retries on a fresh connection when the connection failed or
/// the server did not answer in time. `$call` is evaluated once per
/// attempt with `$c` bound to `&mut Conn`.
macro_rules! rpc {
    ($self:ident, $what:expr, $c:ident => $call:expr) => {{
        let mut attempt: u32 = 0;
        loop {
            let (permit, mut conn) = $self.checkout().await?;
            let $c = &mut conn;
            let outcome = tokio::time::timeout($self.rpc_timeout, $call).await;
            let err = match outcome {
                Ok(Ok(res)) => {
                    $self.checkin(conn);
                    drop(permit);
                    break res;
                }
                Ok(Err(e)) => {
                    let reusable = RpcError::is_connection_reusable(&e);
                    if reusable {
                        $self.checkin(conn);
                        drop(permit);
                        return Err(transport(&$what, e));
                    }
                    transport(&$what, e)
                }
                Err(_) => NfsError::Transport {
                    msg: format!("{}: no answer within {:?}", $what, $self.rpc_timeout),
                    timeout: true,
                },
            };
            drop(conn);
            drop(permit);
            attempt += 1;
            if attempt > $self.retrans {
                return Err(err);
            }
            $self.reconnects.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50u64 << attempt.min(5))).await;
        }
    }};
}

/// What a status-carrying reply turned into.
fn status<T, E>(what: &str, r: Nfs3Result<T, E>) -> NfsResult<T> {
    match r {
        Nfs3Result::Ok(v) => Ok(v),
        Nfs3Result::Err((s, _)) => Err(NfsError::Status(s, what.to_string())),
    }
}

impl Client {
    /// Mounts `path` on `host` (or, if the server refuses that path, its
    /// longest exported ancestor, then walks down to `path`, creating the
    /// missing directories when `create` is set).
    pub async fn connect(
        host: &str,
        path: &str,
        opts: &MountOptions,
        concurrency: usize,
        rpc_timeout: Duration,
        create: bool,
    ) -> NfsResult<Client> {
        let addr = resolve(host).await?;
        let cred = auth(opts);
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        let mut last_err = None;
        for keep in (0..=parts.len()).rev() {
            let mount_path = format!("/{}", parts[..keep].join("/"));
            let mut b = Nfs3ConnectionBuilder::new(NodelayConnector, addr.to_string(), &mount_path)
                .connect_from_privileged_port(opts.resvport)
                .credential(cred.clone());
            if let Some(p) = opts.mount_port {
                b = b.mount_port(p);
            }
            if let Some(p) = opts.nfs_port {
                b = b.nfs3_port(p);
            }
            let connected = tokio::time::timeout(rpc_timeout, b.mount()).await;
            let conn = match connected {
                Err(_) => {
                    return Err(NfsError::Transport {
                        msg: format!("mount {host}:{mount_path}: no answer within {rpc_timeout:?}"),
                        timeout: true,
                    })
                }
                Ok(Err(nfs3_client::ConnectError::Mount(nfs3_client::MountError::Denied(s)))) => {
                    last_err = Some(format!("mount {host}:{mount_path}: {s}"));
                    continue;
                }
                Ok(Err(e)) => return Err(transport(&format!("mount {host}:{mount_path}"), e)),
                Ok(Ok(c)) => c,
            };
            let root = conn.root_nfs_fh3();
            let nfs_port = conn.nfs3_port;
            let first = conn.into_nfs3_client();
            let mut client = Client {
                addr,
                nfs_port,
                resvport: opts.resvport,
                cred: cred.clone(),
                pool: Mutex::new(vec![first]),
                permits: tokio::sync::Semaphore::new(concurrency.max(1)),
                rpc_timeout,
                retrans: opts.retrans,
                root: root.clone(),
                rtmax: 1 << 20,
                wtmax: 1 << 20,
                mounted: mount_path.clone(),
                reconnects: AtomicU64::new(0),
            };
            let info = client.fsinfo().await?;
            // At most 1 MiB per request unless rsize/wsize ask for more:
            // larger transfers go out as concurrent requests over several
            // connections, which beats one huge RPC.
            client.rtmax = info.0.clamp(4096, opts.rsize.unwrap_or(DEFAULT_IO_MAX));
            client.wtmax = info.1.clamp(4096, opts.wsize.unwrap_or(DEFAULT_IO_MAX));
            let mut dir = root;
            for p in &parts[keep..] {
                dir = match client.lookup(&dir, p).await? {
                    Some((fh, _)) => fh,
                    None if create => client.mkdir(&dir, p).await?,
                    None => {
                        return Err(NfsError::Status(
                            nfsstat3::NFS3ERR_NOENT,
                            format!("{host}:{path}: directory {p:?} under {mount_path}"),
                        ))
                    }
                };
            }
            client.root = dir;
            return Ok(client);
        }
        Err(NfsError::Status(
            nfsstat3::NFS3ERR_NOENT,
            last_err.unwrap_or_else(|| format!("mount {host}:{path}: refused")),
        ))
    }

    async fn checkout(&self) -> NfsResult<(tokio::sync::SemaphorePermit<'_>, Conn)> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| transport("NFS client", "closed"))?;
        if let Some(c) = self.pool.lock().pop() {
            return Ok((permit, c));
        }
        let addr = SocketAddr::new(self.addr, self.nfs_port);
        let what = format!("connect to {addr}");
        let io = tokio::time::timeout(self.rpc_timeout, async {
            if self.resvport {
                let mut last = None;
                for port in (600..1024u16).rev() {
                    match NodelayConnector.connect_with_port(addr, port).await {
                        Ok(io) => return Ok(io),
                        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
                        Err(e) => return Err(e),
                    }
                }
                Err(last.unwrap_or_else(|| std::io::Error::other("no reserved port free")))
            } else {
                NodelayConnector.connect(addr).await
            }
        })
        .await
        .map_err(|_| NfsError::Transport {
            msg: format!("{what}: no answer within {:?}", self.rpc_timeout),
            timeout: true,
        })?
        .map_err(|e| transport(&what, e))?;
        Ok((
            permit,
            Nfs3Client::new_with_auth(io, self.cred.clone(), opaque_auth::default()),
        ))
    }

    fn checkin(&self, c: Conn) {
        self.pool.lock().push(c);
    }

    /// Connections replaced after a failure.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Drops every idle connection (the next request reconnects).
    pub fn reset(&self) {
        self.pool.lock().clear();
    }

    async fn fsinfo(&self) -> NfsResult<(u32, u32)> {
        let args = FSINFO3args {
            fsroot: self.root.clone(),
        };
        let res = rpc!(self, "FSINFO", c => c.fsinfo(&args));
        let ok = status("FSINFO", res)?;
        Ok((ok.rtmax.max(ok.rtpref), ok.wtmax.max(ok.wtpref)))
    }

    /// Looks `name` up in `dir`: its handle and attributes, or None.
    pub async fn lookup(
        &self,
        dir: &nfs_fh3,
        n: &str,
    ) -> NfsResult<Option<(nfs_fh3, Option<fattr3>)>> {
        let args = LOOKUP3args {
            what: entry(dir, n),
        };
        let res = rpc!(self, format!("LOOKUP {n}"), c => c.lookup(&args));
        match res {
            Nfs3Result::Ok(ok) => Ok(Some((ok.object, attrs(ok.obj_attributes)))),
            Nfs3Result::Err((nfsstat3::NFS3ERR_NOENT, _)) => Ok(None),
            Nfs3Result::Err((s, _)) => Err(NfsError::Status(s, format!("LOOKUP {n}"))),
        }
    }

    /// Creates directory `name` in `dir` (an existing one is fine).
    pub async fn mkdir(&self, dir: &nfs_fh3, n: &str) -> NfsResult<nfs_fh3> {
        let args = MKDIR3args {
            where_: entry(dir, n),
            attributes: sattr3 {
                mode: Nfs3Option::Some(0o755),
                ..Default::default()
            },
        };
        let res = rpc!(self, format!("MKDIR {n}"), c => c.mkdir(&args));
        match res {
            Nfs3Result::Ok(ok) => match ok.obj {
                post_op_fh3::Some(fh) => Ok(fh),
                post_op_fh3::None => self.lookup_dir(dir, n).await,
            },
            Nfs3Result::Err((nfsstat3::NFS3ERR_EXIST, _)) => self.lookup_dir(dir, n).await,
            Nfs3Result::Err((s, _)) => Err(NfsError::Status(s, format!("MKDIR {n}"))),
        }
    }

    async fn lookup_dir(&self, dir: &nfs_fh3, n: &str) -> NfsResult<nfs_fh3> {
        self.lookup(dir, n).await?.map(|(fh, _)| fh).ok_or_else(|| {
            NfsError::Status(nfsstat3::NFS3ERR_NOENT, format!("LOOKUP {n} after MKDIR"))
        })
    }

    /// Creates (or truncates) file `name` in `dir`, mode 0644.
    pub async fn create(&self, dir: &nfs_fh3, n: &str) -> NfsResult<nfs_fh3> {
        let args = CREATE3args {
            where_: entry(dir, n),
            how: createhow3::UNCHECKED(sattr3 {
                mode: Nfs3Option::Some(0o644),
                size: Nfs3Option::Some(0),
                ..Default::default()
            }),
        };
        let res = rpc!(self, format!("CREATE {n}"), c => c.create(&args));
        let ok = status(&format!("CREATE {n}"), res)?;
        match ok.obj {
            post_op_fh3::Some(fh) => Ok(fh),
            post_op_fh3::None => self
                .lookup(dir, n)
                .await?
                .map(|(fh, _)| fh)
                .ok_or_else(|| NfsError::Status(nfsstat3::NFS3ERR_NOENT, format!("CREATE {n}"))),
        }
    }

    /// Writes `data` at `offset` in one WRITE (`data` fits in `wtmax`);
    /// returns the server's write verifier.
    pub async fn write(
        &self,
        fh: &nfs_fh3,
        offset: u64,
        data: &[u8],
        sync: bool,
    ) -> NfsResult<writeverf3> {
        let args = WRITE3args {
            file: fh.clone(),
            offset,
            count: data.len() as u32,
            stable: if sync {
                stable_how::FILE_SYNC
            } else {
                stable_how::UNSTABLE
            },
            data: Opaque::borrowed(data),
        };
        let res = rpc!(self, "WRITE", c => c.write(&args));
        let ok = status("WRITE", res)?;
        if (ok.count as usize) < data.len() {
            // Short writes are legal; finish the rest.
            let rest = &data[ok.count as usize..];
            return Box::pin(self.write(fh, offset + u64::from(ok.count), rest, sync)).await;
        }
        Ok(ok.verf)
    }

    /// Commits everything written to stable storage; returns the verifier.
    pub async fn commit(&self, fh: &nfs_fh3) -> NfsResult<writeverf3> {
        let args = COMMIT3args {
            file: fh.clone(),
            offset: 0,
            count: 0,
        };
        let res = rpc!(self, "COMMIT", c => c.commit(&args));
        Ok(status("COMMIT", res)?.verf)
    }

    /// Reads up to `len` bytes at `offset` into `out` (appending); stops at
    /// end of file.
    pub async fn read_into(
        &self,
        fh: &nfs_fh3,
        offset: u64,
        len: usize,
        out: &mut Vec<u8>,
    ) -> NfsResult<()> {
        let mut done = 0usize;
        while done < len {
            let count = (len - done).min(self.rtmax as usize) as u32;
            let args = READ3args {
                file: fh.clone(),
                offset: offset + done as u64,
                count,
            };
            let res = rpc!(self, "READ", c => c.read(&args));
            let ok = status("READ", res)?;
            let n = ok.data.len();
            let eof = ok.eof;
            if out.is_empty() {
                // The usual single-request read: keep the reply's buffer.
                *out = ok.data.into_owned();
            } else {
                out.extend_from_slice(&ok.data);
            }
            done += n;
            if eof || n == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Renames `from` in `dir` to `to` in the same directory (atomic on
    /// the server: readers see the old name or the whole new file).
    pub async fn rename(&self, dir: &nfs_fh3, from: &str, to: &str) -> NfsResult<()> {
        let args = RENAME3args {
            from: entry(dir, from),
            to: entry(dir, to),
        };
        let res = rpc!(self, format!("RENAME {from}"), c => c.rename(&args));
        match res {
            Nfs3Result::Ok(_) => Ok(()),
            // A retried RENAME whose first attempt went through.
            Nfs3Result::Err((nfsstat3::NFS3ERR_NOENT, _))
                if self.lookup(dir, to).await?.is_some() =>
            {
                Ok(())
            }
            Nfs3Result::Err((s, _)) => Err(NfsError::Status(s, format!("RENAME {from} -> {to}"))),
        }
    }

    /// Every entry of `dir` but `.` and `..`: its name and attributes (None
    /// where the server sent none).
    pub async fn list(&self, dir: &nfs_fh3) -> NfsResult<Vec<(String, Option<fattr3>)>> {
        let mut out = Vec::new();
        let (mut cookie, mut verf) = (0, cookieverf3::default());
        loop {
            let args = READDIRPLUS3args {
                dir: dir.clone(),
                cookie,
                cookieverf: verf,
                dircount: 64 * 1024,
                maxcount: 256 * 1024,
            };
            let res = rpc!(self, "READDIRPLUS", c => c.readdirplus(&args));
            let ok = status("READDIRPLUS", res)?;
            verf = ok.cookieverf;
            for e in ok.reply.entries.0 {
                cookie = e.cookie;
                let n = String::from_utf8_lossy(&e.name.0 .0).into_owned();
                if n != "." && n != ".." {
                    out.push((n, attrs(e.name_attributes)));
                }
            }
            if ok.reply.eof {
                return Ok(out);
            }
        }
    }

    /// Removes file `name` from `dir` (a missing one is fine).
    pub async fn remove(&self, dir: &nfs_fh3, n: &str) -> NfsResult<()> {
        let args = REMOVE3args {
            object: entry(dir, n),
        };
        let res = rpc!(self, format!("REMOVE {n}"), c => c.remove(&args));
        match res {
            Nfs3Result::Ok(_) | Nfs3Result::Err((nfsstat3::NFS3ERR_NOENT, _)) => Ok(()),
            Nfs3Result::Err((s, _)) => Err(NfsError::Status(s, format!("REMOVE {n}"))),
        }
    }
}
