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

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ucm_core::store::nfs::{NfsConfig, NfsStore};
use ucm_core::store::Store;
use ucm_core::{BlockId, MemSeg, ShardIo};

const SHARD: usize = 16 * 1024;
const SHARDS: usize = 4;
const ALL: [usize; SHARDS] = [0, 1, 2, 3];

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

const CONF: &str = r#"
NFS_CORE_PARAM {
    NFS_Port = 2049;
    MNT_Port = 20048;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Protocols = 3, 4;
}
NFSV4 { Graceless = true; Only_Numeric_Owners = true; }
EXPORT {
    Export_Id = 1;
    Path = @EXPORT@;
    Pseudo = /export;
    Access_Type = RW;
    Squash = No_Root_Squash;
    Transports = TCP;
    Protocols = 3, 4;
    SecType = sys;
    FSAL { Name = VFS; }
}
"#;

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
        let rpcbind = Command::new("nsenter")
            .args([
                "--target",
                &holder.id().to_string(),
                "--net",
                "--mount",
                "--",
            ])
            .args(["rpcbind", "-f", "-w"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rpcbind");
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
        let child = Command::new("nsenter")
            .args([
                "--target",
                &self.holder.id().to_string(),
                "--net",
                "--mount",
                "--",
            ])
            .arg(&self.ganesha_bin)
            .args(["-F", "-N", "NIV_EVENT", "-L"])
            .arg(d.join("ganesha.log"))
            .arg("-f")
            .arg(d.join("ganesha.conf"))
            .arg("-p")
            .arg(d.join("ganesha.pid"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("ganesha");
        self.ganesha = Some(child);
        // Ready when the NFS port accepts, seen from inside the namespace.
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
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
            if ok || logged {
                std::thread::sleep(Duration::from_millis(200));
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
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
        block_size: SHARD * SHARDS,
        shard_size: SHARD,
        tensor_size_list: vec![SHARD / 2, SHARD / 2],
        timeout_ms: 10_000,
        ..Default::default()
    }
}

fn id(n: u32) -> BlockId {
    let mut b = [0xa5u8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    BlockId(b)
}

struct Blocks {
    data: Vec<Vec<u8>>,
}

impl Blocks {
    fn filled(ids: &[u32]) -> Self {
        Blocks {
            data: ids
                .iter()
                .map(|&b| {
                    (0..SHARD * SHARDS)
                        .map(|i| (i as u32).wrapping_mul(2246822519).wrapping_add(b) as u8)
                        .collect()
                })
                .collect(),
        }
    }

    fn zeroed(n: usize) -> Self {
        Blocks {
            data: vec![vec![0u8; SHARD * SHARDS]; n],
        }
    }

    fn shards(&mut self, ids: &[u32], which: &[usize]) -> Vec<ShardIo> {
        let mut out = Vec::new();
        for (i, &b) in ids.iter().enumerate() {
            for &s in which {
                let base = self.data[i].as_mut_ptr() as usize + s * SHARD;
                out.push(ShardIo {
                    block: id(b),
                    index: s,
                    segs: vec![
                        MemSeg {
                            addr: base,
                            len: SHARD / 2,
                        },
                        MemSeg {
                            addr: base + SHARD / 2,
                            len: SHARD / 2,
                        },
                    ],
                });
            }
        }
        out
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
    let ids = [1, 2, 3];
    assert_eq!(a.lookup(&[id(1), id(2)]).unwrap(), vec![false, false]);
    let mut src = Blocks::filled(&ids);
    let t = a.dump(src.shards(&ids, &ALL), 0).unwrap();
    a.wait(t).unwrap();
    assert_eq!(
        b.lookup(&[id(1), id(9), id(3)]).unwrap(),
        vec![true, false, true]
    );
    assert_eq!(
        b.lookup_on_prefix(&[id(1), id(2), id(9), id(3)]).unwrap(),
        1
    );
    let mut dst = Blocks::zeroed(3);
    let t = b.load(dst.shards(&ids, &ALL)).unwrap();
    b.wait(t).unwrap();
    assert_eq!(src.data, dst.data);
    // on disk: Posix block files, no temporaries left
    let file = root.join(NfsStore::block_rel_path(&id(1)));
    let bytes = std::fs::read(&file).expect("block file");
    assert_eq!(bytes.len() as u64, a.layout().file_len());
    assert_eq!(&bytes[..8], b"UCMKVBLK");
    assert_eq!(temps(root), 0);
    // a missing block: NotFound
    let mut none = Blocks::zeroed(1);
    let t = b.load(none.shards(&[77], &[0])).unwrap();
    assert_eq!(b.wait(t).unwrap_err().code(), -50005);

    // layer-wise: one task per shard, out of order; invisible until whole
    let ids = [10];
    let mut src = Blocks::filled(&ids);
    for s in [2, 0, 3] {
        let t = a.dump(src.shards(&ids, &[s]), 0).unwrap();
        a.wait(t).unwrap();
        assert_eq!(b.lookup(&[id(10)]).unwrap(), vec![false]);
    }
    assert_eq!(temps(root), 1, "one temporary while assembling");
    let t = a.dump(src.shards(&ids, &[1]), 0).unwrap();
    a.wait(t).unwrap();
    assert_eq!(temps(root), 0);
    assert_eq!(b.lookup(&[id(10)]).unwrap(), vec![true]);
    let mut dst = Blocks::zeroed(1);
    let t = b.load(dst.shards(&ids, &[3, 1, 0, 2])).unwrap();
    b.wait(t).unwrap();
    assert_eq!(src.data, dst.data);

    // a corrupted file is refused (caller memory untouched) and removed
    let file = root.join(NfsStore::block_rel_path(&id(2)));
    let mut bytes = std::fs::read(&file).unwrap();
    let off = a.layout().offset(1) as usize + 4096 + 7;
    bytes[off] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let c = make();
    let mut dst = Blocks::zeroed(1);
    let t = c.load(dst.shards(&[2], &[1])).unwrap();
    assert_eq!(c.wait(t).unwrap_err().code(), -50011);
    assert!(dst.data[0].iter().all(|&x| x == 0));
    assert!(!file.exists());
    assert_eq!(c.lookup(&[id(2)]).unwrap(), vec![false]);
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
    let e = NfsStore::open(cfg).err().expect("error");
    assert!(e.to_string().contains("storage_backends"), "{e}");
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
    let e = NfsStore::open(cfg).err().expect("error");
    assert!(e.to_string().contains("storage_backends"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // faults: explicit ports (no portmapper), short timeouts
    let mut cfg = config(&g.url("kv"));
    cfg.mount_options = "port=2049,mountport=20048,timeo=5,retrans=1".into();
    cfg.timeout_ms = 1500;
    cfg.lookup_cache_ttl_ms = 0;
    let s = NfsStore::open(cfg).expect("open");
    let ids = [40];
    let mut src = Blocks::filled(&ids);
    let t = s.dump(src.shards(&ids, &ALL), 0).unwrap();
    s.wait(t).unwrap();

    // slow server: every call comes back within the timeouts
    g.signal("-STOP");
    if let Some(c) = &g.ganesha {
        let _ = Command::new("ps")
            .args(["-o", "pid,stat,comm", "-p", &c.id().to_string()])
            .status();
    }
    let started = Instant::now();
    let mut dst = Blocks::zeroed(1);
    let t = s.load(dst.shards(&ids, &ALL)).unwrap();
    let e = s.wait(t).unwrap_err();
    assert!(matches!(e.code(), -50010 | -1), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(s.lookup(&[id(40)]).unwrap(), vec![false]);
    g.signal("-CONT");

    // stopped server: failures, no hang; blocks survive its restart
    g.stop_server();
    let started = Instant::now();
    let t = s.load(dst.shards(&ids, &ALL)).unwrap();
    assert!(s.wait(t).is_err());
    let mut more = Blocks::filled(&[41]);
    let t = s.dump(more.shards(&[41], &ALL), 0).unwrap();
    assert!(s.wait(t).is_err());
    assert_eq!(s.lookup(&[id(40)]).unwrap(), vec![false]);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    g.start_server();
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let t = s.dump(more.shards(&[41], &ALL), 0).unwrap();
        if s.wait(t).is_ok() {
            break;
        }
        assert!(Instant::now() < until, "dumps never recovered");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(s.lookup(&[id(40), id(41)]).unwrap(), vec![true, true]);
    let mut back = Blocks::zeroed(1);
    let t = s.load(back.shards(&ids, &ALL)).unwrap();
    s.wait(t).unwrap();
    assert_eq!(back.data, src.data);
    assert!(s.stats()["breaker_trips"] >= 1.0);
    s.close().unwrap();
}
