//! The S3 store against a real S3-compatible server: `moto_server` (PyPI
//! `moto[server]`) started on a free 127.0.0.1 port by the tests. Skipped,
//! with a message, only when no `moto_server` binary can be found (CI
//! installs it through requirements-dev.txt into `.venv`).

#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::remote::{
    corrupt_load_is_refused, dump_layer_wise, id, open_fails_naming, round_trip, survive_outage,
    Blocks, TestServer, ALL, SHARD, SHARDS,
};
use common::server::{poll, spawn_quiet};
use ucm_core::config::Geometry;
use ucm_core::store::s3::{S3Config, S3Store};
use ucm_core::store::Store;
use ucm_core::{MemSeg, ShardIo};

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
    let stopped = poll(Duration::from_secs(5), Duration::from_millis(10), || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
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
            })
    });
    if stopped {
        std::thread::sleep(Duration::from_millis(50));
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
        let child = spawn_quiet(
            Command::new(&self.bin).args(["-H", "127.0.0.1", "-p", &self.port.to_string()]),
            "spawn moto_server",
        );
        self.child = Some(child);
        let up = poll(Duration::from_secs(30), Duration::from_millis(100), || {
            matches!(http(self.port, "GET", "/", b""), Ok((200, _)))
        });
        if up {
            return;
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
            geometry: Geometry {
                block_size: SHARD * SHARDS,
                shard_size: SHARD,
                tensor_size_list: vec![SHARD / 2, SHARD / 2],
            },
            timeout_ms: 10_000,
            retries: 2,
            negative_cache_ttl_ms: 0,
            ..Default::default()
        }
    }
}

/// The outage check's view of moto; `bucket` is recreated on restart.
struct MotoOutage<'a> {
    moto: &'a mut Moto,
    bucket: String,
}

impl TestServer for MotoOutage<'_> {
    fn pause(&mut self) {
        self.moto.signal("-STOP");
    }

    fn resume(&mut self) {
        self.moto.signal("-CONT");
    }

    fn stop(&mut self) {
        self.moto.stop();
        std::thread::sleep(Duration::from_millis(300));
    }

    fn restart(&mut self) {
        self.moto.restart();
        let (status, _) = http(self.moto.port, "PUT", &format!("/{}", self.bucket), b"").unwrap();
        assert_eq!(status, 200);
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.stop();
    }
}

#[test]
fn round_trip_lookup_and_layout() {
    let Some(moto) = Moto::start() else { return };
    let bucket = moto.bucket();
    let store = S3Store::open(moto.config(&bucket)).expect("open");
    round_trip(&store, &store);
    // The object is a Posix block file: header magic at every stride.
    let key = store.object_key(&id(1));
    let (status, body) = http(moto.port, "GET", &format!("/{bucket}/{key}"), b"").unwrap();
    assert_eq!(status, 200);
    assert_eq!(body.len() as u64, store.layout().file_len());
    for s in 0..SHARDS {
        let off = store.layout().offset(s) as usize;
        assert_eq!(&body[off..off + 8], b"UCMKVBLK");
    }
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
    let mut src = dump_layer_wise(&writer, &reader, &ids, &|| {
        assert_eq!(writer.stats()["staged_blocks"], 2.0);
    });
    assert_eq!(writer.stats()["staged_blocks"], 0.0);
    assert_eq!(writer.stats()["put_requests"], 2.0);
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
    // the corrupt object is refused, and removed
    corrupt_load_is_refused(&store, 20, 2);
    // a store with another tensor layout refuses the block without deleting it
    let t = store.dump(src.shards(&ids, &ALL), 0).unwrap();
    store.wait(t).unwrap();
    let mut other_cfg = moto.config(&bucket);
    other_cfg.geometry.tensor_size_list = vec![SHARD];
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
    open_fails_naming(S3Store::open(cfg), "s3_endpoint");
    assert!(started.elapsed() < Duration::from_secs(15));
    let mut cfg = moto.config("whatever");
    cfg.access_key = "${UCM_TEST_SURELY_UNSET_VAR}".into();
    open_fails_naming(S3Store::open(cfg), "UCM_TEST_SURELY_UNSET_VAR");
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
    // Back again empty (moto keeps data in memory).
    let mut server = MotoOutage {
        moto: &mut moto,
        bucket,
    };
    survive_outage(&store, &mut server, 30, 31, false, Duration::from_secs(10));
}
