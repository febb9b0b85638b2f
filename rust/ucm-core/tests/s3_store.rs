//! The S3 store against a real S3-compatible server: `moto_server` (PyPI
//! `moto[server]`) started on a free 127.0.0.1 port by the tests. Skipped,
//! with a message, only when no `moto_server` binary can be found (CI
//! installs it through requirements-dev.txt into `.venv`).

#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ucm_core::store::s3::{S3Config, S3Store};
use ucm_core::store::Store;
use ucm_core::{BlockId, MemSeg, ShardIo};

const SHARD: usize = 16 * 1024;
const SHARDS: usize = 4;
static BUCKETS: AtomicUsize = AtomicUsize::new(0);

fn moto_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("MOTO_SERVER") {
        return Some(PathBuf::from(p));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/moto_server");
    if venv.exists() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("moto_server"))
            .find(|p| p.exists())
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A raw HTTP/1.1 request to 127.0.0.1:port. moto checks no signature by
/// default but routes a request by the service named in its credential
/// scope, hence the dummy `Authorization` header.
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\nAuthorization: AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body_at = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |p| p + 4);
    Ok((status, out[body_at..].to_vec()))
}

/// Waits until every thread of `pid` is stopped (SIGSTOP takes effect
/// asynchronously; a request already being served could still complete).
fn wait_stopped(pid: u32) {
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let all = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .all(|t| {
                std::fs::read_to_string(t.path().join("stat"))
                    .ok()
                    .and_then(|s| {
                        s.rsplit(')')
                            .next()
                            .map(|r| r.trim_start().starts_with('T'))
                    })
                    .unwrap_or(true)
            });
        if all {
            std::thread::sleep(Duration::from_millis(50));
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

struct Moto {
    child: Option<Child>,
    port: u16,
    bin: PathBuf,
}

impl Moto {
    fn start() -> Option<Moto> {
        let Some(bin) = moto_binary() else {
            eprintln!("moto_server not found (pip install 'moto[server]'); skipping");
            return None;
        };
        let mut m = Moto {
            child: None,
            port: free_port(),
            bin,
        };
        m.restart();
        Some(m)
    }

    fn restart(&mut self) {
        let child = Command::new(&self.bin)
            .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn moto_server");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if matches!(http(self.port, "GET", "/", b""), Ok((200, _))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("moto_server did not start on port {}", self.port);
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
            if sig == "-STOP" {
                wait_stopped(c.id());
            }
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn bucket(&self) -> String {
        let name = format!("ucm-test-{}", BUCKETS.fetch_add(1, Ordering::Relaxed));
        let (status, _) = http(self.port, "PUT", &format!("/{name}"), b"").expect("create bucket");
        assert_eq!(status, 200, "create bucket");
        name
    }

    fn config(&self, bucket: &str) -> S3Config {
        S3Config {
            url: format!("s3://{bucket}/kv/cache"),
            endpoint: self.endpoint(),
            access_key: "testing".into(),
            secret_key: "testing".into(),
            block_size: SHARD * SHARDS,
            shard_size: SHARD,
            tensor_size_list: vec![SHARD / 2, SHARD / 2],
            timeout_ms: 10_000,
            retries: 2,
            negative_cache_ttl_ms: 0,
            ..Default::default()
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.stop();
    }
}

fn id(n: u32) -> BlockId {
    let mut b = [0x5au8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    BlockId(b)
}

/// Host memory for `blocks` whole blocks, filled deterministically.
struct Blocks {
    data: Vec<Vec<u8>>,
}

impl Blocks {
    fn filled(ids: &[u32]) -> Self {
        let data = ids
            .iter()
            .map(|&b| {
                (0..SHARD * SHARDS)
                    .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(b) as u8)
                    .collect()
            })
            .collect();
        Blocks { data }
    }

    fn zeroed(n: usize) -> Self {
        Blocks {
            data: vec![vec![0u8; SHARD * SHARDS]; n],
        }
    }

    /// Shards of block `i` (id `ids[i]`) with the given indices.
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

const ALL: [usize; SHARDS] = [0, 1, 2, 3];

#[test]
fn round_trip_lookup_and_layout() {
    let Some(moto) = Moto::start() else { return };
    let bucket = moto.bucket();
    let store = S3Store::open(moto.config(&bucket)).expect("open");
    let ids = [1, 2, 3];
    assert_eq!(store.lookup(&[id(1), id(2)]).unwrap(), vec![false, false]);
    let mut src = Blocks::filled(&ids);
    let t = store.dump(src.shards(&ids, &ALL), 0).unwrap();
    store.wait(t).unwrap();
    assert_eq!(
        store.lookup(&[id(1), id(9), id(3)]).unwrap(),
        vec![true, false, true]
    );
    assert_eq!(
        store
            .lookup_on_prefix(&[id(1), id(2), id(9), id(3)])
            .unwrap(),
        1
    );
    assert_eq!(store.lookup_on_prefix(&[]).unwrap(), -1);
    let mut dst = Blocks::zeroed(3);
    let t = store.load(dst.shards(&ids, &ALL)).unwrap();
    store.wait(t).unwrap();
    assert_eq!(src.data, dst.data);
    // single shards, out of order, duplicated
    let mut one = Blocks::zeroed(1);
    let t = store.load(one.shards(&[2], &[3, 1, 3])).unwrap();
    store.wait(t).unwrap();
    assert_eq!(one.data[0][SHARD..2 * SHARD], src.data[1][SHARD..2 * SHARD]);
    assert_eq!(one.data[0][3 * SHARD..], src.data[1][3 * SHARD..]);
    // The object is a Posix block file: header magic at every stride.
    let key = store.object_key(&id(1));
    let (status, body) = http(moto.port, "GET", &format!("/{bucket}/{key}"), b"").unwrap();
    assert_eq!(status, 200);
    assert_eq!(body.len() as u64, store.layout().file_len());
    for s in 0..SHARDS {
        let off = store.layout().offset(s) as usize;
        assert_eq!(&body[off..off + 8], b"UCMKVBLK");
    }
    // a missing block fails the load with NotFound
    let mut none = Blocks::zeroed(1);
    let t = store.load(none.shards(&[77], &[0])).unwrap();
    assert_eq!(store.wait(t).unwrap_err().code(), -50005);
    // repeated lookups are answered from the cache
    let heads = store.stats()["head_requests"];
    for _ in 0..5 {
        store.lookup_on_prefix(&[id(1), id(2), id(3)]).unwrap();
    }
    assert_eq!(store.stats()["head_requests"], heads);
    store.close().unwrap();
    assert_eq!(store.lookup(&[id(1)]).unwrap_err().code(), -50012);
}

#[test]
fn layer_wise_shards_publish_whole_blocks_only() {
    let Some(moto) = Moto::start() else { return };
    let bucket = moto.bucket();
    let writer = S3Store::open(moto.config(&bucket)).expect("open");
    let reader = S3Store::open(moto.config(&bucket)).expect("open");
    let ids = [10, 11];
    let mut src = Blocks::filled(&ids);
    // one task per layer (shard), last layer first
    for s in [3, 0, 2] {
        let t = writer.dump(src.shards(&ids, &[s]), 0).unwrap();
        writer.wait(t).unwrap();
        assert_eq!(
            reader.lookup(&[id(10), id(11)]).unwrap(),
            vec![false, false]
        );
    }
    assert_eq!(writer.stats()["staged_blocks"], 2.0);
    let t = writer.dump(src.shards(&ids, &[1]), 0).unwrap();
    writer.wait(t).unwrap();
    assert_eq!(writer.stats()["staged_blocks"], 0.0);
    assert_eq!(writer.stats()["put_requests"], 2.0);
    // another engine (another node) sees the blocks and reads them back
    assert_eq!(reader.lookup(&[id(10), id(11)]).unwrap(), vec![true, true]);
    let mut dst = Blocks::zeroed(2);
    let t = reader.load(dst.shards(&ids, &ALL)).unwrap();
    reader.wait(t).unwrap();
    assert_eq!(src.data, dst.data);
    // dumping a block it already wrote is free
    let puts = writer.stats()["put_requests"];
    let t = writer.dump(src.shards(&ids, &ALL), 0).unwrap();
    writer.wait(t).unwrap();
    assert_eq!(writer.stats()["put_requests"], puts);
}

#[test]
fn corrupt_and_foreign_objects_are_detected() {
    let Some(moto) = Moto::start() else { return };
    let bucket = moto.bucket();
    let store = S3Store::open(moto.config(&bucket)).expect("open");
    let ids = [20];
    let mut src = Blocks::filled(&ids);
    let t = store.dump(src.shards(&ids, &ALL), 0).unwrap();
    store.wait(t).unwrap();
    let key = store.object_key(&id(20));
    let (_, mut body) = http(moto.port, "GET", &format!("/{bucket}/{key}"), b"").unwrap();
    let off = store.layout().offset(2) as usize + 4096 + 100;
    body[off] ^= 0xff;
    let (status, _) = http(moto.port, "PUT", &format!("/{bucket}/{key}"), &body).unwrap();
    assert_eq!(status, 200);
    let mut dst = Blocks::zeroed(1);
    let t = store.load(dst.shards(&ids, &[2])).unwrap();
    let e = store.wait(t).unwrap_err();
    assert_eq!(e.code(), -50011, "{e}");
    assert!(
        dst.data[0].iter().all(|&b| b == 0),
        "no corrupt bytes delivered"
    );
    // the corrupt object was removed, so the block reads as absent
    assert_eq!(store.lookup(&[id(20)]).unwrap(), vec![false]);
    // a store with another tensor layout refuses the block without deleting it
    let t = store.dump(src.shards(&ids, &ALL), 0).unwrap();
    store.wait(t).unwrap();
    let mut other_cfg = moto.config(&bucket);
    other_cfg.tensor_size_list = vec![SHARD];
    let other = S3Store::open(other_cfg).expect("open");
    let mut one = Blocks::zeroed(1);
    let shard = ShardIo {
        block: id(20),
        index: 0,
        segs: vec![MemSeg {
            addr: one.data[0].as_mut_ptr() as usize,
            len: SHARD,
        }],
    };
    let t = other.load(vec![shard]).unwrap();
    let e = other.wait(t).unwrap_err();
    assert!(e.to_string().contains("another layout"), "{e}");
    assert_eq!(store.lookup(&[id(20)]).unwrap(), vec![true]);
}

#[test]
fn open_fails_clearly_for_missing_bucket_and_dead_endpoint() {
    let Some(moto) = Moto::start() else { return };
    let e = S3Store::open(moto.config("no-such-bucket"))
        .err()
        .expect("error");
    assert!(
        e.to_string().contains("does not exist") && e.to_string().contains("no-such-bucket"),
        "{e}"
    );
    let mut cfg = moto.config("whatever");
    cfg.endpoint = format!("http://127.0.0.1:{}", free_port());
    cfg.retries = 1;
    let started = Instant::now();
    let e = S3Store::open(cfg).err().expect("error");
    assert!(e.to_string().contains("s3_endpoint"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(15));
    let mut cfg = moto.config("whatever");
    cfg.access_key = "${UCM_TEST_SURELY_UNSET_VAR}".into();
    let e = S3Store::open(cfg).err().expect("error");
    assert!(e.to_string().contains("UCM_TEST_SURELY_UNSET_VAR"), "{e}");
}

#[test]
fn server_outage_and_slow_server() {
    let Some(mut moto) = Moto::start() else {
        return;
    };
    let bucket = moto.bucket();
    let mut cfg = moto.config(&bucket);
    cfg.timeout_ms = 1500;
    cfg.retries = 1;
    cfg.lookup_cache_ttl_ms = 0;
    let store = S3Store::open(cfg).expect("open");
    let ids = [30];
    let mut src = Blocks::filled(&ids);
    let t = store.dump(src.shards(&ids, &ALL), 0).unwrap();
    store.wait(t).unwrap();

    // Slow server: it stops answering; every call returns within timeout_ms.
    moto.signal("-STOP");
    let started = Instant::now();
    let mut dst = Blocks::zeroed(1);
    let t = store.load(dst.shards(&ids, &ALL)).unwrap();
    let e = store.wait(t).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_millis(4000),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(e.code(), -50010 | -1), "{e}");
    assert_eq!(store.lookup(&[id(30)]).unwrap(), vec![false]);
    moto.signal("-CONT");

    // Stopped server: loads and dumps fail (no hang, no crash), lookups miss.
    moto.stop();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let t = store.load(dst.shards(&ids, &ALL)).unwrap();
    assert!(store.wait(t).is_err());
    let mut more = Blocks::filled(&[31]);
    let t = store.dump(more.shards(&[31], &ALL), 0).unwrap();
    assert!(store.wait(t).is_err());
    assert_eq!(store.lookup(&[id(30), id(31)]).unwrap(), vec![false, false]);
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(store.stats()["breaker_trips"] >= 1.0);

    // Back again (empty: moto keeps data in memory): dumps go through.
    moto.restart();
    let (status, _) = http(moto.port, "PUT", &format!("/{bucket}"), b"").unwrap();
    assert_eq!(status, 200);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let t = store.dump(more.shards(&[31], &ALL), 0).unwrap();
        if store.wait(t).is_ok() {
            break;
        }
        assert!(Instant::now() < until, "dumps never recovered");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(store.lookup(&[id(31)]).unwrap(), vec![true]);
    let mut back = Blocks::zeroed(1);
    let t = store.load(back.shards(&[31], &ALL)).unwrap();
    store.wait(t).unwrap();
    assert_eq!(back.data, more.data);
}
