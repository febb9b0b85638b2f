//! The NFS store against a real NFS server: NFS-Ganesha 4.3 (VFS FSAL)
//! exporting a temporary directory over NFSv3, with rpcbind, inside a
//! private network and mount namespace the test creates (`unshare`), so
//! nothing listens outside it. The test thread joins the network namespace
//! (`setns`) before opening the store, and the store's threads inherit it.
//!
//! Skipped, with a message, only when `ganesha.nfsd`, `rpcbind`,
//! `unshare` or `nsenter` is missing or the tests do not run as root (CI
//! installs the Debian packages listed in tools/apt-packages.txt). The
//! mounted-directory mode needs no server and always runs.

#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::remote::{
    corrupt_load_is_refused, dump_layer_wise, id, open_fails_naming, round_trip, survive_outage,
    TestServer, SHARD, SHARDS,
};
use common::server::{poll, spawn_quiet};
use ucm_core::config::Geometry;
use ucm_core::store::nfs::{NfsConfig, NfsStore};
use ucm_core::store::Store;

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|d| d.join(bin))
            .find(|p| p.exists())
    })
}

struct Ganesha {
    holder: Child,
    rpcbind: Child,
    ganesha: Option<Child>,
    dir: tempfile::TempDir,
    ganesha_bin: PathBuf,
}

// One export for the Rust and the Python NFS tests alike.
const CONF: &str = include_str!("../../../tools/nfs/ganesha-test.conf");

/// A command run inside the network and mount namespaces `holder` keeps.
fn in_namespace(holder: &Child) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.args([
        "--target",
        &holder.id().to_string(),
        "--net",
        "--mount",
        "--",
    ]);
    cmd
}

impl Ganesha {
    fn start() -> Option<Ganesha> {
        let bins: Vec<_> = ["ganesha.nfsd", "rpcbind", "unshare", "nsenter", "ip"]
            .iter()
            .map(|b| (b, which(b)))
            .collect();
        if let Some((b, _)) = bins.iter().find(|(_, p)| p.is_none()) {
            eprintln!(
                "{b} not found (apt-get install nfs-ganesha nfs-ganesha-vfs rpcbind); skipping"
            );
            return None;
        }
        // SAFETY: plain getter.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("the NFS server tests need root (network namespaces); skipping");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let export = dir.path().join("export");
        std::fs::create_dir(&export).expect("mkdir export");
        std::fs::write(
            dir.path().join("ganesha.conf"),
            CONF.replace("@EXPORT@", &export.display().to_string()),
        )
        .expect("write conf");
        let mut holder = Command::new("unshare")
            .args([
                "--net",
                "--mount",
                "--",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /run && mkdir -p /run/rpcbind && \
                 (mount -t tmpfs tmpfs /var/lib/nfs 2>/dev/null || true) && \
                 ip link set lo up && echo ready && exec sleep infinity",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare");
        let mut line = String::new();
        if let Some(out) = holder.stdout.take() {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        assert_eq!(line.trim(), "ready", "namespace setup failed");
        let rpcbind = spawn_quiet(
            in_namespace(&holder).args(["rpcbind", "-f", "-w"]),
            "rpcbind",
        );
        let mut g = Ganesha {
            holder,
            rpcbind,
            ganesha: None,
            ganesha_bin: which("ganesha.nfsd").expect("checked"),
            dir,
        };
        std::thread::sleep(Duration::from_millis(200));
        g.start_server();
        Some(g)
    }

    fn netns(&self) -> String {
        format!("/proc/{}/ns/net", self.holder.id())
    }

    /// Moves the calling thread (and the threads it starts later) into the
    /// server's network namespace.
    fn enter(&self) {
        let f = std::fs::File::open(self.netns()).expect("open netns");
        // SAFETY: a valid namespace fd; affects only this thread.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }

    fn start_server(&mut self) {
        let d = self.dir.path();
        let child = spawn_quiet(
            in_namespace(&self.holder)
                .arg(&self.ganesha_bin)
                .args(["-F", "-N", "NIV_EVENT", "-L"])
                .arg(d.join("ganesha.log"))
                .arg("-f")
                .arg(d.join("ganesha.conf"))
                .arg("-p")
                .arg(d.join("ganesha.pid")),
            "ganesha",
        );
        self.ganesha = Some(child);
        // Ready when the NFS port accepts, seen from inside the namespace.
        let up = poll(Duration::from_secs(30), Duration::from_millis(100), || {
            let ok = Command::new("nsenter")
                .args(["--target", &self.holder.id().to_string(), "--net", "--"])
                .args(["sh", "-c", "exec 3<>/dev/tcp/127.0.0.1/2049"])
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            // `sh` may lack /dev/tcp; fall back on the log line.
            let logged = std::fs::read_to_string(d.join("ganesha.log"))
                .map(|l| l.contains("NFS SERVER INITIALIZED"))
                .unwrap_or(false);
            ok || logged
        });
        if up {
            std::thread::sleep(Duration::from_millis(200));
            return;
        }
        panic!(
            "ganesha did not start; see {}",
            d.join("ganesha.log").display()
        );
    }

    fn stop_server(&mut self) {
        if let Some(mut c) = self.ganesha.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(self.dir.path().join("ganesha.log"));
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.ganesha {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
        }
    }

    fn export(&self) -> PathBuf {
        self.dir.path().join("export")
    }

    fn url(&self, sub: &str) -> String {
        format!("nfs://127.0.0.1{}/{sub}", self.export().display())
    }
}

impl TestServer for Ganesha {
    fn pause(&mut self) {
        self.signal("-STOP");
        if let Some(c) = &self.ganesha {
            let _ = Command::new("ps")
                .args(["-o", "pid,stat,comm", "-p", &c.id().to_string()])
                .status();
        }
    }

    fn resume(&mut self) {
        self.signal("-CONT");
    }

    fn stop(&mut self) {
        self.stop_server();
    }

    fn restart(&mut self) {
        self.start_server();
    }
}

impl Drop for Ganesha {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.stop_server();
        for c in [&mut self.rpcbind, &mut self.holder] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn config(target: &str) -> NfsConfig {
    NfsConfig {
        target: target.into(),
        geometry: Geometry {
            block_size: SHARD * SHARDS,
            shard_size: SHARD,
            tensor_size_list: vec![SHARD / 2, SHARD / 2],
        },
        timeout_ms: 10_000,
        ..Default::default()
    }
}

fn temps(root: &Path) -> usize {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|d| d.path().is_dir())
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .filter(|f| f.file_name().to_string_lossy().contains(".tmp."))
        .count()
}

/// Round trip, lookups, layer-wise assembly across two stores ("nodes"),
/// corruption; the same checks for both ways of reaching an export.
fn exercise(make: &dyn Fn() -> NfsStore, root: &Path) {
    let a = make();
    let b = make();
    round_trip(&a, &b);
    // on disk: Posix block files, no temporaries left
    let file = root.join(NfsStore::block_rel_path(&id(1)));
    let bytes = std::fs::read(&file).expect("block file");
    assert_eq!(bytes.len() as u64, a.layout().file_len());
    assert_eq!(&bytes[..8], b"UCMKVBLK");
    assert_eq!(temps(root), 0);

    // layer-wise: invisible until whole, one temporary while assembling
    dump_layer_wise(&a, &b, &[10], &|| {
        assert_eq!(temps(root), 1, "one temporary while assembling");
    });
    assert_eq!(temps(root), 0);

    // a corrupted file is refused (caller memory untouched) and removed
    let file = root.join(NfsStore::block_rel_path(&id(2)));
    let mut bytes = std::fs::read(&file).unwrap();
    let off = a.layout().offset(1) as usize + 4096 + 7;
    bytes[off] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let c = make();
    corrupt_load_is_refused(&c, 2, 1);
    assert!(!file.exists());
    for s in [a, b, c] {
        s.close().unwrap();
    }
}

#[test]
fn mounted_directory_round_trip() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().to_path_buf();
    let target = root.display().to_string();
    exercise(&|| NfsStore::open(config(&target)).expect("open"), &root);
    let mut cfg = config(&root.join("missing").display().to_string());
    cfg.device_id = 0;
    open_fails_naming(NfsStore::open(cfg), "storage_backends");
}

#[test]
fn ganesha_round_trip_faults_and_errors() {
    let Some(mut g) = Ganesha::start() else {
        return;
    };
    g.enter();
    let url = g.url("kv");
    let root = g.export().join("kv");
    exercise(&|| NfsStore::open(config(&url)).expect("open"), &root);

    // an export that does not exist, a server that is not there
    let e = NfsStore::open(config("nfs://127.0.0.1/no/such/export"))
        .err()
        .expect("error");
    assert!(e.to_string().contains("storage_backends"), "{e}");
    let mut cfg = config(&g.url("kv"));
    cfg.mount_options = "port=3049,mountport=3048,timeo=5,retrans=0".into();
    let started = Instant::now();
    open_fails_naming(NfsStore::open(cfg), "storage_backends");
    assert!(started.elapsed() < Duration::from_secs(5));

    // faults: explicit ports (no portmapper), short timeouts
    let mut cfg = config(&g.url("kv"));
    cfg.mount_options = "port=2049,mountport=20048,timeo=5,retrans=1".into();
    cfg.timeout_ms = 1500;
    cfg.lookup_cache_ttl_ms = 0;
    let s = NfsStore::open(cfg).expect("open");
    // blocks survive the server's restart
    survive_outage(&s, &mut g, 40, 41, true, Duration::from_secs(15));
    s.close().unwrap();
}
