//! Configuration of the NFS store: where the export is and which of the
//! usual `mount -o` options apply.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{ConfigError, Geometry, Values};
use crate::error::{Result, UcmError};

/// The NFS stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`), declared in `config/keys.toml`.
pub use crate::config::keys::NFS as KEYS;
use crate::store::remote::expand_env;

/// NFS store settings. Field names follow the config keys.
#[derive(Clone, Debug)]
pub struct NfsConfig {
    /// `nfs://server[:port]/export/path[?options]` (the built-in NFSv3
    /// client: no kernel mount, no root needed), or the path of a directory
    /// on an NFS export the kernel already mounted (`storage_backends`).
    pub target: String,
    /// `mount -o` style options (`nfs_mount_options`), e.g.
    /// `"vers=3,port=2049,mountport=20048,timeo=50,retrans=2"`; see
    /// [`MountOptions`] for those that apply. Unknown ones are logged and
    /// ignored.
    pub mount_options: String,
    /// Requests in flight at most, which is also the number of connections
    /// the built-in client opens (`nfs_max_concurrency`).
    pub max_concurrency: usize,
    /// Task timeout counted from submit; 0 = none.
    pub timeout_ms: u64,
    /// How long a "present" lookup result (and the file handle found with
    /// it) is reused (`nfs_lookup_cache_ttl_ms`); 0 disables. Absent
    /// results are never reused: another engine's new block is seen at the
    /// next lookup.
    pub lookup_cache_ttl_ms: u64,
    /// O_DIRECT on a kernel-mounted path (off unless asked: NFS clients
    /// differ in what they accept).
    pub io_direct: bool,
    /// Runtime threads (`nfs_io_threads`).
    pub io_threads: usize,
    /// Block, shard and tensor sizes.
    pub geometry: Geometry,
    /// -1: lookup-only role (load and dump refused); >= 0: transfers on.
    pub device_id: i64,
}

impl Default for NfsConfig {
    fn default() -> Self {
        NfsConfig {
            target: String::new(),
            mount_options: String::new(),
            max_concurrency: 8,
            timeout_ms: 30_000,
            lookup_cache_ttl_ms: 30_000,
            io_direct: false,
            io_threads: 2,
            geometry: Geometry::default(),
            device_id: 0,
        }
    }
}

impl NfsConfig {
    /// Builds the config from a checked NFS stage (see [`crate::config`]).
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let geometry = Geometry::from_values(v)?;
        Ok(NfsConfig {
            target: v.text("storage_backends").trim().to_string(),
            mount_options: v.text("nfs_mount_options").to_string(),
            max_concurrency: v.usize("nfs_max_concurrency"),
            timeout_ms: v.u64("timeout_ms"),
            lookup_cache_ttl_ms: v.u64("nfs_lookup_cache_ttl_ms"),
            io_direct: v.bool("io_direct"),
            io_threads: v.usize("nfs_io_threads"),
            geometry,
            device_id: v.int("device_id"),
        })
    }
}

/// Where the blocks live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The built-in NFSv3 client.
    Remote {
        /// Server host name or address.
        host: String,
        /// Path on the server (the export, possibly followed by a
        /// directory inside it).
        path: String,
    },
    /// A directory on a kernel-mounted export.
    Mounted(PathBuf),
}

/// The `mount -o` options the built-in client honours (the rest are
/// logged and ignored: `rw`, `hard`, `nolock`, `noac`, ... have no meaning
/// for a client that caches nothing but handles of published blocks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// `port=` / URL `nfsport=`: NFS port (else the portmapper's answer).
    pub nfs_port: Option<u16>,
    /// `mountport=`: MOUNT port (else the portmapper's answer).
    pub mount_port: Option<u16>,
    /// `timeo=` in tenths of a second: per-request timeout.
    pub timeo: Option<Duration>,
    /// `retrans=`: retries of a request that timed out or lost its
    /// connection (only idempotent requests are retried).
    pub retrans: u32,
    /// `rsize=` / `wsize=`: largest READ / WRITE (else 1 MiB, or less if
    /// the server says so).
    pub rsize: Option<u32>,
    /// See `rsize`.
    pub wsize: Option<u32>,
    /// `sync`: every WRITE is FILE_SYNC (else UNSTABLE plus one COMMIT
    /// before the block is published).
    pub sync: bool,
    /// `ro`: lookups and loads only.
    pub read_only: bool,
    /// `resvport` (default `noresvport`): connect from a port below 1024
    /// (needs root; some servers insist).
    pub resvport: bool,
    /// `uid=` / `gid=`: AUTH_SYS identity (else the process's).
    pub uid: Option<u32>,
    /// See `uid`.
    pub gid: Option<u32>,
    /// `lookupcache=none` disables the positive lookup cache too.
    pub lookupcache_none: bool,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            nfs_port: None,
            mount_port: None,
            timeo: None,
            retrans: 2,
            rsize: None,
            wsize: None,
            sync: false,
            read_only: false,
            resvport: false,
            uid: None,
            gid: None,
            lookupcache_none: false,
        }
    }
}

fn num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T> {
    v.parse()
        .map_err(|_| UcmError::invalid(format!("nfs_mount_options: {key}={v:?} is not a number")))
}

impl MountOptions {
    /// Applies one `key[=value]` option; unknown ones are returned.
    fn apply(&mut self, opt: &str) -> Result<Option<String>> {
        let opt = opt.trim();
        if opt.is_empty() {
            return Ok(None);
        }
        let (k, v) = opt.split_once('=').unwrap_or((opt, ""));
        match k {
            "vers" | "nfsvers" | "version" => {
                if v != "3" {
                    return Err(UcmError::Unsupported(format!(
                        "nfs_mount_options: {k}={v}: the built-in client speaks NFSv3 only \
                         (mount the export with the kernel client for other versions)"
                    )));
                }
            }
            "proto" | "mountproto" => {
                if v != "tcp" {
                    return Err(UcmError::Unsupported(format!(
                        "nfs_mount_options: {k}={v}: only tcp is supported"
                    )));
                }
            }
            "tcp" => {}
            "udp" => {
                return Err(UcmError::Unsupported(
                    "nfs_mount_options: udp: only tcp is supported".into(),
                ))
            }
            "port" | "nfsport" => self.nfs_port = Some(num(k, v)?).filter(|p| *p != 0),
            "mountport" => self.mount_port = Some(num(k, v)?).filter(|p| *p != 0),
            "timeo" => {
                let ds: u64 = num(k, v)?;
                self.timeo = Some(Duration::from_millis(ds.max(1) * 100));
            }
            "retrans" => self.retrans = num(k, v)?,
            "rsize" => self.rsize = Some(num::<u32>(k, v)?.max(4096)),
            "wsize" => self.wsize = Some(num::<u32>(k, v)?.max(4096)),
            "sync" => self.sync = true,
            "async" => self.sync = false,
            "ro" => self.read_only = true,
            "rw" => self.read_only = false,
            "resvport" => self.resvport = true,
            "noresvport" => self.resvport = false,
            "uid" => self.uid = Some(num(k, v)?),
            "gid" => self.gid = Some(num(k, v)?),
            "lookupcache" => self.lookupcache_none = v == "none",
            _ => return Ok(Some(opt.to_string())),
        }
        Ok(None)
    }

    /// Parses a comma-separated option string (and URL query options,
    /// `&`-separated, which take precedence).
    pub fn parse(options: &str, url_query: &str) -> Result<(Self, Vec<String>)> {
        let mut m = MountOptions::default();
        let mut ignored = Vec::new();
        for opt in options.split(',').chain(url_query.split('&')) {
            if let Some(o) = m.apply(opt)? {
                ignored.push(o);
            }
        }
        Ok((m, ignored))
    }
}

impl NfsConfig {
    /// Splits `target` into where the blocks live and the URL's options.
    pub fn parse_target(&self) -> Result<(Target, String)> {
        let target = expand_env("storage_backends", self.target.trim())?;
        let Some(rest) = target.strip_prefix("nfs://") else {
            if target.contains("://") {
                return Err(UcmError::invalid(format!(
                    "storage_backends: {target:?}: expected nfs://server/export/path or a \
                     directory on a mounted export"
                )));
            }
            if target.is_empty() {
                return Err(UcmError::invalid(
                    "storage_backends: the NFS store needs nfs://server/export/path or a \
                     directory on a mounted export",
                ));
            }
            return Ok((Target::Mounted(PathBuf::from(target)), String::new()));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            match v6.split_once(']') {
                Some((h, p)) => (h.to_string(), p.strip_prefix(':')),
                None => {
                    return Err(UcmError::invalid(format!(
                        "storage_backends: {target:?}: unterminated IPv6 address"
                    )))
                }
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() {
            return Err(UcmError::invalid(format!(
                "storage_backends: {target:?}: no server named"
            )));
        }
        let mut query = query.to_string();
        if let Some(p) = port {
            // `nfs://server:2049/...`: the NFS port.
            query = format!("port={p}&{query}");
        }
        let path = format!("/{}", path.trim_matches('/'));
        if path.split('/').any(|p| p == "." || p == "..") {
            return Err(UcmError::invalid(format!(
                "storage_backends: {target:?}: '.' and '..' are not allowed in the path"
            )));
        }
        Ok((Target::Remote { host, path }, query))
    }

    /// Checks sizes and keys; errors name the key and the value.
    pub fn validate(&self) -> Result<(Target, MountOptions, Vec<String>)> {
        let (target, query) = self.parse_target()?;
        let (opts, ignored) = MountOptions::parse(&self.mount_options, &query)?;
        self.geometry.validate()?;
        if self.max_concurrency == 0 {
            return Err(UcmError::invalid("nfs_max_concurrency: must be > 0"));
        }
        if self.io_threads == 0 {
            return Err(UcmError::invalid("nfs_io_threads: must be > 0"));
        }
        Ok((target, opts, ignored))
    }

    /// True when loads and dumps are allowed.
    pub fn transfers_enabled(&self) -> bool {
        self.device_id >= 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(target: &str, opts: &str) -> NfsConfig {
        NfsConfig {
            target: target.into(),
            mount_options: opts.into(),
            geometry: Geometry {
                block_size: 8192,
                shard_size: 4096,
                tensor_size_list: vec![4096],
            },
            ..Default::default()
        }
    }

    #[test]
    fn targets() {
        let (t, q) = cfg("nfs://10.0.0.5/exports/kv/", "")
            .parse_target()
            .unwrap();
        assert_eq!(
            t,
            Target::Remote {
                host: "10.0.0.5".into(),
                path: "/exports/kv".into()
            }
        );
        assert_eq!(q, "");
        let (t, q) = cfg("nfs://[::1]:2049/x?mountport=20048", "")
            .parse_target()
            .unwrap();
        assert!(matches!(t, Target::Remote { ref host, .. } if host == "::1"));
        assert_eq!(q, "port=2049&mountport=20048");
        let (t, _) = cfg("/mnt/nfs/kv", "").parse_target().unwrap();
        assert_eq!(t, Target::Mounted(PathBuf::from("/mnt/nfs/kv")));
        for bad in ["nfs:///x", "s3://b/x", "", "nfs://h/a/../b", "nfs://[::1/x"] {
            assert!(cfg(bad, "").parse_target().is_err(), "{bad}");
        }
    }

    #[test]
    fn mount_options() {
        let (t, o, ignored) = cfg(
            "nfs://h/e?nfsport=3049",
            "rw,sync,vers=3,port=2049,mountport=20048,timeo=15,retrans=5,wsize=65536,hard,uid=7",
        )
        .validate()
        .unwrap();
        assert!(matches!(t, Target::Remote { .. }));
        assert_eq!(o.nfs_port, Some(3049), "URL options win");
        assert_eq!(o.mount_port, Some(20048));
        assert_eq!(o.timeo, Some(Duration::from_millis(1500)));
        assert_eq!(
            (o.retrans, o.wsize, o.sync, o.uid),
            (5, Some(65536), true, Some(7))
        );
        assert_eq!(ignored, vec!["hard".to_string()]);
        assert!(cfg("nfs://h/e", "vers=4.1").validate().is_err());
        assert!(cfg("nfs://h/e", "proto=udp").validate().is_err());
        let e = cfg("nfs://h/e", "port=abc").validate().unwrap_err();
        assert!(e.to_string().contains("port"), "{e}");
    }
}
